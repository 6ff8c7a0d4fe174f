"""Solver + verifier against the solver alone, at equal CPU-seconds and wall time.

Runs ``astraflow up`` on a two-policy topology (``--topology``, default
``topology/solver-verifier.yaml``) and on its one-policy variant, the solver alone
(``alone_topology``: the same solver model recipe, trainer, pool and feeder, the
``single_turn`` workflow instead of ``solve_verify``, no verifier; both written to
``<runs-dir>/bench-multipolicy-<kind>-s<seed>.yaml``), one after another (each from
version 0, ``--duration`` seconds each, one pair per seed), and reads each run's
``summary.json``: the evaluator's held-out accuracy of every evaluated version with the
seconds since the run's processes started.

**Equal compute.** While a run goes, the bench samples the CPU time of its process tree
each second (``/proc/<pid>/stat``: user + system, reaped children included), without the
broker's JVM and without the evaluators (they measure, they do not train; a two-policy
run has two). Each evaluation is placed at the training CPU-seconds spent by its time, so
the curves are also read at equal CPU-seconds (``--cpu-checkpoints``). On a machine whose
cores are all busy in both runs, equal CPU-seconds and equal wall time nearly coincide;
the bench prints both, and each run's mean cores in use.

**Seeds.** ``--seeds 0,1,2`` runs the pair once per seed (the feeder's task order and
every trainer's seed; sampling is not seeded, see ``seeded``; the starting model is the
same), alternating which goes first. Each figure is then given as a mean with a 95 %
confidence interval (Student's t over the seeds), and the difference together - alone is
taken per seed (paired) with its own interval: an interval that contains 0 means the
runs cannot tell the two apart.

Printed per run and over the seeds:

* the solver's held-out accuracy at each checkpoint (``--checkpoints``, seconds): the
  accuracy of the newest version evaluated by then;
* its final accuracy (mean of the last ``--tail`` evaluations: one evaluation of 200
  prompts moves by 0.5 points a prompt, so a single one is noisy) and its mean over the
  whole run (area under the curve over time);
* the seconds until it first reached ``--target`` (default 0.90);
* versions published, and the verifier's held-out verdict accuracy at version 0, its
  final (tail mean) and its best.

Usage (needs Java and Maven for the embedded broker, like ``astraflow up``):

    python bench/multipolicy.py [--duration 330] [--seeds 0,1,2]
        [--topology topology/solver-verifier.yaml] [--cpu-checkpoints 60,120,240,400,600]
        [--eval-every VERSIONS] [--out bench/results/multipolicy.json]

On SmolLM2-135M-Instruct: ``--topology topology/smollm2-solver-verifier.yaml`` (the solver
alone keeps its reward, exact match + closeness, without the verdict's share).

Both topologies share the solver's model recipe, so the first run writes the warm-started
model (about 80 s, not timed: the clock of a run starts when its processes do).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

TOGETHER = "topology/solver-verifier.yaml"


def alone_topology(together: dict[str, Any], solver: str = "solver") -> dict[str, Any]:
    """The solver of a two-policy topology (dict) trained alone: every other policy, its
    topics and the processors that serve only it removed, the workflow ``single_turn``."""
    topo = copy.deepcopy(together)
    # a model path of its own per two-policy topology: a tiny solver and an imported one
    # never share a directory
    topo["run"] = f"{together['run']}-alone"
    others = [p for p in topo["policies"] if p != solver]
    topo["policies"] = {solver: topo["policies"][solver]}
    topo["policies"][solver]["model"] = f"runs/{topo['run']}/{solver}"

    def theirs(topic: str) -> bool:
        return any(topic.startswith(f"{kind}.{p}") for p in others
                   for kind in ("samples", "batches", "weights"))

    topo["topics"] = {t: v for t, v in topo["topics"].items() if not theirs(t)}
    procs = {}
    for name, proc in topo["processors"].items():
        outs = [t for t in proc.get("outputs", []) if not theirs(t)]
        if proc.get("outputs") and not outs or any(theirs(t) for t in proc.get("inputs", [])):
            continue  # serves another policy only
        opts = dict(proc.get("options") or {})
        if "policies" in opts:
            opts["policies"] = [solver]
        procs[name] = {**proc, "outputs": outs, **({"options": opts} if opts else {})}
    topo["processors"] = procs
    for pool in topo["pools"].values():
        pool["workflows"] = {("single_turn" if name == "solve_verify" else name):
                             (_single_turn_options(opts) if name == "solve_verify" else opts)
                             for name, opts in (pool.get("workflows") or {}).items()}
    feeder = topo["feeder"]
    if feeder.get("workflow"):
        feeder["workflow"] = "single_turn"
    if feeder.get("policies"):
        feeder["policies"] = [p for p in feeder["policies"] if p == solver]
    return topo


# the solver's options of a ``solve_verify`` pool that ``single_turn`` takes too: its
# sampling and its reward (``reward``: the solver's, before any verdict is mixed in)
SOLVER_OPTIONS = ("max_new_tokens", "temperature", "top_p", "seed", "reward")


def _single_turn_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The ``single_turn`` options of a ``solve_verify`` pool: the solver's sampling
    options and reward only."""
    return {k: v for k, v in opts.items() if k in SOLVER_OPTIONS}


