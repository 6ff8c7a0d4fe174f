"""Backpressure: the default topology with its admission processor against a pass-through.

Runs ``astraflow up topology/default.yaml`` (or ``--topology``) once per variant for the
same wall time on the embedded broker: ``passthrough`` (``tasks.source -> tasks``
unchanged, what the default topology did before admission), ``queue`` (admission bounding
the trainer's queued batches alone, ``staleness_budget: queue``, the first rule),
``in_flight`` (queued batches and tasks in flight, ``staleness_budget: in_flight``, the
rule until 2026-11-28) and ``admission`` (the shipped default, ``pipeline``: queued
batches, tasks in flight and the groups on their way to the batcher within the
staleness bound together). While each runs it counts
every 2 s the data records on ``tasks`` past the RaaS group's committed offsets (tasks in
flight: queued or being rolled out). Afterwards it reads the run's ``status`` and summary
and prints, side by side: versions reached, the most and the last tasks in flight, the
admission's target, tasks still waiting before admission, the trainer's waiting fraction,
batches the trainer skipped as stale and groups dropped as stale per stage (and per
1,000 groups the RaaS nodes rolled out), and the held-out accuracy of the last evaluated
version.

With ``--trace`` it then reads back, from the run's retained topics, why each stale group
went stale (``stale_trace``); ``--no-eval`` leaves the evaluator out, as
``bench/learning.py`` runs a topology.

    python bench/backpressure.py [--duration 300] [--topology topology/default.yaml]
        [--variants passthrough,queue,in_flight,admission] [--no-eval] [--trace]
        [--out bench/results/backpressure.json]
"""

from __future__ import annotations

import argparse
import bisect
import itertools
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

sys.path.insert(0, str(REPO / "bench"))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.config.topology import load_topology  # noqa: E402
from astraflow.dataflow.admission import RecordCounter  # noqa: E402
from astraflow.kafka.clients import read_all  # noqa: E402
from astraflow.kafka.lag import LagReader, total_lag  # noqa: E402
from astraflow.wire.records import Batch, ComponentStatus, Task, WeightManifest  # noqa: E402

VARIANTS = ("passthrough", "queue", "in_flight", "admission")


def variant_topology(variant: str, runs_dir: Path,
                     source: Path = REPO / "topology" / "default.yaml",
                     evaluate: bool = True) -> Path:
    """``source`` (its processor named ``admission``) as ``variant``, written under
    ``runs_dir``; without its ``eval`` section unless ``evaluate``."""
    doc = yaml.safe_load(source.read_text())
    doc["run"] = f"bench-bp-{variant}"
    if not evaluate:
        doc.pop("eval", None)
    for spec in doc.get("policies", {}).values():  # paths relative to the repository
        if not Path(spec["model"]).is_absolute():
            spec["model"] = str(REPO / spec["model"])
    if variant in ("queue", "in_flight"):
        doc["processors"]["admission"].setdefault("options", {})["staleness_budget"] = variant
    if variant == "passthrough":
        doc["processors"] = {("forward-tasks" if n == "admission" else n):
                             ({"kind": "passthrough", "inputs": ["tasks.source"],
                               "outputs": ["tasks"]} if n == "admission" else p)
                             for n, p in doc["processors"].items()}
    path = runs_dir / f"bench-bp-{variant}.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


class InFlight:
    """Counts the data records on ``tasks`` past the RaaS group's committed offsets."""

    def __init__(self, topo):
        self.config = topo.kafka.effective()
        self.group, self.topic = topo.raas_group("local"), topo.full_name("tasks")
        self.source_group = topo.group_of(next(iter(topo.processors)))
        self.source = topo.full_name("tasks.source")
        self.lags = LagReader(self.config)
        self.counter = RecordCounter(self.config, "bench-backpressure")

    def read(self) -> int | None:
        try:
            rows = self.lags.lag(self.group, [self.topic], timeout=5)
        except Exception:  # noqa: BLE001 - topics not made yet
            return None
        if not rows:
            return None
        floors = {(r.topic, r.partition): r.committed if r.committed is not None
                  else r.start_offset for r in rows}
        self.counter.follow(floors)
        self.counter.drain()
        return sum(self.counter.count(r.topic, r.partition, floors[(r.topic, r.partition)],
                                      r.end_offset) for r in rows)

    def waiting_at_source(self) -> int:
        """Offset lag of the first processor on ``tasks.source`` (tasks not yet admitted)."""
        return total_lag(self.lags.lag(self.source_group, [self.source], timeout=10))

    def close(self) -> None:
        self.lags.close()
        self.counter.close()


