"""Asynchronous dataflow against a synchronous trainer-centric loop, on a long-tail
workload (issue 18, point 5).

The same topology, model, data, reward, batch size, samples per task and cores, in two
modes, one after the other:

* **async**: ``astraflow up`` on the topology, as the product runs (its RaaS pool of N
  nodes, processors, trainers, feeder) for ``--duration`` seconds;
* **sync**: ``bench/sync_loop.py``, one process doing what a colocated synchronous system
  does: per iteration the next B tasks of the same task stream, all rolled out with the
  RaaS node's code on N rollout slots, the whole batch awaited, one step per policy with
  the same ``Trainer`` and hyper-parameters, the new weights loaded into the engines; for
  as long as the asynchronous run trained (from its version 0 to its last version).

The long tail: every task's rollout is followed by its environment's delay (the
workflows' ``env_latency``), drawn from a Pareto distribution seeded by the task's id
(``per_task``), so a task waits the same in both modes. Cases (``--cases``): ``single``
(``topology/default.yaml``, one policy) and ``multi`` (``topology/solver-verifier.yaml``,
solver and verifier trained together, both policies trained each sync iteration). Each
case's topology gets N nodes with one task per transaction (``--nodes``, default 8: one
slot per task of a batch, as a synchronous engine has the whole batch in flight), the
delay, a ``tasks`` topic with a partition per node, every weight blob kept, and no online
evaluator: held-out accuracy is scored after the runs, off the clock, with the
evaluator's settings and scoring (``astraflow.eval.evaluator.held_out_scorer``) on every
k-th version of both modes (k: the topology's ``eval`` interval); the async versions are
rebuilt from the run's weight stream.

Printed per case, the two modes side by side: versions reached, time per iteration
(mean, median, p90; the first iteration, which fills the pipeline, left out), held-out
accuracy at version and wall-time checkpoints (wall time since version 0), the best
accuracy (mean of 3 consecutive evaluations), the time each mode took to reach a common
level (the lower of the two bests) and the speed-ups; then where the synchronous time
went (rollout, of which waiting on stragglers, training, weight loading) and what the
asynchronous run dropped as stale.

Usage (needs Java and Maven for the embedded broker, like ``astraflow up``):

    python bench/async_vs_sync.py [--duration 300] [--cases single,multi] [--nodes 8]
        [--scale-s 0.3] [--alpha 1.5] [--max-s 20] [--out bench/results/async_vs_sync.json]
    python bench/async_vs_sync.py --quick      # single case, 60 s: a smoke run
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
for _p in (str(REPO), str(REPO / "bench")):  # this checkout's package, and sync_loop
    if _p not in sys.path:
        sys.path.insert(0, _p)

import sync_loop  # noqa: E402
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

CASES = {"single": "topology/default.yaml", "multi": "topology/solver-verifier.yaml"}
RUN_PREFIX = "bench-avs"
WINDOW = 3  # evaluations averaged for "best" and "reached"


# --- the long-tail topology (plain dicts) -------------------------------------------------


def latency_option(scale_s: float, alpha: float, max_s: float, seed: int) -> dict[str, Any]:
    """The workflows' ``env_latency``: Pareto, seeded per task."""
    return {"dist": "pareto", "scale_s": scale_s, "alpha": alpha, "max_s": max_s,
            "seed": seed, "per_task": True}