def evaluated_every(topo: dict[str, Any], versions: int | None) -> dict[str, Any]:
    """The topology (dict) with its evaluators scoring every ``versions``-th version
    (None: unchanged); a policy's own ``eval.every_versions`` is overridden too."""
    if versions is None:
        return topo
    topo = copy.deepcopy(topo)
    topo.setdefault("eval", {})["every_versions"] = versions
    for spec in topo["policies"].values():
        if "every_versions" in (spec.get("eval") or {}):
            spec["eval"]["every_versions"] = versions
    return topo


CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def proc_stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds: user + system, its reaped children's included) of a
    process, from /proc; None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) "
    ppid = int(fields[1])
    utime, stime, cutime, cstime = (int(x) for x in fields[11:15])
    return ppid, (utime + stime + cutime + cstime) / CLK_TCK


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def not_training(cmdline: str) -> bool:
    """Processes whose CPU is not the run's training compute: the broker (a JVM) and the
    evaluators."""
    return "java" in cmdline.split(" ")[0] or " eval run " in f" {cmdline} "


def tree_cpu(root: int) -> tuple[float, float]:
    """(training CPU-seconds, all CPU-seconds) of ``root`` and its live descendants; a
    reaped process counts in its parent's children's times, each exactly once."""
    stats = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit() and (st := proc_stat(int(d.name))) is not None:
            stats[int(d.name)] = st
    kids: dict[int, list[int]] = {}
    for pid, (ppid, _) in stats.items():
        kids.setdefault(ppid, []).append(pid)
    train = total = 0.0
    todo = [root] if root in stats else []
    while todo:
        pid = todo.pop()
        total += stats[pid][1]
        if not not_training(_cmdline(pid)):
            train += stats[pid][1]
        todo += kids.get(pid, [])
    return train, total


class CpuMeter:
    """Samples ``tree_cpu`` of a process every ``interval_s`` in a thread: a series of
    (epoch seconds, training CPU-s, all CPU-s)."""

    def __init__(self, pid: int, interval_s: float = 1.0):
        self.pid, self.interval_s = pid, interval_s
        self.series: list[tuple[float, float, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            train, total = tree_cpu(self.pid)
            if total > 0:
                self.series.append((time.time(), train, total))
            self._stop.wait(self.interval_s)

    def stop(self) -> list[tuple[float, float, float]]:
        self._stop.set()
        self._thread.join()
        return self.series


def cpu_at(series: list[tuple[float, float, float]], when: float) -> float:
    """Training CPU-seconds by epoch time ``when`` (linear between samples; never less
    than what was spent before)."""
    if not series or when <= series[0][0]:
        return series[0][1] if series else 0.0
    for (t0, c0, _), (t1, c1, _) in zip(series, series[1:]):
        if when <= t1:
            return c0 + (c1 - c0) * (when - t0) / max(t1 - t0, 1e-9)
    return series[-1][1]


def with_cpu(summary: dict[str, Any], series: list[tuple[float, float, float]]
             ) -> dict[str, Any]:
    """The summary's evaluation curves with each point's training CPU-seconds since the
    run's processes started (``cpu``), and the run's mean cores in use."""
    start = summary.get("started_at")
    if start is None or not series:
        return summary
    base = cpu_at(series, start)
    out = dict(summary)
    out["eval"] = {p: [{**x, "cpu": round(cpu_at(series, start + x["t"]) - base, 1)}
                       for x in pts] for p, pts in summary.get("eval", {}).items()}
    wall = max(series[-1][0] - start, 1e-9)
    out["cores_in_use"] = round((series[-1][1] - base) / wall, 2)
    out["cpu_training_s"] = round(series[-1][1] - base, 1)
    return out


def run_up(topology: str, duration: float, runs_dir: Path, log: Path) -> dict[str, Any]:
    """``astraflow up TOPOLOGY --duration D`` from version 0; its summary.json, each
    evaluation with the training CPU-seconds spent by then (``with_cpu``)."""
    run = yaml.safe_load(Path(REPO / topology).read_text())["run"]
    from astraflow.launch.runs import start_over

    start_over(run)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", topology, "--keep-broker",
           "--duration", str(duration), "--runs-dir", str(runs_dir)]
    print(f"$ {' '.join(cmd[2:])}  (log {log})", flush=True)
    t0 = time.time()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=f, stderr=subprocess.STDOUT)
        meter = CpuMeter(proc.pid)
        rc = proc.wait()
        series = meter.stop()
    if rc != 0:
        raise SystemExit(f"`astraflow up {topology}` exited with {rc}; see {log}")
    summary = json.loads((runs_dir / run / "summary.json").read_text())
    print(f"  done in {time.time() - t0:.0f}s wall", flush=True)
    return with_cpu(summary, series)