def run_variant(variant: str, args: argparse.Namespace) -> dict[str, Any]:
    from astraflow.launch.runs import start_over

    path = variant_topology(variant, args.runs_dir, args.topology, evaluate=not args.no_eval)
    topo = load_topology(path)
    start_over(topo.run)
    cmd = [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--keep-broker",
           "--duration", str(args.duration), "--runs-dir", str(args.runs_dir)]
    print(f"[bench] {variant}: {' '.join(cmd[2:])}", flush=True)
    log = open(args.runs_dir / f"bench-bp-{variant}.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    watch, seen = InFlight(topo), []
    try:
        while proc.poll() is None:
            n = watch.read()
            if n is not None:
                seen.append(n)
            try:
                proc.wait(2.0)
            except subprocess.TimeoutExpired:
                pass
        waiting = watch.waiting_at_source()
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        proc.wait()
        raise
    finally:
        watch.close()
    out = {**figures(topo, args.runs_dir), "in_flight_max": max(seen, default=0),
           "in_flight_last": seen[-1] if seen else 0, "waiting_at_source": waiting,
           "returncode": proc.returncode}
    if args.trace:
        out["trace"] = {p: stale_trace(topo, p) for p in topo.policies}
    return out


def figures(topo, runs_dir: Path) -> dict[str, Any]:
    """What the run's summary and its last status records say."""
    summary = json.loads((runs_dir / topo.run / "summary.json").read_text())
    actor = summary["policies"]["actor"]
    last: dict[str, ComponentStatus] = {}
    for r in read_all(topo.kafka.effective(), topo.full_name("status"), expect=ComponentStatus,
                      idle_s=2.0, timeout_s=120):
        last[r.record.component_id] = r.record
    trainer = next(s for s in last.values() if s.kind == "trainer")
    rolled_out = sum(s.produced for s in last.values() if s.kind == "raas")
    dropped = sum((summary.get("staleness_dropped_by_stage") or {}).values())
    target = [s.metrics["admission/bound_pool"] for s in last.values()
              if "admission/bound_pool" in s.metrics]
    busy = trainer.busy_s + trainer.waiting_s
    return {"versions": actor["version"], "eval_accuracy": actor.get("eval_accuracy"),
            "eval_version": actor.get("eval_version"),
            "trainer_waiting": trainer.waiting_s / busy if busy else None,
            "stale_skipped_batches": trainer.metrics.get("trainer/stale_skipped_batches", 0.0),
            "dropped_by_stage": summary.get("staleness_dropped_by_stage", {}),
            "groups_rolled_out": rolled_out,
            "dropped_per_1000": 1000 * dropped / rolled_out if rolled_out else None,
            "target_last": target[0] if target else None,
            "tasks_in_flight": summary.get("tasks_in_flight", {})}


def stale_trace(topo, policy: str = "actor") -> dict[str, Any]:
    """Why groups went stale, read back from the run's retained topics.

    For every group the trainer received (``batches.<policy>``): the oldest version its
    tokens were sampled from, the version it was trained from (that of the trainer after
    the last batch before it that made a version) and the newest version published when
    its task was admitted (the ``tasks`` record's timestamp against the manifests'). A
    group staler than ``max_staleness`` was sampled from a version older than that
    admission version (``engine_behind``: versions the node's engine lagged) or trained
    more versions after its admission than the bound (``admitted_too_deep``)."""
    config = topo.kafka.effective()
    bound = topo.policies[policy].max_staleness
    admitted = {r.record.task_id: r.timestamp_ms for r in read_all(
        config, topo.full_name("tasks"), expect=Task, idle_s=2.0, timeout_s=120)}
    manifests = sorted((r.record for r in read_all(
        config, topo.full_name(f"weights.{policy}"), expect=WeightManifest, idle_s=2.0,
        timeout_s=120)), key=lambda m: m.version)
    made_by = _Newest((int(m.meta["batch_offset"]), m.version) for m in manifests
                      if "batch_offset" in m.meta)
    published = _Newest((m.created_at_ms, m.version) for m in manifests)
    first = min((m.version for m in manifests), default=0)
    rows = []
    for r in read_all(config, topo.full_name(f"batches.{policy}"), expect=Batch, idle_s=2.0,
                      timeout_s=300):
        trained_from = made_by.before(r.offset, default=first)
        for g in r.record.groups:
            oldest = min((s.min_version for s in g.sequences
                          if s.policy == policy and s.min_version >= 0), default=None)
            if oldest is None or g.task_id not in admitted:
                continue
            latest = published.at_or_before(admitted[g.task_id], default=0)
            rows.append((trained_from - oldest, latest - oldest, trained_from - latest))
    stale = [r for r in rows if r[0] > bound]
    return {"groups": len(rows), "stale": len(stale), "max_staleness": bound,
            "engine_behind": sum(1 for r in stale if r[1] > 0),
            "admitted_too_deep": sum(1 for r in stale if r[2] > bound),
            "staleness_histogram": _histogram(r[0] for r in rows),
            "engine_lag_histogram": _histogram(r[1] for r in rows),
            "depth_histogram": _histogram(r[2] for r in rows)}


def _histogram(values) -> dict[str, int]:
    return {str(k): n for k, n in sorted(Counter(values).items())}


class _Newest:
    """The highest version among ``(key, version)`` points with a key below (or at) a
    bound, found by bisection."""

    def __init__(self, points):
        points = sorted(points)
        self.keys = [k for k, _ in points]
        self.best = list(itertools.accumulate((v for _, v in points), max))

    def before(self, key, default: int) -> int:
        i = bisect.bisect_left(self.keys, key)
        return self.best[i - 1] if i else default

    def at_or_before(self, key, default: int) -> int:
        i = bisect.bisect_right(self.keys, key)
        return self.best[i - 1] if i else default


def table(results: dict[str, dict[str, Any]]) -> str:
    def fmt(x: Any, pct: bool = False) -> str:
        if x is None:
            return "-"
        if pct:
            return f"{100 * x:.1f} %"
        return f"{x:,.0f}" if isinstance(x, float | int) else str(x)

    rows = [("versions reached", lambda r: fmt(r["versions"])),
            ("tasks in flight, most (records past the pool group's commits)",
             lambda r: fmt(r["in_flight_max"])),
            ("tasks in flight at the end", lambda r: fmt(r["in_flight_last"])),
            ("admission target at the end", lambda r: fmt(r["target_last"])),
            ("tasks waiting before admission at the end", lambda r: fmt(r["waiting_at_source"])),
            ("trainer waiting for batches", lambda r: fmt(r["trainer_waiting"], pct=True)),
            ("batches the trainer skipped as stale", lambda r: fmt(r["stale_skipped_batches"])),
            ("groups dropped as stale (filter / batcher / trainer)", lambda r: " / ".join(
                fmt(r["dropped_by_stage"].get(k, 0)) for k in ("filter", "batcher", "trainer"))),
            ("groups rolled out", lambda r: fmt(r.get("groups_rolled_out"))),
            ("stale drops per 1,000 groups rolled out",
             lambda r: "-" if r.get("dropped_per_1000") is None
             else f"{r['dropped_per_1000']:.1f}"),
            ("held-out accuracy (last eval)", lambda r: (
                f"{100 * r['eval_accuracy']:.1f} % at v{r['eval_version']}"
                if r["eval_accuracy"] is not None else "-"))]
    names = [v for v in VARIANTS if v in results]
    out = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    out += [f"| {label} | " + " | ".join(f(results[n]) for n in names) + " |"
            for label, f in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration", type=int, default=300, help="seconds per variant")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--topology", type=Path, default=REPO / "topology" / "default.yaml")
    p.add_argument("--runs-dir", type=Path, default=REPO / "runs")
    p.add_argument("--out", type=Path, default=None, help="write the figures as JSON")
    p.add_argument("--no-eval", action="store_true",
                   help="leave the evaluator out (as bench/learning.py runs a topology): "
                        "the two cores go to rollouts and training alone")
    p.add_argument("--trace", action="store_true",
                   help="afterwards, read back from the retained topics why groups went "
                        "stale (stale_trace)")
    args = p.parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = {}
    for variant in args.variants.split(","):
        t0 = time.time()
        results[variant] = run_variant(variant, args)
        print(f"[bench] {variant}: {time.time() - t0:.0f}s, {results[variant]}", flush=True)
    print(table(results))
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        meta = run_meta("backpressure", ["python", *sys.argv])
        args.out.write_text(json.dumps({"meta": meta, **results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
