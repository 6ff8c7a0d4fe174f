"""The embedded cluster of three KRaft nodes without a broker: each node's config, internal
topics' replication, racks, status, options that cannot apply, commands finding the running
cluster (a real cluster losing a node: tests/integration/broker/test_cluster.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from astraflow.broker.cluster import (
    ClusterStatus,
    EmbeddedCluster,
    NodeStatus,
    cluster_config,
    leader_lines,
)
from astraflow.broker.embedded import BrokerError
from astraflow.kafka.config import KafkaConfig
from tests.conftest import REPO

PORTS = {1: (19192, 29192), 2: (19193, 29193), 3: (19194, 29194)}


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines()
                if line and not line.startswith("#"))


def test_every_node_names_the_whole_quorum_and_its_own_listeners(tmp_path):
    configs = {i: _props(cluster_config(i, PORTS, tmp_path / f"n{i}")) for i in PORTS}
    voters = "1@127.0.0.1:29192,2@127.0.0.1:29193,3@127.0.0.1:29194"
    for i, props in configs.items():
        assert props["node.id"] == str(i)
        assert props["process.roles"] == "broker,controller"
        assert props["controller.quorum.voters"] == voters
        assert "controller.quorum.bootstrap.servers" not in props
        port, controller = PORTS[i]
        assert props["listeners"] == (f"PLAINTEXT://127.0.0.1:{port},"
                                      f"CONTROLLER://127.0.0.1:{controller}")
        assert props["advertised.listeners"] == f"PLAINTEXT://127.0.0.1:{port}"
        assert props["log.dirs"] == str(tmp_path / f"n{i}")
        assert "broker.rack" not in props and "replica.selector.class" not in props


@pytest.mark.parametrize("size,replicas,min_isr", [(1, 1, 1), (2, 2, 1), (3, 3, 2), (5, 3, 2)])
def test_internal_topics_replicate_to_the_cluster_size_capped_at_three(size, replicas,
                                                                      min_isr, tmp_path):
    ports = {i: (20000 + i, 21000 + i) for i in range(1, size + 1)}
    props = _props(cluster_config(1, ports, tmp_path))
    for key in ("offsets.topic.replication.factor", "transaction.state.log.replication.factor",
                "default.replication.factor"):
        assert props[key] == str(replicas), key
    assert props["transaction.state.log.min.isr"] == str(min_isr)
    assert props["min.insync.replicas"] == str(min_isr)


def test_racks_set_each_nodes_rack_and_the_rack_aware_selector(tmp_path):
    props = _props(cluster_config(2, PORTS, tmp_path, rack="r2"))
    assert props["broker.rack"] == "r2"
    assert props["replica.selector.class"] == (
        "org.apache.kafka.common.replica.RackAwareReplicaSelector")


def test_racks_must_name_one_rack_a_node(tmp_path):
    with pytest.raises(BrokerError, match="3 rack names"):
        EmbeddedCluster(tmp_path, size=3, racks=["r1", "r2"])
    with pytest.raises(BrokerError, match="at least one node"):
        EmbeddedCluster(tmp_path, size=0)


def test_a_state_of_another_size_is_refused_before_anything_starts(tmp_path):
    (tmp_path / "cluster.json").write_text(json.dumps({
        "size": 2, "cluster_id": "x", "racks": None,
        "nodes": {"1": {"port": 1, "controller_port": 2},
                  "2": {"port": 3, "controller_port": 4}}}))
    with pytest.raises(BrokerError, match="holds 2 nodes, not 3.*--purge"):
        EmbeddedCluster(tmp_path, size=3).start(log=lambda _m: None)
    assert EmbeddedCluster.recorded(tmp_path).size == 2
    assert not list(tmp_path.glob("node-*")), "nothing may be started or written"


def test_status_names_each_node_the_leaders_and_the_under_replicated_partitions():
    st = ClusterStatus(
        nodes=[NodeStatus(1, 19192, 111, True, "r1"), NodeStatus(2, 19193, None, False, "r2"),
               NodeStatus(3, 19194, 333, True, "r3")],
        leaders={("run.tasks", 0): 1, ("run.tasks", 1): 3, ("run.tasks", 2): 1,
                 ("__consumer_offsets", 0): 3, ("run.dlq", 0): -1},
        under_replicated=[("run.tasks", 1), ("run.tasks", 0)], state_dir="/s")
    text = st.describe()
    assert "2 of 3 nodes running" in text
    assert "bootstrap 127.0.0.1:19192,127.0.0.1:19193,127.0.0.1:19194" in text
    assert "node 1: 127.0.0.1:19192, pid 111, rack r1" in text
    assert "node 2: 127.0.0.1:19193, stopped, rack r2" in text
    assert "run.tasks (3 partitions): node 1 leads 2, node 3 leads 1" in text
    assert "run.dlq (1 partition): 1 without a leader" in text
    assert "__consumer_offsets" not in text
    assert "under-replicated partitions (2): run.tasks[0,1]" in text
    assert leader_lines({}) == []
    stopped = ClusterStatus([NodeStatus(1, 1, None, False)], state_dir="/s")
    assert not stopped.running and stopped.bootstrap is None


def test_cluster_options_that_cannot_apply_are_one_line_errors(monkeypatch, tmp_path, capsys):
    from astraflow.cli.main import main

    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    monkeypatch.setenv("ASTRAFLOW_CLUSTER_STATE", str(tmp_path / "cluster"))
    assert main(["broker", "start", "--brokers", "3", "--secure"]) == 2
    assert main(["broker", "start", "--brokers", "3", "--racks", "r1,r2"]) == 2
    assert main(["broker", "logs", "--node", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [
        "astraflow: --secure is available on the single embedded broker only, not with "
        "--brokers",
        "astraflow: --racks: 3 rack names, one a node, separated by commas (got 'r1,r2')",
        f"astraflow: --node 2: the embedded cluster ({tmp_path / 'cluster'}) has no state: "
        "`astraflow broker start --brokers N` first"]
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "elsewhere:9092")
    assert main(["up", str(REPO / "topology" / "default.yaml"), "--brokers", "3",
                 "--runs-dir", str(tmp_path / "runs")]) == 2
    assert capsys.readouterr().err.strip() == (
        "astraflow: up --brokers runs on the embedded cluster, but ASTRAFLOW_BOOTSTRAP names "
        "another: unset it, or run without --brokers")
    assert not (tmp_path / "cluster").exists()


def test_commands_find_the_running_cluster_when_the_broker_does_not_run(monkeypatch,
                                                                        tmp_path):
    """``KafkaConfig.effective``: ASTRAFLOW_BOOTSTRAP, else the embedded broker, else the
    embedded cluster while a node of it runs (its pid's command line names the node's
    config: a pid reused by another process does not count)."""
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    monkeypatch.setenv("ASTRAFLOW_STATE", str(tmp_path / "broker"))  # no broker there
    monkeypatch.setenv("ASTRAFLOW_CLUSTER_STATE", str(tmp_path / "cluster"))
    assert KafkaConfig().effective().bootstrap_servers == "127.0.0.1:19092"  # the default
    ports = {str(i): {"port": 19300 + i, "controller_port": 19400 + i} for i in (1, 2, 3)}
    (tmp_path / "cluster").mkdir()
    (tmp_path / "cluster" / "cluster.json").write_text(json.dumps(
        {"size": 3, "cluster_id": "x", "racks": None, "nodes": ports}))
    props = tmp_path / "cluster" / "node-2" / "server.properties"
    props.parent.mkdir()
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    node = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", str(props)])
    try:
        (props.parent / "pid.json").write_text(json.dumps({"pid": other.pid}))
        assert KafkaConfig().effective().bootstrap_servers == "127.0.0.1:19092"
        (props.parent / "pid.json").write_text(json.dumps({"pid": node.pid}))
        assert KafkaConfig().effective().bootstrap_servers == (
            "127.0.0.1:19301,127.0.0.1:19302,127.0.0.1:19303")
        assert KafkaConfig(bootstrap_servers="b:1").effective().bootstrap_servers == "b:1"
        monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "env:1")
        assert KafkaConfig().effective().bootstrap_servers == "env:1"
    finally:
        for p in (other, node):
            p.kill()
            p.wait(10)