def seeded(topo: dict[str, Any], seed: int) -> dict[str, Any]:
    """The topology (dict) with ``seed`` for the feeder's task order and every trainer;
    the starting model (warm start) unchanged. Sampling is left unseeded: a workflow's
    ``seed`` seeds every ``generate`` call alike, so each call would draw the same random
    numbers and a run would explore far less than an unseeded one (on SmolLM2 the solver
    alone earned no reward in 23 versions)."""
    topo = copy.deepcopy(topo)
    topo.setdefault("feeder", {})["seed"] = seed
    for spec in topo["policies"].values():
        spec["trainer"] = {**(spec.get("trainer") or {}), "seed": seed}
    return topo


def accuracy_at(curve: list[dict[str, float]], t: float, key: str = "t") -> float | None:
    """The accuracy of the newest version evaluated by ``t`` (seconds, or CPU-seconds
    with ``key="cpu"``)."""
    seen = [p["accuracy"] for p in curve if key in p and p[key] <= t]
    return seen[-1] if seen else None


def curve_figures(curve: list[dict[str, float]], checkpoints: list[float], tail: int,
                  target: float, cpu_checkpoints: list[float] = (),
                  cpu_spent: float | None = None) -> dict[str, Any]:
    """A curve's figures; a CPU checkpoint past what the run spent (``cpu_spent``)
    has none."""
    if not curve:
        return {"evaluations": 0}
    accs = [p["accuracy"] for p in curve]
    reached = next((p for p in curve if p["accuracy"] >= target), None)
    return {
        "evaluations": len(curve),
        "start": accs[0],
        "final": statistics.fmean(accs[-tail:]),
        "best": max(accs),
        "mean": statistics.fmean(accs),
        "last_version": curve[-1]["version"],
        "seconds_to_target": reached["t"] if reached else None,
        "cpu_to_target": reached.get("cpu") if reached else None,
        "at": {str(int(c)): accuracy_at(curve, c) for c in checkpoints},
        "at_cpu": {str(int(c)): accuracy_at(curve, c, "cpu") for c in cpu_checkpoints
                   if "cpu" in curve[0] and (cpu_spent is None or c <= cpu_spent)},
    }


