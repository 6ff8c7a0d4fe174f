"""Replay throughput: copying a run's records, re-training on its batches, evaluating its
versions, each beside a baseline measured in the same run.

Runs the default topology under ``astraflow up --versions N`` on an embedded broker of its
own (the run to replay, kept until ``--duration`` or N versions), then:

- copy: ``replay``'s resumable copy of the run's ``trajectories.raw`` (records/s), against a
  plain consume + produce of the same records;
- train: ``astraflow replay train`` (batches trained per minute, and whether the weights
  are the run's bit for bit), against the run's own trainer over the same versions;
- eval: ``astraflow replay eval --every K`` (versions evaluated per minute), against the
  live evaluator's rate during the run;
- process: ``astraflow replay process`` with the run's own chain and settings (trajectories
  per second through staleness filter, router and batcher, copy and start-up included),
  against the plain copy, and what the chain kept and dropped beside the run's own figures.

    python bench/replay.py [--versions 40] [--duration 600] [--every 5]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from confluent_kafka import Consumer, Producer, TopicPartition  # noqa: E402

from astraflow.broker.embedded import EmbeddedBroker, free_port  # noqa: E402
from astraflow.kafka.clients import make_admin  # noqa: E402
from astraflow.kafka.config import KafkaConfig  # noqa: E402
from astraflow.kafka.offsets import Offsets  # noqa: E402
from astraflow.kafka.topics import apply_topics  # noqa: E402
from astraflow.replay.ranges import clamp_range, copy_range  # noqa: E402
from astraflow.weights.stores.kafka import read_manifests  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)


def cli(*args: str, env: dict[str, str], out: Path | None = None) -> str:
    res = subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], cwd=REPO, env=env,
                         capture_output=True, text=True)
    if out is not None:
        out.write_text(res.stdout + res.stderr)
    if res.returncode != 0:
        raise SystemExit(f"astraflow {' '.join(args[:2])} exited {res.returncode}:\n"
                         f"{(res.stdout + res.stderr)[-3000:]}")
    return res.stdout


def plain_copy(config: KafkaConfig, src: str, dst: str, n: int) -> float:
    """Records/s of a plain consume + produce of ``src``'s first ``n`` records."""
    consumer = Consumer(config.consumer_conf(f"bench-plain-{time.time_ns()}"))
    producer = Producer(config.producer_conf())
    parts = Offsets(config).partitions(src)
    consumer.assign([TopicPartition(src, p, 0) for p in range(parts)])
    t0, done = time.perf_counter(), 0
    while done < n:
        for m in consumer.consume(500, 1.0):
            if m.error() is None:
                producer.produce(dst, m.value(), m.key(), partition=m.partition())
                done += 1
        producer.poll(0)
    producer.flush()
    consumer.close()
    return done / (time.perf_counter() - t0)


def source_run(work: Path, bootstrap: str, args) -> tuple[dict, Path, dict[str, str]]:
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    topo["kafka"] = {"bootstrap_servers": bootstrap}
    topo["policies"]["actor"]["model"] = str(work / "model")
    topo["policies"]["actor"]["trainer"]["keep_versions"] = 0  # replay needs version 0
    topo["eval"]["every_versions"] = args.every
    path = work / "default.yaml"
    path.write_text(yaml.safe_dump(topo))
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap}
    cli("up", str(path), "--versions", str(args.versions), "--duration", str(args.duration),
        "--runs-dir", str(work / "runs"), env=env, out=work / "up.log")
    return topo, path, env


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--versions", type=int, default=40)
    ap.add_argument("--duration", type=int, default=600)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--out", type=Path, default=None,
                    help="write each replay's figure and its baseline as JSON here")
    args = ap.parse_args()
    meta = run_meta("replay", ["python", *sys.argv])  # before the run: its commit
    print("$ python bench/replay.py " + " ".join(sys.argv[1:]), flush=True)
    with tempfile.TemporaryDirectory(prefix="bench-replay-") as tmp:
        work = Path(tmp)
        broker = EmbeddedBroker(work / "broker")
        bootstrap = broker.start(port=free_port(), log=lambda *_: None).bootstrap
        try:
            figures = measure(work, bootstrap, args)
        finally:
            broker.destroy()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "versions": args.versions,
                                        "duration_s": args.duration, "every": args.every,
                                        **figures}, indent=1) + "\n")
    return 0


