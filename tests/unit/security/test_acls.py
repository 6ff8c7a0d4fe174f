"""Least-privilege ACLs computed from a topology (``astraflow topology acls``), no broker."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from astraflow.cli.main import main
from astraflow.cli.topology import graph
from astraflow.config.topology import load_topology, parse_topology
from astraflow.security.acls import component_acls, format_table, overlaps, principal_of, to_json

REPO = Path(__file__).resolve().parents[3]
SHIPPED = sorted([*(REPO / "topology").glob("*.yaml"),
                  *(REPO / "bench" / "topologies").glob("*.yaml")])


def _by_key(topo):
    return {c.key: c for c in component_acls(topo)}


def _graph_name(key: str, topo) -> str:
    """The name ``topology explain`` gives the component of principal key ``key``."""
    kind, _, name = key.partition(".")
    if kind == "processor":
        return f"{name} ({topo.processors[name].kind})"
    return {"pool": f"pool {name}", "trainer": f"trainer {name}", "eval": f"eval {name}",
            "feeder": "feeder"}[kind]


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topologies_get_least_privilege_acls(path):
    topo = load_topology(path)
    comps = _by_key(topo)
    full = topo.full_name
    assert set(comps) == {*topo.component_keys(), "operator"}
    assert overlaps(topo, list(comps.values())) == []
    weights = {full(t) for t in topo.topics if t.startswith("weights.")}
    for key, c in comps.items():
        if key == "operator":
            continue
        kind, _, name = key.partition(".")
        writes = c.topics("WRITE")
        # only the trainer of a policy writes weights.<policy> (and its blob topic)
        if kind == "trainer":
            assert full(f"weights.{name}") in writes
            if "weights.blobs" in topo.topics:
                assert full("weights.blobs") in writes
            assert writes & weights <= {full(f"weights.{name}"), full("weights.blobs")}
        else:
            assert not writes & weights, f"{key} may write weights: {writes & weights}"
        # what it consumes, follows and produces is exactly what the topology wires
        wired = next(g for g in graph(topo) if g.name == _graph_name(key, topo))
        consumed = {a.name for a in c.acls if a.why == "consumes"}
        assert consumed == {full(t) for t in wired.inputs}, key
        assert {full(t) for t in wired.follows} <= c.topics("READ"), key
        side = {"status", "dlq"} if kind != "feeder" else set()
        assert writes == {full(t) for t in [*wired.outputs, *side]}, key
        assert c.topics("READ") <= {full(t) for t in topo.topics}, key
        groups = c.groups("READ")
        assert len(groups) <= 1 and all(g.startswith(f"{topo.run}.") for g in groups), key
        for a in c.acls:  # a grant never reaches outside the run, but for reader groups
            assert a.name.startswith(f"{topo.run}.") or a.name.startswith("astraflow-"), a


def _acls_of_run(path: Path) -> dict[str, list[tuple]]:
    """Every component's ACLs with the run's name taken out of resource names."""
    topo = load_topology(path)
    return {c.key: sorted((a.resource, a.pattern, a.operation,
                           a.name.replace(topo.run, "<run>", 1)) for a in c.acls)
            for c in component_acls(topo)}


@pytest.mark.parametrize(
    "source", ["smollm2.yaml", "smollm2-vllm.yaml", "smollm2-gsm8k.yaml"])
def test_the_real_model_topologies_need_exactly_the_defaults_acls(source):
    """The SmolLM2 topologies wire the default's components and topics, so the secured
    run of the default (``up --secure``, every component as its own principal with exactly
    these ACLs and nothing denied:
    tests/integration/security/test_secure.py) covers theirs; when they diverge, this fails
    and they need a secured run of their own."""
    assert _acls_of_run(REPO / "topology" / source) == _acls_of_run(
        REPO / "topology" / "default.yaml")


def test_each_component_reads_only_its_own_group_and_transactional_prefix():
    topo = load_topology(REPO / "topology" / "solver-verifier.yaml")
    comps = _by_key(topo)
    assert comps["pool.local"].groups("READ") == {"solver-verifier.raas"}
    assert comps["trainer.solver"].groups("READ") == {"solver-verifier.trainer.solver"}
    assert comps["processor.router"].groups("READ") == {"solver-verifier.router"}
    txn = {key: {(a.name, a.operation) for a in c.acls if a.resource == "TRANSACTIONAL_ID"}
           for key, c in comps.items()}
    assert txn["pool.local"] == {("solver-verifier.raas.local.", "WRITE"),
                                 ("solver-verifier.raas.local.", "DESCRIBE")}
    assert txn["trainer.verifier"] == {("solver-verifier.trainer.verifier.", "WRITE"),
                                       ("solver-verifier.trainer.verifier.", "DESCRIBE")}
    assert txn["feeder"] == set() and txn["eval.solver"] == set()
    # the admission reads the lag of the pool's, the trainers' and the groups of the
    # processors between them (groups on their way to a batch), nothing else
    lag = {a.name for a in comps["processor.admission"].acls if a.why == "reads its lag"}
    assert lag == {"solver-verifier.raas", "solver-verifier.trainer.solver",
                   "solver-verifier.trainer.verifier", *(
                       f"solver-verifier.{p}" for p in ("staleness", "router",
                                                        "batcher-solver", "balance-verifier",
                                                        "batcher-verifier"))}


def test_processors_declare_their_side_reads():
    topo = load_topology(REPO / "topology" / "default.yaml")
    comps = _by_key(topo)
    side = {key: {a.name for a in c.acls if a.why == "reads without a group"}
            for key, c in comps.items()}
    assert side["processor.staleness"] == {"default.weights.actor"}
    assert side["processor.router"] == set()
    assert side["pool.local"] == {"default.weights.actor", "default.weights.blobs"}
    assert side["eval.actor"] == {"default.weights.actor", "default.weights.blobs"}


def test_principals_come_from_the_security_section(tmp_path):
    data = {"run": "r", "topics": {"tasks": {}, "trajectories.raw": {}, "weights.actor": {}},
            "policies": {"actor": {"model": "m"}}, "pools": {"local": {}},
            "kafka": {"security": {"protocol": "SASL_SSL", "username": "ops",
                                   "principals": {"pool.local": {"username": "rollout"}},
                                   "credentials_dir": str(tmp_path)}}}
    topo = parse_topology(data)
    assert principal_of(topo, "pool.local") == "User:rollout"
    assert principal_of(topo, "trainer.actor") == "User:r.trainer.actor"
    assert principal_of(topo, "operator") == "User:ops"
    plain = parse_topology({**data, "kafka": {}})
    assert principal_of(plain, "pool.local") == "User:r.pool.local"


def test_overlapping_grants_are_warned_about():
    data = {"run": "r", "topics": {"tasks": {}, "trajectories.raw": {}, "tasks.source": {}},
            "pools": {"local": {}},
            "processors": {"raas": {"kind": "passthrough", "inputs": ["tasks.source"],
                                    "outputs": ["tasks"]}}}
    topo = parse_topology(data)
    warnings = overlaps(topo, component_acls(topo))
    assert any("processor.raas: transactional-id prefix r.raas. also covers pool.local"
               in w for w in warnings), warnings
    assert any("group r.raas is shared by pool, processor" in w for w in warnings), warnings
    assert "warnings:" in format_table(topo, component_acls(topo))


def test_cli_prints_a_table_and_json(capsys):
    path = str(REPO / "topology" / "default.yaml")
    assert main(["topology", "acls", path]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^pool\.local  User:default\.pool\.local$", text, re.M)
    assert re.search(r"WRITE +topic +literal +default\.weights\.actor", text)
    assert main(["topology", "acls", "-t", path, "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["run"] == "default" and doc["warnings"] == []
    pool = next(c for c in doc["components"] if c["key"] == "pool.local")
    assert {"resource": "GROUP", "pattern": "LITERAL", "name": "default.raas",
            "operation": "READ", "why": "its consumer group"} in pool["acls"]
    topo = load_topology(path)
    assert json.loads(to_json(topo, component_acls(topo))) == doc


def test_reader_group_ids_are_named_in_one_place():
    """Assign-only readers name their group through the constants ACLs are made from."""
    pattern = re.compile(r"consumer_conf\(\s*f?[\"']astraflow-")
    found = [str(p.relative_to(REPO)) for p in (REPO / "astraflow").rglob("*.py")
             if pattern.search(p.read_text())]
    assert found == []
