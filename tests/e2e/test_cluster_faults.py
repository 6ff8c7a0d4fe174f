"""Losing a broker is not an outage: the default topology trains on the embedded cluster of
three nodes (``astraflow up --brokers 3``: every topic with 3 replicas and min ISR 2) and
rides out a SIGKILLed node that leads the policy's
weights topic, and the books balance (``astraflow.launch.audit``): nothing lost, nothing done
twice, versions contiguous, no batch trained twice.

The decision logic of ``astraflow.broker.faults`` (which partition coordinates a transactional
id, which node to kill, how long training stalled) is tested without a broker first. The
rolling restart and the 3-minute stop run in ``bench/cluster_faults.py``, not here.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from astraflow.broker.faults import (
    java_hash,
    kill_up,
    out_of_isr,
    pick_victim,
    stalls,
    transaction_partition,
    transactional_ids,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.launch.audit import audit_run, newest_version
from tests.conftest import REPO, random_name, wait_for


# --- decision logic, no broker -------------------------------------------------------
def test_transaction_partition_is_kafkas_hash_of_the_transactional_id():
    # String.hashCode values as the JVM computes them (jshell), non-ASCII and the one
    # whose hash is Integer.MIN_VALUE (Kafka's Utils.abs maps it to 0) included
    assert java_hash("") == 0 and java_hash("x") == 120
    assert java_hash("run-abc.trainer.actor.up") == -504061861
    assert java_hash("héllo\U0001d11e") == 291563960
    assert java_hash("polygenelubricants") == -(1 << 31)
    assert transaction_partition("polygenelubricants", 8) == 0
    assert transaction_partition("run-abc.trainer.actor.up", 8) == 504061861 % 8
    assert transaction_partition("run-abc.trainer.actor.up", 50) == 504061861 % 50


def test_transactional_ids_are_read_from_the_components_logs(tmp_path):
    (tmp_path / "trainer-actor.log").write_text(
        "x: consuming r.batches.actor as group r.trainer.actor, transactional id "
        "r.trainer.actor.up\n")
    (tmp_path / "processor-batcher.log").write_text(
        "batcher/up: consuming r.samples.actor as group r.batcher, transactional id "
        "r.batcher.up\nagain: transactional id r.batcher.up\n")
    (tmp_path / "notes.txt").write_text("transactional id not.a.log")
    assert transactional_ids(tmp_path) == {"r.trainer.actor.up", "r.batcher.up"}


def test_stalls_measure_the_longest_gap_and_the_time_until_versions_resume():
    times = {0: 1_000, 1: 2_000, 2: 3_000, 3: 9_000, 4: 10_000}
    s = stalls(times, start_ms=2_500, end_ms=12_000, faults_ms=[3_500])
    assert s == {"longest_gap_s": 6.0, "resume_s": 5.5, "resume_each_s": [5.5],
                 "versions_in_window": 3}
    # the window's end counts: a run that never published again stalled until it ended
    s = stalls(times, start_ms=2_500, end_ms=30_000, faults_ms=[3_500, 10_500])
    assert s["longest_gap_s"] == 20.0 and s["resume_s"] is None
    assert s["resume_each_s"] == [5.5, None]
    assert stalls(times, 0, 12_000, [])["resume_s"] is None


# --- on the cluster ---------------------------------------------------------------------
class ClusterRun:
    """One ``astraflow up --brokers 3`` of the default topology on ``cluster``."""

    def __init__(self, cluster, tmp_path: Path):
        self.cluster = cluster
        self.config = KafkaConfig(bootstrap_servers=cluster.bootstrap, client_id="faults")
        data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
        self.run = data["run"] = random_name("faults")
        data["policies"]["actor"].update(model=str(tmp_path / "model"),
                                         warm_start={"steps": 30, "slip": 0.7, "eval_size": 20})
        data["feeder"] = {"epochs": 0, "rate": 20, "levels": "1"}
        data["eval"] = {"every_versions": 1000, "size": 20, "levels": "1"}  # v0 only: CPU
        path = tmp_path / "faults.yaml"
        path.write_text(yaml.safe_dump(data))
        self.runs = tmp_path / "runs"
        self.out = tmp_path / "up.log"
        env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_BOOTSTRAP"}
        env.update(ASTRAFLOW_CLUSTER_STATE=str(cluster.state), PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--brokers", "3",
             "--duration", "900", "--runs-dir", str(self.runs)],
            stdout=open(self.out, "ab"), stderr=subprocess.STDOUT, env=env, cwd=REPO)
        self.logs = self.runs / self.run / "logs"

    def versions(self) -> int:
        return newest_version(self.config, f"{self.run}.weights.actor")

    def stop(self) -> dict:
        self.proc.send_signal(signal.SIGINT)
        code = self.proc.wait(180)
        assert code == 0, self.out.read_text()[-4000:]
        return json.loads((self.runs / self.run / "summary.json").read_text())

    def kill(self) -> None:
        """Teardown: ``up`` and every component it started."""
        kill_up(self.proc, self.runs / self.run)


def assert_replicated_three_times(config: KafkaConfig, run: str) -> None:
    """`up --brokers 3` made every topic of the run with 3 replicas and min ISR 2."""
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import describe_topic

    admin = make_admin(config)
    for topic in (f"{run}.tasks", f"{run}.trajectories.raw", f"{run}.batches.actor",
                  f"{run}.weights.actor", f"{run}.weights.blobs", f"{run}.status"):
        desc = describe_topic(admin, topic)
        assert all(len(p["replicas"]) == 3 for p in desc["partitions"].values()), desc
        assert desc["configs"]["min.insync.replicas"] == "2", desc


@pytest.fixture
def cluster_run(embedded_cluster, tmp_path):
    run = ClusterRun(embedded_cluster, tmp_path)
    yield run
    run.kill()
    for node in embedded_cluster.node_ids:  # whatever happened, every node runs again
        embedded_cluster.start_node(node, timeout=120, log=lambda _m: None)


@pytest.mark.slow
@pytest.mark.chaos
def test_a_sigkilled_weights_leader_loses_and_duplicates_nothing(cluster_run):
    run, cluster = cluster_run, cluster_run.cluster
    wait_for(lambda: run.versions() >= 2, 300, "version 2", step=2.0)
    prefix = f"{run.run}.trainer.actor."
    ids = wait_for(lambda: [i for i in transactional_ids(run.logs) if i.startswith(prefix)]
                   and transactional_ids(run.logs), 60, "the trainer's transactional id")
    trainer = next(i for i in ids if i.startswith(prefix))
    victim = pick_victim(cluster.bootstrap, f"{run.run}.weights.actor", ids, prefer=trainer)
    print(victim.describe(), "; coordinators:", victim.coordinators)
    assert victim.weights == [0]

    before = run.versions()
    cluster.kill_node(victim.node)
    wait_for(lambda: cluster.pid(victim.node) is None, 30, "the node to die")
    # training goes on without it: two more versions from the two nodes left
    wait_for(lambda: run.versions() >= before + 2, 300, f"version {before + 2}", step=2.0)
    cluster.start_node(victim.node, timeout=120, log=lambda _m: None)
    wait_for(lambda: not out_of_isr(cluster.bootstrap, victim.node), 120,
             f"node {victim.node} back in every in-sync replica set", step=1.0)

    summary = run.stop()
    assert not summary.get("restarts"), summary["restarts"]
    out = run.out.read_text()
    assert "embedded cluster: 3 of 3 nodes running" in out, out[-3000:]
    assert "stopped the embedded cluster" not in out  # not started by this `up`
    assert_replicated_three_times(run.config, run.run)
    audit = audit_run(run.config, run.run, run.logs)
    assert audit.ok, "\n".join(audit.problems)
    assert audit.books["versions"] >= before + 2 and audit.books["trained"] > 0, audit.books
    print("weights leader SIGKILL", audit.books)