def figures(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    ev = summary.get("eval", {})
    cps, cpu_cps = args.checkpoints, args.cpu_checkpoints
    spent = summary.get("cpu_training_s")
    out = {"seconds": summary.get("seconds"), "versions": summary.get("versions"),
           "cores_in_use": summary.get("cores_in_use"),
           "cpu_training_s": summary.get("cpu_training_s"),
           "solver": curve_figures(ev.get("solver", []), cps, args.tail, args.target,
                                   cpu_cps, spent)}
    if "verifier" in ev:
        out["verifier"] = curve_figures(ev["verifier"], cps, args.tail, 2.0, cpu_cps, spent)
        out["workflow_metrics"] = summary.get("workflow_metrics")
    out["curves"] = {p: [(round(x["t"], 1), x.get("cpu"), x["version"], x["accuracy"])
                         for x in c] for p, c in ev.items()}
    return out


# two-sided 95 % quantiles of Student's t by degrees of freedom (1.96 beyond 30)
T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306,
       9: 2.262, 10: 2.228, 12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def mean_ci(values: list[float]) -> tuple[float, float | None]:
    """Mean and the half-width of its 95 % confidence interval (None for one value)."""
    m = statistics.fmean(values)
    if len(values) < 2:
        return m, None
    df = len(values) - 1
    t = T95.get(df) or next((T95[k] for k in sorted(T95) if k >= df), 1.96)
    return m, t * statistics.stdev(values) / math.sqrt(len(values))


def _ci_txt(values: list[float]) -> str:
    m, h = mean_ci(values)
    return f"{m:6.1%}" + ("" if h is None else f" ±{h:5.1%}")


def _fmt(x: float | None) -> str:
    return "  -  " if x is None else f"{x:5.1%}"


def report(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    report_runs(runs, args)
    report_seeds(runs, args)


def _paired(runs: list[dict[str, Any]], get) -> tuple[list[float], list[float], list[float]]:
    """Per seed, the figure ``get(run)`` of the solver alone, together, and their
    difference (together - alone), for the seeds where both have it."""
    by = {(r["kind"], r.get("seed")): get(r) for r in runs}
    seeds = sorted({r.get("seed") for r in runs}, key=str)
    pairs = [(by.get(("alone", s)), by.get(("together", s))) for s in seeds]
    pairs = [(a, t) for a, t in pairs if a is not None and t is not None]
    return [a for a, _ in pairs], [t for _, t in pairs], [t - a for a, t in pairs]


def report_seeds(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    """Means with 95 % intervals over the seeds, and the paired difference."""
    rows: list[tuple[str, Any]] = [
        (f"at {int(c)} CPU-s", lambda r, c=str(int(c)): r["solver"].get("at_cpu", {}).get(c))
        for c in args.cpu_checkpoints]
    rows += [(f"at {int(c)} s", lambda r, c=str(int(c)): r["solver"]["at"].get(c))
             for c in args.checkpoints]
    rows += [("final", lambda r: r["solver"].get("final")),
             ("mean over run", lambda r: r["solver"].get("mean"))]
    n = len({r.get("seed") for r in runs})
    print(f"\nsolver held-out accuracy over {n} seed(s): mean ±95 % CI (t); difference "
          "= together - alone, paired by seed")
    print(f"{'':18}{'alone':>16}{'together':>16}{'difference':>18}")
    for label, get in rows:
        alone, together, diff = _paired(runs, get)
        if not diff:
            continue
        print(f"{label:<18}{_ci_txt(alone):>16}{_ci_txt(together):>16}{_ci_txt(diff):>18}")
    _, _, diff = _paired(runs, lambda r: r["solver"].get("final"))
    if len(diff) >= 2:
        m, h = mean_ci(diff)
        verdict = ("the verifier helps the solver" if m - h > 0 else
                   "the verifier costs the solver" if m + h < 0 else
                   "the runs cannot tell them apart")
        print(f"final accuracy: {m:+.1%} ±{h:.1%} (95 % CI over {len(diff)} seeds): "
              f"{verdict}")


def report_runs(runs: list[dict[str, Any]], args: argparse.Namespace) -> None:
    cps = [str(int(c)) for c in args.checkpoints]
    print(f"\nsolver held-out accuracy (200 prompts) at equal wall-clock time; final = mean "
          f"of the last {args.tail} evaluations")
    print(f"{'run':<22}" + "".join(f"{c + 's':>8}" for c in cps)
          + f"{'final':>8}{'mean':>8}{'to ' + format(args.target, '.0%'):>8}{'versions':>10}")
    for r in runs:
        s = r["solver"]
        to = s.get("seconds_to_target")
        to_txt = "never" if to is None else f"{to:.0f}s"
        print(f"{r['name']:<22}" + "".join(f"{_fmt(s['at'].get(c)):>8}" for c in cps)
              + f"{_fmt(s['final']):>8}{_fmt(s['mean']):>8}"
              + f"{to_txt:>8}"
              + f"{s['last_version']:>10}")
    ccps = [str(int(c)) for c in args.cpu_checkpoints]
    print("\nat equal training CPU-seconds (evaluators and broker not counted)")
    print(f"{'run':<22}" + "".join(f"{c + ' CPU-s':>12}" for c in ccps) + f"{'cores':>8}")
    for r in runs:
        at = r["solver"].get("at_cpu", {})
        print(f"{r['name']:<22}" + "".join(f"{_fmt(at.get(c)):>12}" for c in ccps)
              + f"{r.get('cores_in_use') or 0:>8.2f}")
    for r in runs:
        if "verifier" in r:
            v = r["verifier"]
            print(f"{r['name']}: verifier held-out verdict accuracy {v['start']:.1%} at v0 -> "
                  f"{v['final']:.1%} final (best {v['best']:.1%}, v{v['last_version']})")
    for kind in ("alone", "together"):
        sel = [r["solver"] for r in runs if r["kind"] == kind]
        if sel:
            print(f"{kind}: solver final {statistics.fmean(s['final'] for s in sel):.1%}, "
                  f"mean {statistics.fmean(s['mean'] for s in sel):.1%} over {len(sel)} run(s)")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    floats = lambda s: [float(x) for x in s.split(",")]  # noqa: E731
    ap.add_argument("--duration", type=float, default=330.0, help="seconds per run")
    ap.add_argument("--seeds", type=lambda s: [int(x) for x in s.split(",")], default=[0],
                    help="one pair of runs per seed (default 0)")
    ap.add_argument("--topology", default=TOGETHER, help="the two-policy topology")
    ap.add_argument("--checkpoints", type=floats, default=[30.0, 60.0, 120.0, 200.0, 300.0])
    ap.add_argument("--cpu-checkpoints", type=floats,
                    default=[60.0, 120.0, 240.0, 400.0, 600.0],
                    help="training CPU-seconds at which to read the curves")
    ap.add_argument("--eval-every", type=int, metavar="VERSIONS",
                    help="evaluate every VERSIONS-th version (default: the topology's)")
    ap.add_argument("--tail", type=int, default=5)
    ap.add_argument("--target", type=float, default=0.90)
    ap.add_argument("--runs-dir", default="runs")
    ap.add_argument("--out", default="bench/results/multipolicy.json")
    ap.add_argument("--summaries", nargs=2, metavar=("ALONE", "TOGETHER"),
                    help="report on the summary.json of two finished runs instead")
    args = ap.parse_args(argv)
    args.meta = run_meta("multipolicy", ["python", *sys.argv] if argv is None
                         else ["python", "bench/multipolicy.py", *argv])
    runs_dir = (REPO / args.runs_dir).resolve()
    runs_dir.mkdir(parents=True, exist_ok=True)
    runs: list[dict[str, Any]] = []
    if args.summaries:
        for kind, f in zip(("alone", "together"), args.summaries):
            fig = figures(json.loads(Path(f).read_text()), args)
            runs.append({"name": f"{kind} ({Path(f).parent.name})", "kind": kind, **fig})
        report(runs, args)
        return 0
    together = yaml.safe_load((REPO / args.topology).read_text())
    for i, seed in enumerate(args.seeds):
        order = []
        for kind, doc in (("alone", alone_topology(together)), ("together", together)):
            path = runs_dir / f"bench-multipolicy-{kind}-s{seed}.yaml"
            doc = evaluated_every(seeded(doc, seed), args.eval_every)
            path.write_text(yaml.safe_dump(doc, sort_keys=False))
            order.append((kind, str(path)))
        if i % 2:
            order.reverse()
        for kind, topo in order:
            log = runs_dir / f"bench-multipolicy-{kind}-s{seed}.log"
            fig = figures(run_up(topo, args.duration, runs_dir, log), args)
            runs.append({"name": f"{kind} seed {seed}", "kind": kind, "seed": seed, **fig})
            write_out(runs, args)  # after every run: an interrupted bench keeps its runs
    report(runs, args)
    print(f"\nwrote {write_out(runs, args)}")
    return 0


def write_out(runs: list[dict[str, Any]], args: argparse.Namespace) -> Path:
    """``--out``: the runs so far, with the settings they ran with."""
    out = REPO / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": args.meta, "duration_s": args.duration,
                               "topology": args.topology, "seeds": args.seeds, "runs": runs},
                              indent=1) + "\n")
    return out


if __name__ == "__main__":
    raise SystemExit(main())
