"""``replay process`` without a broker: the chain downstream of the raw trajectories, --set
overrides, when a consumer has caught up, the report beside the original run (the chain run
again on a real broker: tests/integration/replay/test_replay_process.py)."""

from __future__ import annotations

import pytest

from astraflow.config.topology import TopologyError, load_topology
from astraflow.replay.process import (
    apply_sets,
    caught_up,
    chain_of,
    load_chain_topology,
    report,
    upstream_of,
)
from astraflow.replay.ranges import ReplayError
from tests.conftest import REPO


def test_the_chain_is_what_lies_downstream_of_the_raw_trajectories_in_flow_order():
    topo = load_topology(REPO / "topology" / "data-algorithms.yaml")
    chain = chain_of(topo)
    assert chain == ["dynamic-sampling", "staleness", "router", "batcher"]  # not greso
    up = upstream_of(topo, chain)
    assert up["dynamic-sampling"] == set() and up["batcher"] == {"router"}
    bare = topo.model_copy(update={"processors": {
        k: v for k, v in topo.processors.items() if k == "greso"}})
    with pytest.raises(ReplayError, match="no processor reads trajectories.raw"):
        chain_of(bare)


def test_set_overrides_keys_and_refuses_what_it_cannot_set(tmp_path):
    doc = {"policies": {"actor": {"max_staleness": 4}}}
    apply_sets(doc, ["policies.actor.max_staleness=1", "processors.x.options.k=[1, 2]"])
    assert doc["policies"]["actor"]["max_staleness"] == 1
    assert doc["processors"]["x"]["options"]["k"] == [1, 2]
    with pytest.raises(ReplayError, match="KEY.PATH=VALUE"):
        apply_sets(doc, ["policies.actor.max_staleness"])
    with pytest.raises(ReplayError, match="max_staleness is not a mapping"):
        apply_sets(doc, ["policies.actor.max_staleness.x=1"])
    topo = load_chain_topology(REPO / "topology" / "default.yaml",
                               ["policies.actor.max_staleness=1"], "other")
    assert topo.run == "other" and topo.processors["staleness"].options["max_staleness"] == 1
    with pytest.raises(TopologyError, match="max_staleness"):
        load_chain_topology(REPO / "topology" / "default.yaml",
                            ["policies.actor.max_staleness=-3"], "other")


def test_a_consumer_has_caught_up_when_every_non_empty_partition_is_read_to_its_end():
    marks = {"t": {0: (0, 8), 1: (0, 0), 2: (5, 5)}}
    assert caught_up({("t", 0): 8}, marks)  # 1 and 2 hold nothing
    assert not caught_up({("t", 0): 7}, marks)
    assert not caught_up({}, marks)
    assert caught_up({}, {"t": {0: (3, 3)}})


def test_the_report_sets_the_replay_beside_the_original_run():
    from astraflow.replay.process import Figures

    text = report(["staleness"], {"staleness": Figures(6, 4, 0, {"staleness/dropped": 2.0})},
                  {"staleness": Figures(6, 6, 0, {"staleness/dropped": 0.0})})
    lines = text.splitlines()
    assert lines[0].split() == ["processor", "figure", "replay", "original", "run"]
    assert lines[2].split() == ["records", "out", "4", "6"]
    assert lines[-1].split() == ["staleness/dropped", "2", "0"]
    assert "-" in report(["x"], {"x": Figures(1, 1, 0)}, {})