def long_tail_topology(base: dict[str, Any], case: str, *, nodes: int,
                       latency: dict[str, Any], models_dir: str) -> dict[str, Any]:
    """``base`` made into the bench's topology of ``case`` (a new dict, ``eval`` kept: the
    async run drops it, see ``without_eval``): run ``bench-avs-<case>``, ``nodes`` nodes
    per pool taking one task per transaction, the delay on every workflow, a ``tasks``
    partition per node, each policy's model under ``models_dir``, every blob kept."""
    doc = copy.deepcopy(base)
    doc["run"] = f"{RUN_PREFIX}-{case}"
    for policy, spec in doc["policies"].items():
        spec["model"] = f"{models_dir}/{policy}"
        spec["trainer"] = {**(spec.get("trainer") or {}), "keep_versions": 0}
    for pool in doc["pools"].values():
        pool["nodes"] = nodes
        pool["tasks_per_transaction"] = 1
        pool["workflows"] = {name: {**(opts or {}), "env_latency": dict(latency)}
                             for name, opts in (pool.get("workflows") or {}).items()}
    tasks = doc.setdefault("topics", {}).setdefault("tasks", {}) or {}
    parts = tasks.get("partitions", (doc.get("topic_defaults") or {}).get("partitions", 1))
    doc["topics"]["tasks"] = {**tasks, "partitions": max(nodes, int(parts))}
    return doc


def without_eval(doc: dict[str, Any]) -> dict[str, Any]:
    """``doc`` without its online evaluator (scored afterwards instead)."""
    out = copy.deepcopy(doc)
    out.pop("eval", None)
    return out


def write_topologies(case: str, args: argparse.Namespace) -> tuple[Path, Any, Any]:
    """The case's run file (no evaluator) and its topologies: ``(path, run, with eval)``."""
    from astraflow.config.topology import load_topology, parse_topology

    base = yaml.safe_load((REPO / CASES[case]).read_text())
    latency = latency_option(args.scale_s, args.alpha, args.max_s, args.seed)
    doc = long_tail_topology(base, case, nodes=args.nodes, latency=latency,
                             models_dir=str(args.runs_dir / RUN_PREFIX / "models" / case))
    path = args.runs_dir / RUN_PREFIX / f"{case}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"# bench/async_vs_sync.py: {CASES[case]} with a long tail\n"
                    + yaml.safe_dump(without_eval(doc), sort_keys=False))
    return path, load_topology(path), parse_topology(doc, source=str(path))


def ensure_models(topo: Any) -> None:
    """Write each policy's warm-started tiny model unless it is there and up to date."""
    from astraflow.launch.provision import write_policy_model

    for policy, spec in topo.policies.items():
        write_policy_model(policy, spec)


# --- the asynchronous run ---------------------------------------------------------------