def measure(work: Path, bootstrap: str, args) -> dict[str, Any]:
    """The source run, then replay copy, train, eval and process on it; the figures, each
    with its baseline."""
    from astraflow.config.topology import load_topology

    topo, path, env = source_run(work, bootstrap, args)
    run, config = topo["run"], KafkaConfig(bootstrap_servers=bootstrap)
    summary = json.loads((work / "runs" / run / "summary.json").read_text())
    manifests = read_manifests(config, f"{run}.weights.actor")
    newest = max(m.version for m in manifests)
    # copy: the run's trajectories, twice (ours, then plain) into fresh topics
    t = load_topology(str(path))
    scratch = t.model_copy(update={"run": f"{run}-copy"})
    apply_topics(make_admin(config), scratch.resolved_topics())
    src = f"{run}.trajectories.raw"
    rng = clamp_range(Offsets(config).watermarks(src), (None, None), (None, None))
    t0 = time.perf_counter()
    n = copy_range(config, src, scratch.full_name("trajectories.raw"), rng)
    ours = n / (time.perf_counter() - t0)
    plain = plain_copy(config, src, scratch.full_name("trajectories"), n)
    # train
    t0 = time.perf_counter()
    out = cli("replay", "train", "-t", str(path), "--into", f"{run}-replay", "--runs-dir",
              str(work / "runs"), env=env)
    train_s = time.perf_counter() - t0
    replayed = max(m.version for m in read_manifests(config, f"{run}-replay.weights.actor"))
    created = sorted(m.created_at_ms for m in manifests if m.version >= 1)
    live_s = (created[-1] - created[0]) / 1000 if len(created) > 1 else float("nan")
    # eval
    t0 = time.perf_counter()
    cli("replay", "eval", "-t", str(path), "--every", str(args.every), "--out",
        str(work / "curve.json"), env=env)
    eval_s = time.perf_counter() - t0
    curve = json.loads((work / "curve.json").read_text())["curve"]
    live_evals = summary["eval"].get("actor", [])
    figures = report(n, ours, plain, (newest, replayed), train_s, live_s, out, curve, eval_s,
                     live_evals, summary["seconds"])
    # process: the run's own chain, in event time
    t0 = time.perf_counter()
    out = cli("replay", "process", "-t", str(path), "--into", f"{run}-process", env=env)
    process_s = time.perf_counter() - t0
    print(f"{'process (trajectories/s)':44} {n / process_s:12.0f} {plain:12.0f}  "
          "(baseline: plain consume + produce; replay includes the copy and start-up)")
    print("\nreplay process with the run's own settings:\n" + out.strip())
    figures["process_per_s"] = {"replay": n / process_s, "baseline": plain}
    return figures


def report(n, ours, plain, versions, train_s, live_s, out, curve, eval_s, live_evals,
           run_s) -> dict[str, Any]:
    newest, replayed = versions
    same = "the weights differ" not in out and "bit for bit" in out
    print(f"\nsource run: {newest} versions in {run_s:.0f}s; {n} trajectory groups")
    print(f"{'':44} {'replay':>12} {'baseline':>12}")
    print(f"{'copy trajectories.raw (records/s)':44} {ours:12.0f} {plain:12.0f}  "
          "(baseline: plain consume + produce)")
    print(f"{'train (versions/min)':44} {60 * replayed / train_s:12.1f} "
          f"{60 * (newest - 1) / live_s:12.1f}  (baseline: the run's trainer; replay "
          f"includes the copy and start-up; {replayed} versions; the same weights as the "
          f"run's at the last common version: {same})")
    print(f"{'eval (versions/min)':44} {60 * len(curve) / eval_s:12.1f} "
          f"{60 * len(live_evals) / run_s:12.1f}  (baseline: the live evaluator during the "
          "run, which shares the cores with the run)")
    return {"source": {"versions": newest, "seconds": run_s, "groups": n},
            "copy_records_per_s": {"replay": ours, "baseline": plain},
            "train_versions_per_min": {"replay": 60 * replayed / train_s,
                                       "baseline": 60 * (newest - 1) / live_s},
            "replayed_versions": replayed, "same_weights": same,
            "eval_versions_per_min": {"replay": 60 * len(curve) / eval_s,
                                      "baseline": 60 * len(live_evals) / run_s}}


if __name__ == "__main__":
    sys.exit(main())
