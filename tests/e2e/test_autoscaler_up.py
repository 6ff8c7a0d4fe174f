"""The autoscaler loop under ``astraflow up`` on a real broker: the ``autoscaler`` processor
advises from ``status``, ``up``'s actuator starts and stops RaaS nodes to follow."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.kafka.table import TopicReader
from astraflow.wire.records import ScalingAdvice
from tests.conftest import random_name, wait_for

REPO = Path(__file__).resolve().parents[2]


def _pids(runs: Path, run: str) -> dict[str, int]:
    try:
        return json.loads((runs / run / "pids.json").read_text())
    except (OSError, ValueError):  # not written yet, or being rewritten
        return {}


def _advice(kafka_config, topic: str) -> list[ScalingAdvice]:
    reader = TopicReader(kafka_config, topic, ScalingAdvice)
    try:
        return [e.value for e in reader.catch_up(10.0) if e.value is not None]
    finally:
        reader.close()


@pytest.mark.slow
def test_a_pool_grows_while_the_trainer_starves_and_shrinks_when_it_has_no_tasks(
        kafka_bootstrap, kafka_config, tmp_path):
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = topo["run"] = random_name("scale")
    topo["kafka"] = {"bootstrap_servers": kafka_bootstrap}
    topo["status_interval_s"] = 1
    topo["policies"]["actor"].update(model=str(tmp_path / "model"), warm_start={"steps": 50})
    # a slow pool (a tenth of its speed) fed 4 tasks/s: one node leaves the trainer waiting
    # for batches, two keep up with the feeder with time to spare
    topo["pools"]["local"].update(nodes=1, speed=0.1)
    topo["feeder"] = {"epochs": 0, "rate": 4, "levels": "1"}
    topo.pop("eval", None)
    topo["processors"]["autoscaler"] = {
        "kind": "autoscaler", "inputs": ["status"], "outputs": ["scaling"],
        "options": {"pools": {"local": {"min_size": 1, "max_size": 2}}, "window_s": 6,
                    "cooldown_s": 4, "stale_after_s": 8}}
    path = tmp_path / "scale.yaml"
    path.write_text(yaml.safe_dump(topo))
    runs = tmp_path / "runs"
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap}
    up = subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", "up", str(path),
                           "--duration", "900", "--runs-dir", str(runs)], env=env, cwd=REPO,
                          stdout=open(tmp_path / "up.log", "wb"), stderr=subprocess.STDOUT)
    scaling = f"{run}.scaling"
    try:
        # one node cannot keep the trainer busy: the pool grows to its maximum
        # the deadlines are hang guards: on a busy machine the in-flight tasks of a pool at a
        # tenth of its speed take minutes to drain (CI once needed more than 120 s)
        wait_for(lambda: "raas-local-1" in _pids(runs, run), 360,
                 "a second RaaS node started by the actuator", step=1.0)
        grown = _advice(kafka_config, scaling)
        assert any(a.branch == "up" and a.target_size == 2 for a in grown), grown
        # no more tasks: the nodes wait for work, and the pool shrinks back to min_size
        os.kill(_pids(runs, run)["feeder"], signal.SIGTERM)
        wait_for(lambda: "raas-local-1" not in _pids(runs, run), 360,
                 "the second node stopped once the pool had nothing to do", step=1.0)
        shrunk = _advice(kafka_config, scaling)
        assert any(a.branch == "idle" and a.target_size == 1 for a in shrunk), shrunk
        assert "raas-local-0" in _pids(runs, run)  # never below min_size
    finally:
        if up.poll() is None:
            up.send_signal(signal.SIGINT)
            try:
                up.wait(120)
            except subprocess.TimeoutExpired:
                up.kill()
    log = (tmp_path / "up.log").read_text()
    assert "autoscaler: pool local 1 -> 2 nodes" in log and \
        "autoscaler: pool local 2 -> 1 nodes" in log, log[-3000:]
    assert up.returncode == 0, log[-3000:]
