"""Broker faults on a 3-node cluster -> how long training stalled, and the books after.

The bench starts an embedded cluster of three KRaft nodes (``astraflow.broker.cluster``) in a
temporary directory and, once per scenario, runs the default topology on it with
``astraflow up --brokers 3`` (a fresh run each time). Once the trainer has published two
versions the fault starts:

- ``none``: no fault (the baseline: how long the trainer normally goes between versions);
- ``a``: SIGKILL of the node that leads ``weights.actor`` (preferring one that also
  coordinates the trainer's transactions: the leader of its ``__transaction_state``
  partition); restarted once two more versions are out (or after ``--down`` seconds);
- ``b``: a rolling restart: each node in turn shut down and started again, the next one
  once the restarted node is back in every in-sync replica set;
- ``c``: the weights leader shut down for ``--stop`` seconds (default 180), then started.

The run goes on ``--duration`` seconds after the fault ends, then stops (Ctrl-C) and the
bench accounts for every record (``astraflow.launch.audit``). Per scenario it reports the longest
gap between consecutive published versions from the fault's start to the run's end, the
longest time from a fault (each node's stop or kill) until the next version, the counts,
component restarts, and the exactly-once verdict.

    python bench/cluster_faults.py                      # none,a,b,c
    python bench/cluster_faults.py --scenarios none,a --duration 60 --out bench/results/cf.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.broker.cluster import EmbeddedCluster  # noqa: E402
from astraflow.broker.faults import (  # noqa: E402
    kill_up,
    out_of_isr,
    pick_victim,
    stalls,
    transactional_ids,
)
from astraflow.kafka.config import KafkaConfig  # noqa: E402
from astraflow.launch.audit import audit_run, newest_version, version_times, versions  # noqa: E402

SCENARIOS = {"none": "baseline: no fault", "a": "SIGKILL of the weights leader",
             "b": "rolling restart of all three", "c": "weights leader stopped"}
QUIET = lambda *_: None  # noqa: E731


def _ms() -> int:
    return int(time.time() * 1000)


def _wait(what: str, cond, timeout_s: float, step: float = 2.0) -> bool:
    deadline = time.time() + timeout_s
    while not cond():
        if time.time() > deadline:
            print(f"  (no {what} within {timeout_s:.0f}s)", flush=True)
            return False
        time.sleep(step)
    return True


class Run:
    """One ``astraflow up --brokers 3`` of the default topology on the bench's cluster."""

    def __init__(self, cluster: EmbeddedCluster, model: Path, work: Path, name: str,
                 warm_start: int):
        self.cluster, self.work = cluster, work
        self.config = KafkaConfig(bootstrap_servers=cluster.bootstrap, client_id="bench-cf")
        topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
        self.run = topo["run"] = f"cf-{name}-{os.getpid()}"
        topo["policies"]["actor"].update(model=str(model), warm_start={"steps": warm_start})
        path = work / "topology.yaml"
        path.write_text(yaml.safe_dump(topo))
        env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_BOOTSTRAP"}
        env.update(ASTRAFLOW_CLUSTER_STATE=str(cluster.state), PYTHONUNBUFFERED="1")
        self.runs = work / "runs"
        self.logs = self.runs / self.run / "logs"
        self.up = subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--brokers", "3",
             "--runs-dir", str(self.runs)], cwd=REPO, env=env,
            stdout=open(work / "up.log", "wb"), stderr=subprocess.STDOUT)

    @property
    def weights(self) -> str:
        return f"{self.run}.weights.actor"

    def version(self) -> int:
        return newest_version(self.config, self.weights)

    def victim(self):
        prefix = f"{self.run}.trainer.actor."
        _wait("trainer transactional id", lambda: any(
            i.startswith(prefix) for i in transactional_ids(self.logs)), 120, 1.0)
        ids = transactional_ids(self.logs)
        trainer = next((i for i in ids if i.startswith(prefix)), None)
        return pick_victim(self.cluster.bootstrap, self.weights, ids, prefer=trainer)

    def stop(self) -> dict:
        self.up.send_signal(signal.SIGINT)
        self.up.wait(300)
        summary = self.runs / self.run / "summary.json"
        return json.loads(summary.read_text()) if summary.exists() else {}

    def kill(self) -> None:
        """After a failure: ``up`` and every component it started."""
        kill_up(self.up, self.runs / self.run)


def _rejoin(cluster: EmbeddedCluster, node: int) -> None:
    cluster.start_node(node, timeout=180, log=QUIET)
    _wait(f"node {node} back in sync", lambda: not out_of_isr(cluster.bootstrap, node), 300)


