"""Broker outage -> time until every component of the default topology makes progress again.

For each outage length the default topology runs under ``astraflow up`` against an
embedded broker of its own. Once the trainer has published two versions the broker is
stopped for that long and started again; the bench then reads the ``status`` topic and,
per component, finds the first status after the restart whose counters moved past the
last one before the outage (processors and RaaS: records produced; the trainer: its
version). Length 0 is the baseline: no outage, the same measurement from an arbitrary
instant, i.e. how long components normally go between progress reports.

    python bench/outage.py                       # lengths 0,10,30,60,180 s
    python bench/outage.py --lengths 0,30 --out bench/results/outage.json
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
sys.path.insert(0, str(REPO / "bench"))

from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.broker.embedded import EmbeddedBroker, free_port  # noqa: E402
from astraflow.kafka.clients import read_all  # noqa: E402
from astraflow.kafka.config import KafkaConfig  # noqa: E402
from astraflow.wire.records import ComponentStatus, WeightManifest  # noqa: E402


def _progress(st: ComponentStatus) -> int:
    if st.kind == "trainer":
        return max(st.weight_versions.values(), default=-1)
    return st.produced


def _newest_version(config: KafkaConfig, topic: str) -> int:
    try:
        ms = read_all(config, topic, expect=WeightManifest, idle_s=1.0, timeout_s=20)
    except Exception:  # noqa: BLE001 - no topic yet
        return -1
    return max((r.record.version for r in ms), default=-1)


def _wait_version(config: KafkaConfig, topic: str, n: int, timeout_s: float) -> None:
    deadline = time.time() + timeout_s
    while _newest_version(config, topic) < n:
        if time.time() > deadline:
            raise SystemExit(f"no version {n} on {topic} after {timeout_s:.0f}s")
        time.sleep(2.0)


def _recovery(statuses, fault_start_ms: int, back_ms: int) -> dict[str, float | None]:
    """Per component: seconds from ``back_ms`` to its first progress after it."""
    out: dict[str, float | None] = {}
    for cid in sorted({s.component_id for _, s in statuses}):
        if cid.startswith("eval"):
            continue  # evaluates every few versions, not continuously
        mine = [(ts, s) for ts, s in statuses if s.component_id == cid]
        before = [s for ts, s in mine if ts < fault_start_ms]
        if not before:
            continue
        base = _progress(before[-1])
        later = [ts for ts, s in mine if ts >= back_ms and _progress(s) > base]
        out[cid] = (later[0] - back_ms) / 1000 if later else None
    return out


def run_one(length_s: float, model: Path, work: Path, settle_s: float) -> dict:
    broker = EmbeddedBroker(work / "broker")
    bootstrap = broker.start(port=free_port(), log=lambda *_: None).bootstrap
    config = KafkaConfig(bootstrap_servers=bootstrap, client_id="bench-outage")
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = topo["run"] = f"outage-{int(length_s)}-{os.getpid()}"
    topo["kafka"] = {"bootstrap_servers": bootstrap}
    topo["policies"]["actor"].update(model=str(model), warm_start={"steps": 100})
    path = work / "topology.yaml"
    path.write_text(yaml.safe_dump(topo))
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap}
    up = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "up", str(path),
                           "--runs-dir", str(work / "runs")], cwd=REPO, env=env,
                          stdout=open(work / "up.log", "wb"), stderr=subprocess.STDOUT)
    try:
        _wait_version(config, f"{run}.weights.actor", 2, 600)
        start_ms = int(time.time() * 1000)
        if length_s > 0:
            broker.stop()
            time.sleep(length_s)
            broker.start(log=lambda *_: None)
        back_ms = int(time.time() * 1000)
        time.sleep(settle_s)  # let every component report progress
        up.send_signal(signal.SIGINT)
        up.wait(180)
        statuses = [(r.timestamp_ms, r.record) for r in read_all(
            config, f"{run}.status", expect=ComponentStatus, idle_s=2.0, timeout_s=120)]
        summary = json.loads((work / "runs" / run / "summary.json").read_text())
        restarts = summary.get("restarts", {})
    finally:
        if up.poll() is None:
            up.kill()
        broker.destroy()
    rec = _recovery(statuses, start_ms, back_ms)
    known = [v for v in rec.values() if v is not None]
    return {"outage_s": length_s, "per_component_s": rec, "restarts": restarts,
            "all_components_s": max(known) if len(known) == len(rec) else None,
            "no_progress": {cid: _trace(statuses, cid, start_ms)
                            for cid, v in rec.items() if v is None}}


def _trace(statuses, cid: str, start_ms: int) -> list[str]:
    """What a component that made no progress reported from just before the outage on:
    where the settle time went for it."""
    return [f"{(ts - start_ms) / 1000:+.0f}s {s.state} in {s.consumed} out {s.produced} "
            f"dlq {s.dead_lettered} v {s.weight_versions} "
            f"aborted {s.metrics.get('runtime/aborted', 0):.0f}"
            for ts, s in statuses if s.component_id == cid and ts >= start_ms - 10_000]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--lengths", default="0,10,30,60,180", help="outage lengths in seconds")
    ap.add_argument("--settle", type=float, default=60.0,
                    help="seconds to watch after the broker is back (default 60)")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    args = ap.parse_args()
    lengths = [float(x) for x in args.lengths.split(",")]
    meta = run_meta("outage", ["python", *sys.argv])  # before the run: its commit
    with tempfile.TemporaryDirectory(prefix="bench-outage-") as tmp:
        model = Path(tmp) / "model"
        subprocess.run([sys.executable, "-m", "astraflow.cli.main", "model", "init", str(model),
                        "--warm-start-steps", "100"], check=True, cwd=REPO,
                       capture_output=True)
        results = []
        for length in lengths:
            work = Path(tmp) / f"run-{int(length)}"
            work.mkdir()
            print(f"outage {length:.0f}s ...", flush=True)
            results.append(run_one(length, model, work, args.settle))
            print(json.dumps(results[-1]), flush=True)
    print("\n| outage | every component progressing again after | slowest component | "
          "restarts |\n|---|---|---|---|")
    for r in results:
        per = {k: v for k, v in r["per_component_s"].items() if v is not None}
        slow = max(per, key=per.get) if per else "-"
        total = r["all_components_s"]
        print(f"| {r['outage_s']:.0f} s{' (baseline)' if not r['outage_s'] else ''} | "
              f"{f'{total:.1f} s' if total is not None else 'not all within the settle time'}"
              f" | {slow} | {sum(r['restarts'].values()) if r['restarts'] else 0} |")
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
