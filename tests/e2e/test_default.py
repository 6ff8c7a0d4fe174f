"""`astraflow up` end to end: every component a separate process, talking only via Kafka."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from astraflow.kafka.clients import read_all
from astraflow.wire.records import Batch, TrajectoryGroup, WeightManifest
from tests.conftest import random_name, wait_for

REPO = Path(__file__).resolve().parents[2]
MAX_STALENESS = 4


def up_until(path: Path, tmp_path: Path, bootstrap: str, done: Callable[[str], bool],
             what: str, timeout_s: float = 600) -> str:
    """``astraflow up`` until ``done(its newest progress line)``, then Ctrl-C; it must exit
    0. Its whole output. ``timeout_s`` is a hang guard: a busy machine may take twice the
    time an idle one does."""
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap, "PYTHONUNBUFFERED": "1"}
    out = tmp_path / "up.log"
    with open(out, "wb") as log:
        up = subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--duration",
             str(int(timeout_s)), "--runs-dir", str(tmp_path / "runs")],
            stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)

    def far_enough() -> bool:
        if up.poll() is not None:
            raise AssertionError(out.read_text()[-3000:])
        lines = [ln for ln in out.read_text().splitlines() if "s |" in ln and " v" in ln]
        return done(lines[-1] if lines else "")

    try:
        wait_for(far_enough, timeout_s, what, step=1)
        up.send_signal(signal.SIGINT)  # seen what the test needs: stop as Ctrl-C does
        up.wait(120)
    finally:
        if up.poll() is None:
            up.kill()
            up.wait(30)
    assert up.returncode == 0, out.read_text()[-3000:]
    return out.read_text()


def _up_until_evaluated(path: Path, tmp_path: Path, bootstrap: str) -> None:
    """``up_until`` its progress line shows version 3 trained and a held-out score of
    version 2 or later (what the test checks)."""

    def done(last: str) -> bool:
        trained = re.search(r"actor v(\d+) ", last)
        scored = re.search(r"eval [\d.]+@v(\d+)", last)
        return bool(trained and scored and int(trained[1]) >= 3 and int(scored[1]) >= 2)

    up_until(path, tmp_path, bootstrap, done, "version 3 and a held-out score of version 2")


@pytest.mark.slow
def test_up_trains_publishes_evaluates_and_bounds_staleness(kafka_bootstrap, kafka_config,
                                                             tmp_path):
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = random_name("e2e")
    topo["run"] = run
    topo["kafka"] = {"bootstrap_servers": kafka_bootstrap}
    # Level 1 only, so that a short warm start learns the format: the teacher forgets the
    # carry 70 % of the time (7+5=2), and RL has to learn to carry within the run.
    topo["policies"]["actor"].update(
        model=str(tmp_path / "model"),
        warm_start={"steps": 800, "slip": 0.7, "levels": "1", "until": 0.9})
    topo["feeder"] = {"epochs": 0, "rate": 60, "levels": "1"}
    topo["eval"] = {"every_versions": 2, "size": 50, "levels": "1"}
    path = tmp_path / "e2e.yaml"
    path.write_text(yaml.safe_dump(topo))
    _up_until_evaluated(path, tmp_path, kafka_bootstrap)
    run_dir = tmp_path / "runs" / run
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"]["actor"] >= 3, summary
    assert summary["eval"]["actor"], "no held-out evaluation was published"
    assert (run_dir / "summary.png").stat().st_size > 0
    for name in ("trainer-actor", "raas-local-0", "processor-batcher", "eval-actor"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in log, f"{name} crashed:\n{log[-3000:]}"
    # the node's engine holds version 0 from disk, as version 0's digest shows: its first
    # update fetched deltas, not the full checkpoint
    raas_log = (run_dir / "logs" / "raas-local-0.log").read_text()
    assert "the engine's own weights are version 0" in raas_log, raas_log[-3000:]

    manifests = [r.record for r in read_all(kafka_config, f"{run}.weights.actor",
                                            expect=WeightManifest)]
    versions = sorted({m.version for m in manifests})
    assert versions == list(range(len(versions))), "versions must be consecutive from 0"
    # each version consumed batches strictly after its predecessor's
    deltas = sorted((m for m in manifests if m.kind == "delta"), key=lambda m: m.version)
    offsets = [m.consumed_offsets[0].offset for m in deltas]
    assert offsets == sorted(offsets) and len(set(offsets)) == len(offsets)

    # staleness: a batch never holds a group more than MAX_STALENESS versions older than
    # what had been published a moment (the side readers' lag) before the batch was cut
    published = sorted((m.created_at_ms, m.version) for m in manifests)
    batches = [r.record for r in read_all(kafka_config, f"{run}.batches.actor", expect=Batch)]
    assert batches
    for b in batches:
        known = [v for t, v in published if t <= b.created_at_ms - 2000]
        if not known:
            continue
        for g in b.groups:
            for s in g.sequences:
                assert max(known) - s.min_version <= MAX_STALENESS, (b.batch_id, s.versions)

    # The mechanism of learning, not how much (that is a bench: held-out accuracy at a
    # version budget against the starting model, `python bench/data_algorithms.py
    # --variants baseline`, and over time, `python bench/learning.py --topology
    # topology/default.yaml`): the trainer's updates moved the weights, the RaaS node rolled
    # out with the versions it published, and the evaluator scored versions after the first.
    assert any(m.num_changed > 0 for m in deltas), "no published version changed a weight"
    groups = sorted((r.record for r in read_all(kafka_config, f"{run}.trajectories.raw",
                                                expect=TrajectoryGroup)),
                    key=lambda g: g.created_at_ms)
    assert len(groups) >= 40, len(groups)
    assert all(0.0 <= r <= 1.0 for g in groups for r in g.rewards)
    rolled_with = {s.max_version for g in groups for s in g.sequences}
    assert max(rolled_with) >= 1, f"rollouts only ever used versions {rolled_with}"
    evaluated = {e["version"]: e["accuracy"] for e in summary["eval"]["actor"]}
    assert max(evaluated) >= 2, evaluated  # (it starts on the newest version published)
    assert all(0.0 <= a <= 1.0 for a in evaluated.values()), evaluated
    print(f"rolled out with {len(rolled_with)} versions up to {max(rolled_with)}; held-out "
          f"accuracy by version {evaluated} ({len(groups)} groups)")

    # replay eval: the same held-out accuracy, version for version, from the retained
    # weight stream alone (versions whose blobs the trainer pruned are skipped)
    from astraflow.cli.main import main

    curve_file = tmp_path / "curve.json"
    assert main(["replay", "eval", "-t", str(path), "--bootstrap", kafka_bootstrap,
                 "--every", "2", "--out", str(curve_file)]) == 0
    curve = {c["version"]: c["accuracy"] for c in json.loads(curve_file.read_text())["curve"]}
    assert curve and all(v % 2 == 0 for v in curve), curve
    common = set(curve) & set(evaluated)
    assert common, (curve, evaluated)
    assert all(curve[v] == evaluated[v] for v in common), (curve, evaluated)
    assert curve_file.with_suffix(".png").stat().st_size > 0