def fault(scenario: str, run: Run, args: argparse.Namespace) -> tuple[list[int], str]:
    """Apply the scenario's fault; (when each node went away, ms; what was faulted)."""
    c = run.cluster
    if scenario == "none":
        return [], "-"
    if scenario == "b":
        events = []
        for node in c.node_ids:
            events.append(_ms())
            c.stop_node(node, timeout=60)
            _rejoin(c, node)
        return events, "nodes 1, 2, 3 in turn"
    victim = run.victim()
    print(f"  {victim.describe()}", flush=True)
    before = run.version()
    events = [_ms()]
    if scenario == "a":
        c.kill_node(victim.node)
        _wait("node gone", lambda: c.pid(victim.node) is None, 30, 0.5)
        _wait("two versions without it", lambda: run.version() >= before + 2, args.down)
    else:
        c.stop_node(victim.node, timeout=60)
        time.sleep(args.stop)  # the length of the stop is the scenario
    _rejoin(c, victim.node)
    return events, victim.describe()


def run_one(scenario: str, cluster: EmbeddedCluster, model: Path, work: Path,
            args: argparse.Namespace) -> dict:
    run = Run(cluster, model, work, scenario, args.warm_start)
    try:
        if not _wait("version 2", lambda: run.version() >= 2, 900):
            raise SystemExit(f"{scenario}: no version 2; see {work / 'up.log'}")
        start = _ms()
        events, what = fault(scenario, run, args)
        time.sleep(args.duration)  # the run goes on this long after the fault
        end = _ms()
        summary = run.stop()
    finally:
        run.kill()
    audit = audit_run(run.config, run.run, run.logs)
    times = version_times(versions(run.config, run.weights))
    return {"scenario": scenario, "fault": what, "window_s": (end - start) / 1000,
            **stalls(times, start, end, events), "books": audit.books,
            "problems": audit.problems, "verdict": audit.verdict(),
            "restarts": summary.get("restarts") or {}}


def _row(r: dict, base_gap: float | None) -> str:
    b = r["books"]
    resume = " / ".join("never" if e is None else f"{e:.1f} s"
                        for e in r["resume_each_s"]) or "-"
    ratio = f"{r['longest_gap_s'] / base_gap:.1f}x" if base_gap else "-"
    return (f"| {r['scenario']}: {SCENARIOS[r['scenario']]} | {r['longest_gap_s']:.1f} s "
            f"({ratio}) | {resume} | {b.get('tasks', 0)} / {b.get('groups', 0)} / "
            f"{b.get('batches', 0)} / {b.get('versions', 0)} | "
            f"{sum(r['restarts'].values())} | {r['verdict']} |")


def table(results: list[dict]) -> str:
    """The results as one markdown table."""
    base = next((r["longest_gap_s"] for r in results if r["scenario"] == "none"), None)
    lines = ["| scenario | longest gap between versions (vs baseline) | each node's loss "
             "until the next version | tasks / groups / batches / versions | component restarts | "
             "books |", "|---|---|---|---|---|---|"]
    return "\n".join(lines + [_row(r, base) for r in results])


def run_all(chosen: list[str], tmp: Path, args: argparse.Namespace) -> list[dict]:
    """The model, the cluster under ``tmp``, and one run per scenario."""
    model = tmp / "model"
    subprocess.run([sys.executable, "-m", "astraflow.cli.main", "model", "init", str(model),
                    "--warm-start-steps", str(args.warm_start)], check=True, cwd=REPO,
                   capture_output=True)
    cluster = EmbeddedCluster(tmp / "cluster", size=3)
    cluster.start(timeout=300, log=print)
    results = []
    try:
        for s in chosen:
            work = tmp / f"run-{s}"
            work.mkdir()
            print(f"scenario {s} ({SCENARIOS[s]}) ...", flush=True)
            results.append(run_one(s, cluster, model, work, args))
            print(json.dumps(results[-1]), flush=True)
    finally:
        if args.work:
            cluster.stop()  # its nodes' logs stay with the runs'
        else:
            cluster.destroy()
    return results


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scenarios", default="none,a,b,c", help="of none,a,b,c")
    ap.add_argument("--duration", type=float, default=120.0,
                    help="seconds each run goes on after its fault ends (default 120)")
    ap.add_argument("--stop", type=float, default=180.0,
                    help="scenario c: seconds the node stays stopped (default 180)")
    ap.add_argument("--down", type=float, default=300.0,
                    help="scenario a: restart the killed node after two versions, or "
                    "after this many seconds (default 300)")
    ap.add_argument("--warm-start", type=int, default=100,
                    help="warm-start steps of the tiny model (default 100)")
    ap.add_argument("--work", default=None,
                    help="keep the runs' logs here (a new directory; default: a temporary "
                    "one, deleted)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    meta = run_meta("cluster_faults", ["python", *sys.argv])  # before the run: its commit
    chosen = [s.strip() for s in args.scenarios.split(",")]
    bad = [s for s in chosen if s not in SCENARIOS]
    if bad:
        ap.error(f"--scenarios: unknown {bad[0]!r} (of {', '.join(SCENARIOS)})")
    if args.work:
        Path(args.work).mkdir(parents=True, exist_ok=True)
        results = run_all(chosen, Path(args.work), args)
    else:
        with tempfile.TemporaryDirectory(prefix="bench-cluster-faults-") as tmp:
            results = run_all(chosen, Path(tmp), args)
    print()
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
