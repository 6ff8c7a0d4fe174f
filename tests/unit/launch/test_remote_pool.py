"""A pool that reaches the broker another way, without a broker: a pool's own ``kafka:`` settings
merged over the topology's, a bad one naming its key, ``up`` and a node run by hand taking the
pool's bootstrap address (the REMOTE listener: tests/unit/broker/test_remote_listener.py)."""

from __future__ import annotations

import sys

import pytest

from astraflow.cli.context import kafka_config
from astraflow.cli.main import build_parser
from astraflow.config.topology import TopologyError, parse_topology
from astraflow.launch.plan import pool_bootstrap
from astraflow.launch.up import _spawner


def _topology(remote_kafka=None, **kafka):
    pools = {"local": {}, "remote": {}}
    if remote_kafka is not None:
        pools["remote"]["kafka"] = remote_kafka
    return parse_topology({"run": "r", "kafka": kafka, "pools": pools}, source="t.yaml")


def test_a_pools_kafka_settings_merge_over_the_topologys():
    topo = _topology({"bootstrap_servers": "proxy:9094", "options": {"socket.timeout.ms": 90000},
                      "outage_limit_s": 900},
                     bootstrap_servers="broker:9092", client_id="c",
                     options={"security.protocol": "PLAINTEXT"})
    remote = topo.pool_kafka("remote")
    assert remote.bootstrap_servers == "proxy:9094"
    assert remote.options == {"security.protocol": "PLAINTEXT", "socket.timeout.ms": 90000}
    assert remote.client_id == "c" and remote.outage_limit_s == 900
    assert topo.pool_kafka("local") == topo.kafka  # the other pool: the topology's
    assert topo.pool_kafka("unknown") == topo.kafka
    assert topo.kafka.bootstrap_servers == "broker:9092"  # the topology's stays as it was


@pytest.mark.parametrize("kafka, key", [
    ({"bootstrap": "proxy:9094"}, "pools.remote.kafka.bootstrap: unknown Kafka setting"),
    ({"outage_limit_s": 0}, "pools.remote.kafka.outage_limit_s"),
    ({"options": "x"}, "pools.remote.kafka.options"),
])
def test_a_bad_pool_kafka_setting_names_its_key(kafka, key):
    with pytest.raises(TopologyError, match=f"t.yaml: {key}"):
        _topology(kafka)


def test_a_remote_node_under_up_gets_its_pools_bootstrap(tmp_path):
    topo = _topology({"bootstrap_servers": "proxy:9094"}, bootstrap_servers="broker:9092")
    assert pool_bootstrap(topo, "raas-remote-0") == "proxy:9094"
    assert pool_bootstrap(topo, "raas-remote-12") == "proxy:9094"
    assert pool_bootstrap(topo, "raas-local-0") is None
    assert pool_bootstrap(topo, "trainer-actor") is None
    (tmp_path / "logs").mkdir()
    spawn = _spawner(topo, topo.kafka, tmp_path)
    show = [sys.executable, "-c", "import os; print(os.environ['ASTRAFLOW_BOOTSTRAP'])"]
    for name in ("raas-remote-0", "raas-local-0"):
        assert spawn(name, show).wait(60) == 0
    assert (tmp_path / "logs" / "raas-remote-0.log").read_text().strip() == "proxy:9094"
    assert (tmp_path / "logs" / "raas-local-0.log").read_text().strip() == "broker:9092"


def test_a_raas_node_run_by_hand_takes_its_pools_settings(monkeypatch):
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    topo = _topology({"bootstrap_servers": "proxy:9094"}, bootstrap_servers="broker:9092")
    args = build_parser().parse_args(["raas", "run", "-t", "t.yaml", "--pool", "remote",
                                      "--policy-model", "actor=m"])
    args.loaded_topology = topo
    assert kafka_config(args, topo.pool_kafka("remote")).bootstrap_servers == "proxy:9094"
    assert kafka_config(args).bootstrap_servers == "broker:9092"
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "env:9092")  # as everywhere, the env wins
    assert kafka_config(args, topo.pool_kafka("remote")).bootstrap_servers == "env:9092"