def run_async(path: Path, topo: Any, args: argparse.Namespace) -> dict[str, Any]:
    """``astraflow up PATH`` from version 0 for ``--duration`` seconds plus
    ``--startup-s`` (the processes' start before the trainer publishes version 0; the
    versions after ``--duration`` from version 0 are left out), its log in the runs dir;
    its summary.json."""
    from astraflow.launch.runs import start_over

    start_over(topo.run)
    log = args.runs_dir / RUN_PREFIX / f"{topo.run}-up.log"
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--keep-broker",
           "--duration", str(args.duration + args.startup_s), "--runs-dir",
           str(args.runs_dir)]
    print(f"[async] $ astraflow {' '.join(cmd[3:])}  (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        rc = subprocess.run(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"`astraflow up {path}` exited with {rc}; see {log}")
    print(f"[async] done in {time.time() - t0:.0f}s wall", flush=True)
    return json.loads((args.runs_dir / topo.run / "summary.json").read_text())


def read_versions(topo: Any, policy: str) -> tuple[dict[int, float], list[Any]]:
    """``({version: seconds since version 0 was published}, manifests)`` of ``policy``."""
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import WeightManifest

    config = topo.kafka.effective()
    recs = read_all(config, topo.full_name(f"weights.{policy}"), idle_s=3.0, timeout_s=300.0,
                    expect=WeightManifest)
    first: dict[int, int] = {}
    for r in recs:
        v = r.record.version
        first[v] = min(first.get(v, r.timestamp_ms), r.timestamp_ms)
    t0 = first.get(0, min(first.values(), default=0))
    return {v: (ms - t0) / 1000 for v, ms in sorted(first.items())}, [r.record for r in recs]


# --- scoring ------------------------------------------------------------------------------


class Scorer:
    """Held-out accuracy of a policy's weights, as the topology's evaluator scores them."""

    def __init__(self, topo_eval: Any, policy: str):
        from astraflow.eval.evaluator import held_out_scorer
        from astraflow.models.loading import load_policy

        s = sync_loop.launched(topo_eval, "-", f"eval-{policy}")  # EvalSettings
        self.every = s.every_versions
        self.score, self.prompts = held_out_scorer(s)
        self.model, self.tokenizer = load_policy(s.model, dtype=s.dtype)

    def __call__(self, state: dict[str, Any]) -> float:
        self.model.load_state_dict(state)
        return float(self.score(self.model, self.tokenizer))


def score_async(topo: Any, scorer: Scorer, policy: str, times: dict[int, float],
                manifests: list[Any], upto_s: float) -> list[tuple[float, int, float]]:
    """``(t, version, accuracy)`` of every k-th version published within ``upto_s``,
    rebuilt from the weight stream."""
    from astraflow.weights import WeightFollower

    follower = WeightFollower(policy=policy, kafka_config=topo.kafka.effective())
    follower.observe([m for m in manifests if m.policy == policy])
    curve = []
    try:
        for v, t in times.items():
            if v % scorer.every == 0 and t <= upto_s:
                follower.update(v)
                curve.append((t, v, scorer(follower.state)))
    finally:
        follower.close()
    return curve


def score_sync(loop: Any, scorer: Scorer, policy: str) -> list[tuple[float, int, float]]:
    """``(t, version, accuracy)`` of the synchronous loop's kept versions."""
    ends = {0: 0.0, **{it.version: it.end_s for it in loop.history}}
    return [(ends[v], v, scorer(state)) for v, state in sorted(loop.snapshots[policy].items())]


# --- figures ------------------------------------------------------------------------------


def per_iteration(ends: list[float]) -> dict[str, float]:
    """Mean, median and p90 of the intervals between consecutive versions (seconds),
    from the one after version 1 on (version 1's fills the pipeline)."""
    gaps = [b - a for a, b in zip(ends[1:], ends[2:])]
    if not gaps:
        return {}
    gaps.sort()
    return {"mean": statistics.fmean(gaps), "median": statistics.median(gaps),
            "p90": gaps[min(len(gaps) - 1, int(0.9 * len(gaps)))], "n": len(gaps)}


def smoothed(curve: list[tuple[float, int, float]]) -> list[tuple[float, int, float]]:
    """Each point's accuracy averaged with the ``WINDOW - 1`` evaluations before it."""
    out = []
    for i in range(WINDOW - 1, len(curve)):
        win = curve[i - WINDOW + 1:i + 1]
        out.append((curve[i][0], curve[i][1], statistics.fmean(a for *_, a in win)))
    return out


def reached(curve: list[tuple[float, int, float]], level: float) -> tuple[float, int] | None:
    """``(t, version)`` where the smoothed curve first reaches ``level``."""
    return next(((t, v) for t, v, a in smoothed(curve) if a >= level - 1e-9), None)


def at_time(curve: list[tuple[float, int, float]], t: float) -> tuple[int, float] | None:
    """``(version, accuracy)`` of the newest version evaluated by ``t`` seconds."""
    seen = [(v, a) for s, v, a in curve if s <= t]
    return seen[-1] if seen else None


def _time_to(curves: dict[str, list[tuple[float, int, float]]], level: float
             ) -> dict[str, Any]:
    """When each mode's smoothed curve first reached ``level``, and sync / async."""
    hit = {m: reached(c, level) for m, c in curves.items()}
    out: dict[str, Any] = {"level": level, "reached": hit}
    if hit.get("sync") and hit.get("async") and hit["async"][0] > 0:
        out["ratio"] = hit["sync"][0] / hit["async"][0]
    return out


def compare(curves: dict[str, list[tuple[float, int, float]]],
            levels: tuple[float, ...] = ()) -> dict[str, Any]:
    """Best smoothed accuracy per mode; the time each took to the common level (the lower
    best) and to each of ``levels`` above the start that either mode reached."""
    best = {m: max((a for *_, a in smoothed(c)), default=None) for m, c in curves.items()}
    if any(b is None for b in best.values()):
        return {"best": best}
    start = max(c[0][2] for c in curves.values())
    fixed = [_time_to(curves, lv) for lv in sorted(levels)
             if lv > start and lv <= max(best.values()) + 1e-9]
    return {"best": best, **_time_to(curves, min(best.values())), "fixed": fixed}


# --- one case: both modes -----------------------------------------------------------------


def run_sync(path: Path, topo: Any, scorers: dict[str, Scorer], duration: float) -> Any:
    """The synchronous loop of ``topo`` for ``duration`` seconds (one line per 10
    iterations); the loop, its history and kept versions."""
    loop = sync_loop.SyncLoop(topo, str(path), eval_every={p: s.every for p, s in
                                                           scorers.items()})
    print(f"[sync] {len(loop.nodes)} rollout slots, {loop.batch_tasks} tasks per iteration, "
          f"{duration:.0f}s", flush=True)

    def log(it: Any) -> None:
        if it.version % 10 == 0:
            print(f"[sync] v{it.version} at {it.end_s:.0f}s: rollout {it.rollout_s:.2f}s "
                  f"(stragglers {it.straggler_s:.2f}s), train {it.train_s:.2f}s, load "
                  f"{it.load_s:.3f}s, reward {it.reward}", flush=True)

    try:
        loop.run(duration_s=duration, log=log)
    finally:
        loop.close()
    return loop


def run_case(case: str, args: argparse.Namespace) -> dict[str, Any]:
    """Both modes of ``case``, scored: the figures ``report`` prints."""
    path, topo, topo_eval = write_topologies(case, args)
    ensure_models(topo)
    summary = run_async(path, topo, args)
    first = next(iter(topo.policies))
    times = {p: read_versions(topo, p) for p in topo.policies}
    span = min(args.duration, max(times[first][0].values(), default=0.0))
    scorers = {p: Scorer(topo_eval, p) for p in topo.policies}
    loop = run_sync(path, topo, scorers, span)
    print(f"[{case}] scoring held-out accuracy (off the clock)", flush=True)
    out: dict[str, Any] = {"case": case, "topology": str(path), "span_s": span,
                           "nodes": args.nodes, "tasks_per_iteration": loop.batch_tasks,
                           "policies": {}}
    for p, scorer in scorers.items():
        curves = {"async": score_async(topo, scorer, p, *times[p], upto_s=span),
                  "sync": score_sync(loop, scorer, p)}
        levels = tuple(args.levels) if p == first else ()
        ends = {"async": [t for v, t in times[p][0].items() if t <= span],
                "sync": [0.0] + [it.end_s for it in loop.history]}
        out["policies"][p] = {
            "every": scorer.every, "prompts": scorer.prompts, "curves": curves,
            "versions": {m: len(e) - 1 for m, e in ends.items()},
            "per_iteration": {m: per_iteration(e) for m, e in ends.items()},
            "compare": compare(curves, levels)}
    out["sync_breakdown"] = sync_loop.breakdown(loop.history)
    out["async_summary"] = {k: summary.get(k) for k in (
        "seconds", "versions", "staleness_dropped", "staleness_dropped_by_stage")}
    out["async_trainer"] = {p: {k: v for k, v in (summary.get("trainer") or {}).get(p, {}).items()
                                if k in ("trainer/wait_fraction", "trainer/step_seconds")}
                            for p in topo.policies}
    return out


# --- report -------------------------------------------------------------------------------


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.1%}"


