"""Disk used by weight blobs: what a run wrote against what the broker still holds.

Runs the default topology under ``astraflow up`` for ``--duration`` seconds on an embedded
broker of its own, then prints, for the ``weights.blobs`` topic: the bytes of every blob
the run's manifests name (weights, model files, trainer states: what a run without
pruning keeps), the bytes on the broker's disk at the end, and the versions kept
reachable. ``--keep-versions`` is passed to the trainer (0: no pruning).

    python bench/blob_retention.py --duration 600
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from astraflow.broker.embedded import EmbeddedBroker, free_port  # noqa: E402
from astraflow.kafka.config import KafkaConfig  # noqa: E402
from astraflow.weights.stores.kafka import read_manifests  # noqa: E402

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)


def _named_bytes(manifests) -> int:
    """Bytes of every blob the manifests name, each once."""
    seen: dict[str, int] = {}
    for m in manifests:
        for ref in m.blobs:
            seen[ref.uri] = ref.bytes
        for kind in ("optimizer", "master", "model_files"):
            if f"{kind}_uri" in m.meta:
                seen[m.meta[f"{kind}_uri"]] = int(m.meta[f"{kind}_bytes"])
    return sum(seen.values())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=int, default=600)
    ap.add_argument("--keep-versions", type=int, default=20)
    ap.add_argument("--out", type=Path, default=None, help="write the figures as JSON here")
    args = ap.parse_args()
    meta = run_meta("blob_retention", ["python", *sys.argv])  # before the run: its commit
    with tempfile.TemporaryDirectory(prefix="bench-blobs-") as tmp:
        work = Path(tmp)
        broker = EmbeddedBroker(work / "broker")
        bootstrap = broker.start(port=free_port(), log=lambda *_: None).bootstrap
        try:
            topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
            topo["kafka"] = {"bootstrap_servers": bootstrap}
            topo["policies"]["actor"]["model"] = str(work / "model")
            topo["policies"]["actor"]["trainer"]["keep_versions"] = args.keep_versions
            path = work / "default.yaml"
            path.write_text(yaml.safe_dump(topo))
            env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap}
            subprocess.run([sys.executable, "-m", "astraflow.cli.main", "up", str(path),
                            "--duration", str(args.duration), "--runs-dir", str(work / "runs")],
                           cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
            config = KafkaConfig(bootstrap_servers=bootstrap)
            manifests = read_manifests(config, f"{topo['run']}.weights.actor")
            part = work / "broker" / "data" / f"{topo['run']}.weights.blobs-0"
            on_disk = sum(f.stat().st_size for f in part.iterdir() if f.suffix == ".log")
        finally:
            broker.destroy()
    newest = max(m.version for m in manifests)
    print(f"{args.duration}s run, keep-versions {args.keep_versions}: {newest} versions; "
          f"blobs named by the manifests {_named_bytes(manifests) / 1e6:.1f} MB, "
          f"on the broker's disk at the end {on_disk / 1e6:.1f} MB")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({
            "meta": meta, "duration_s": args.duration, "keep_versions": args.keep_versions,
            "versions": newest, "named_blob_bytes": _named_bytes(manifests),
            "on_disk_bytes": on_disk}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
