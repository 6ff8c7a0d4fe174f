"""bench/data_algorithms.py: the variant topologies it builds (no Kafka, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.config.topology import parse_topology
from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("data_algorithms")

BASE = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())


def _variant(name: str, base=BASE, **kw):
    doc = bench.build_variant(base, name, model="/m", state_dir="/s", seed=7, **kw)
    return doc, parse_topology(doc)


def _chain(topo, start: str) -> list[str]:
    """Processor names along the single path from topic ``start``."""
    out, topic = [], start
    while True:
        nxt = [n for n, p in topo.processors.items() if topic in p.inputs]
        if len(nxt) != 1:
            return out
        out.append(nxt[0])
        topic = topo.processors[nxt[0]].outputs[0]


@pytest.mark.parametrize("name", bench.VARIANTS)
def test_every_variant_is_a_valid_topology_with_its_own_run_and_fixed_model(name):
    doc, topo = _variant(name)
    assert topo.run == f"bench-da-{name.replace('_', '-')}"
    (policy,) = topo.policies.values()
    assert policy.model == "/m" and policy.init_tiny is False
    assert (policy.trainer.seed, policy.trainer.state_dir) == (7, "/s/actor")
    assert topo.feeder.seed == 7
    # the base document is left alone
    assert BASE["run"] != topo.run and "init_tiny" not in BASE["policies"]["actor"]


def test_baseline_keeps_the_processors():
    _, topo = _variant("baseline")
    base = parse_topology(BASE)
    assert topo.processors == base.processors


def test_dynamic_sampling_sits_between_raw_trajectories_and_the_staleness_filter():
    _, topo = _variant("dynamic_sampling")
    chain = _chain(topo, "trajectories.raw")
    assert chain[:2] == ["dynamic-sampling", "staleness"]
    assert topo.processors["dynamic-sampling"].kind == "dynamic_sampling"
    assert topo.processors["dynamic-sampling"].outputs == ["trajectories.sampled"]
    assert "trajectories.sampled" in topo.topics


def test_greso_replaces_the_pass_through():
    base = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    base["processors"] = {("forward-tasks" if n == "admission" else n):
                          ({"kind": "passthrough", "inputs": ["tasks.source"],
                            "outputs": ["tasks"]} if n == "admission" else p)
                          for n, p in base["processors"].items()}
    _, topo = _variant("greso", base=base)
    assert "forward-tasks" not in topo.processors
    g = topo.processors["greso"]
    assert (g.kind, g.inputs, g.outputs, g.options["seed"]) == (
        "greso", ["tasks.source"], ["tasks"], 7)


def test_greso_goes_ahead_of_other_readers_when_there_is_no_pass_through():
    _, topo = _variant("greso")  # the default topology: admission, no pass-through
    assert _chain(topo, "tasks.source") == ["greso", "admission"]
    assert topo.processors["admission"].inputs == ["tasks.selected"]


def test_replay_turns_on_replay_in_the_batcher():
    _, topo = _variant("replay", replay_ratio=0.5)
    opts = topo.processors["batcher"].options
    assert opts["replay_ratio"] == 0.5 and opts["replay_seed"] == 7
    assert opts["max_staleness"] == BASE["policies"]["actor"]["max_staleness"]


def test_unknown_variant_is_an_error():
    with pytest.raises(ValueError, match="unknown variant"):
        _variant("nope")


def test_table_reports_rollouts_against_the_baseline():
    row = {"version": 5, "reached_budget": True, "rollouts_needed": 80,
           "rollouts_generated": 100, "groups_needed": 10, "groups_trained": 8,
           "groups_replayed": 0, "seconds_v0_to_budget": 3.0, "final_accuracy": 0.5}
    text = bench.table({"baseline": row, "dynamic_sampling": {**row, "rollouts_needed": 280}},
                       0.4)
    assert "| dynamic_sampling | 5 | 280 | 3.50 | 100 | 10 | 8 (+ 0) |" in text
    assert "0.400" in text