def _s(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}s"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def _row(name: str, sync: str, asyn: str, ratio: str = "") -> str:
    return f"| {name} | {sync} | {asyn} | {ratio} |"


def _checkpoints(span: float, versions: dict[str, int], every: int
                 ) -> tuple[list[float], list[int]]:
    """Wall-time checkpoints (1/8, 1/4, 1/2, 3/4 and all of the span) and version
    checkpoints: five multiples of ``every`` up to the version both modes reached, and the
    last one the other mode reached."""
    times = sorted({round(span * f) for f in (0.125, 0.25, 0.5, 0.75, 1.0) if span * f >= 1})
    both, last = min(versions.values()), max(versions.values())
    step = max(every, (both // 5) // every * every)
    marks = list(range(0, both + 1, step))[:6]
    return [float(t) for t in times], marks + [last // every * every] * (last > marks[-1])


def _time_row(name: str, t: dict[str, Any]) -> str:
    hit = {m: "never" if h is None else f"{h[0]:.0f}s (v{h[1]})"
           for m, h in t["reached"].items()}
    ratio = f"{t['ratio']:.2f}x" if "ratio" in t else "-"
    return _row(name, hit["sync"], hit["async"], ratio)


def policy_rows(p: str, r: dict[str, Any]) -> list[str]:
    """The table rows of one policy of a case."""
    it, ver, cmp_ = r["per_iteration"], r["versions"], r["compare"]
    rows = [_row(f"**{p}**: versions reached", str(ver["sync"]), str(ver["async"]),
                 _ratio(ver["async"], ver["sync"]))]
    for k in ("mean", "median", "p90"):
        rows.append(_row(f"time per iteration, {k}", _s(it["sync"].get(k)),
                         _s(it["async"].get(k)),
                         _ratio(it["sync"].get(k), it["async"].get(k))))
    span = max((c[-1][0] for c in r["curves"].values() if c), default=0.0)
    times, versions = _checkpoints(span, ver, r["every"])
    exact = {m: {v: a for _, v, a in c} for m, c in r["curves"].items()}
    for v in versions:
        rows.append(_row(f"held-out accuracy at v{v}", _pct(exact["sync"].get(v)),
                         _pct(exact["async"].get(v))))
    for t in times:
        got = {m: at_time(c, t) for m, c in r["curves"].items()}
        cell = {m: "-" if g is None else f"{g[1]:.1%} (v{g[0]})" for m, g in got.items()}
        rows.append(_row(f"held-out accuracy at {t:.0f}s", cell["sync"], cell["async"]))
    best = cmp_.get("best", {})
    rows.append(_row(f"best accuracy (mean of {WINDOW} evaluations)", _pct(best.get("sync")),
                     _pct(best.get("async"))))
    if "level" in cmp_:
        rows += [_time_row(f"time to {t['level']:.0%}", t) for t in cmp_["fixed"]]
        rows.append(_time_row(f"time to {cmp_['level']:.1%} (the lower best)", cmp_))
    return rows


def case_table(r: dict[str, Any]) -> str:
    """The markdown table of one case, and the lines under it."""
    lines = [f"case {r['case']}: {r['topology']}, {r['nodes']} nodes / rollout slots, "
             f"{r['tasks_per_iteration']} tasks per iteration, {r['span_s']:.0f}s from "
             "version 0 per mode", "",
             "| | sync | async | speed-up |", "|---|---|---|---|"]
    for p, pr in r["policies"].items():
        lines += policy_rows(p, pr)
    b = r["sync_breakdown"]
    if b:
        lines += ["", f"sync, mean per iteration: {b['iteration_s']:.2f}s = rollout "
                  f"{b['rollout_s']:.2f}s (of which waiting on stragglers "
                  f"{b['straggler_s']:.2f}s; slots busy {b['slots_busy']:.0%} of the "
                  f"rollout) + train {b['train_s']:.2f}s + weight load {b['load_s']:.3f}s"]
    if len(r["policies"]) > 1:
        lines.append("other policies than the first: the sync loop steps each once per "
                     "iteration on that iteration's groups; async, when its batcher holds "
                     "batch_size groups")
    s = r["async_summary"]
    waits = ", ".join(f"{p} waited {t.get('trainer/wait_fraction', 0):.0%}"
                      for p, t in r["async_trainer"].items())
    lines.append(f"async: stale groups dropped {s.get('staleness_dropped') or 0:.0f} "
                 f"({s.get('staleness_dropped_by_stage') or {}}); trainers: {waits}")
    return "\n".join(lines)


def headline(results: list[dict[str, Any]]) -> str:
    """One line per case: sync / async time per iteration and time to each level."""
    out = []
    for r in results:
        p, pr = next(iter(r["policies"].items()))
        it, cmp_ = pr["per_iteration"], pr["compare"]
        times = [t for t in (*cmp_.get("fixed", ()), cmp_) if "ratio" in t]
        levels = ", ".join(f"{t['level']:.1%} {t['ratio']:.2f}x" for t in times)
        out.append(f"{r['case']}: time per iteration sync/async "
                   f"{_ratio(it['sync'].get('mean'), it['async'].get('mean'))} ({p}, mean); "
                   f"time to held-out accuracy sync/async: {levels or '-'} (the last: the "
                   "lower best)")
    return "\n".join(out)


def rescored(results: list[dict[str, Any]], levels: list[float]) -> list[dict[str, Any]]:
    """Results read back from ``--out`` with their comparisons made again (``levels`` for
    each case's first policy)."""
    for r in results:
        for i, pr in enumerate(r["policies"].values()):
            curves = {m: [tuple(x) for x in c] for m, c in pr["curves"].items()}
            pr["compare"] = compare(curves, tuple(levels) if i == 0 else ())
    return results


def main(argv: list[str] | None = None) -> int:
    """Run the cases, print their tables and the speed-ups, write ``--out``."""
    import os

    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    args = parse_args(argv)
    if args.report:
        results = rescored(json.loads(Path(args.report).read_text())["results"], args.levels)
        print("\n\n".join(case_table(r) for r in results) + "\n\n" + headline(results))
        return 0
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    meta = run_meta("async_vs_sync", ["python", *(sys.argv if argv is None else argv)])
    results = []
    t0 = time.time()
    for case in args.cases:
        print(f"[bench] case {case}: {CASES[case]}", flush=True)
        results.append(run_case(case, args))
    print()
    for r in results:
        print(case_table(r) + "\n")
    print(headline(results))
    out = {"meta": meta,
           "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
           "seconds": round(time.time() - t0, 1), "results": results}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {args.out}")
    return 0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    """The bench's flags (``--quick``: the single case for 60 s)."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--duration", type=float, default=300.0,
                    help="seconds per mode and case from version 0 (default 300); the sync "
                    "loop runs as long as the async run trained, if that was less")
    ap.add_argument("--startup-s", type=float, default=90.0,
                    help="added to the async run's duration for its processes to start")
    ap.add_argument("--cases", default="single,multi", help="comma-separated: single, multi")
    ap.add_argument("--nodes", type=int, default=8, help="RaaS nodes = sync rollout slots")
    ap.add_argument("--scale-s", type=float, default=0.3, help="Pareto minimum delay (s)")
    ap.add_argument("--alpha", type=float, default=1.5, help="Pareto tail index")
    ap.add_argument("--max-s", type=float, default=20.0, help="longest delay (s)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the per-task delays")
    ap.add_argument("--levels", type=lambda t: [float(x) for x in t.split(",")],
                    default=[0.75, 0.8, 0.85, 0.9], help="accuracy levels of the first "
                    "policy to time both modes to, besides the lower best")
    ap.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    ap.add_argument("--out", default=str(REPO / "bench" / "results" / "async_vs_sync.json"))
    ap.add_argument("--quick", action="store_true", help="a smoke run: single case, 60 s")
    ap.add_argument("--report", metavar="FILE.json",
                    help="print the tables of an earlier run's --out file and exit")
    args = ap.parse_args(argv)
    if args.quick:
        args.cases, args.duration, args.startup_s = "single", 60.0, 45.0
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in args.cases if c not in CASES]
    if unknown:
        ap.error(f"unknown cases {unknown} (known: {', '.join(CASES)})")
    args.runs_dir = args.runs_dir.resolve()
    return args


if __name__ == "__main__":
    raise SystemExit(main())
