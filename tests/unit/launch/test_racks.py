"""Rack-aware pools without a broker: a pool's ``rack`` is ``client.rack`` on every consumer of
its nodes only, a bad rack names its key, a node takes its pool's rack under ``up`` and by hand
(on the embedded cluster: tests/integration/kafka/test_rack_aware.py)."""

from __future__ import annotations

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.cli.main import build_parser, main
from astraflow.cli.topology import explain
from astraflow.config.topology import TopologyError, parse_topology
from astraflow.kafka.config import RACK_ENV
from astraflow.launch.plan import plan_processes


def _topology(remote: dict | None = None, **extra) -> object:
    pools = {"local": {}, "remote": {"rack": "r3", **(remote or {})}}
    return parse_topology({"run": "r", "kafka": {"bootstrap_servers": "b:9092"},
                           "pools": pools, **extra}, source="t.yaml")


def test_a_pools_rack_is_client_rack_on_every_consumer_of_its_nodes_only():
    topo = _topology()
    remote = topo.pool_kafka("remote")
    assert remote.consumer_conf("g")["client.rack"] == "r3"
    assert "client.rack" not in remote.producer_conf()  # producers write to the leader
    assert "client.rack" not in remote.admin_conf()
    assert "client.rack" not in topo.pool_kafka("local").consumer_conf("g")
    assert "client.rack" not in topo.kafka.consumer_conf("g")
    shown = explain(topo)  # `astraflow topology explain`
    assert "as the tasks name them, rack r3" in shown and shown.count("rack ") == 1, shown
    assert topo.pool_kafka("remote", rack="r1").consumer_conf("g")["client.rack"] == "r1"
    with_kafka = _topology({"kafka": {"consumer_options": {"fetch.max.bytes": 1 << 20}}})
    assert with_kafka.pool_kafka("remote").consumer_options == {
        "fetch.max.bytes": 1 << 20, "client.rack": "r3"}


@pytest.mark.parametrize("remote, error", [
    ({"rack": ""}, "pools.remote.rack: '' is no rack name"),
    ({"rack": "eu west"}, "pools.remote.rack: 'eu west' is no rack name"),
    ({"rack": "r1,r2"}, "pools.remote.rack: 'r1,r2' is no rack name"),
    ({"kafka": {"consumer_options": {"client.rack": "r1"}}},
     "pools.remote.rack: 'r3', but kafka.consumer_options.client.rack says 'r1'"),
])
def test_a_bad_rack_names_its_key(remote, error):
    with pytest.raises(TopologyError, match=f"^t.yaml: {error}"):
        _topology(remote)


def test_a_node_up_starts_takes_its_pools_rack_and_one_by_hand_takes_rack_or_the_env(
        monkeypatch, tmp_path, capsys):
    from astraflow.cli.raas import node_rack

    monkeypatch.delenv(RACK_ENV, raising=False)
    topo = _topology(policies={"actor": {"model": "m"}})
    procs = plan_processes(topo, "t.yaml")
    for name, pool_rack in (("raas-remote-0", "r3"), ("raas-local-0", None)):
        argv = procs[name][3:]  # the node's command line, after `python -m ...`
        assert "--rack" not in argv  # up passes no rack: the node reads its pool's
        node = configuration(argv, topo).settings
        assert node.spec.rack == pool_rack
        # the node's consumers (`raas run`: its own rack, else its pool's)
        consumer = topo.pool_kafka(node.pool, node_rack(build_parser().parse_args(argv)))
        assert consumer.consumer_conf("g").get("client.rack") == pool_rack

    def rack(*flags: str) -> str | None:
        return node_rack(build_parser().parse_args(
            ["raas", "run", "-t", "t.yaml", "--policy-model", "actor=m", *flags]))

    assert rack() is None  # the pool's rack (pool_kafka) then applies
    monkeypatch.setenv(RACK_ENV, "r2")
    assert rack() == "r2"
    assert rack("--rack", "r1") == "r1"  # the flag wins over the environment
    monkeypatch.setenv(RACK_ENV, "r 2")
    with pytest.raises(ValueError, match=f"^{RACK_ENV}: 'r 2' is no rack name"):
        rack()
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"run": "r", "pools": {"remote": {}}}))
    assert main(["raas", "run", "-t", str(path), "--pool", "remote", "--policy-model",
                 "actor=m", "--rack", "a,b"]) == 2
    assert capsys.readouterr().err.strip() == (
        "astraflow raas run: --rack: 'a,b' is no rack name (a non-empty name without blanks "
        "or commas, as a broker's broker.rack: r1, eu-west-1a ...)")

