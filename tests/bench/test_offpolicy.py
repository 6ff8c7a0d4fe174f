"""bench/offpolicy.py: its cell topologies, checkpoints and report (no Kafka, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.config.topology import parse_topology
from astraflow.launch import up as launcher
from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("offpolicy")

BASES = {name: yaml.safe_load((REPO / "topology" / name).read_text())
         for name in ("default.yaml", "smollm2.yaml")}


def _trainer_options(topo):
    """The options the trainer that ``astraflow up`` starts for ``topo`` runs with (its
    command line in up's plan, as ``trainer run`` builds them)."""
    cmd = launcher.plan_processes(topo, "t.yaml")["trainer-actor"]
    return configuration(cmd[3:], topo)


def _trainer_config(topo):
    """The ``TrainerSpec`` that trainer's step takes."""
    return _trainer_options(topo).spec.trainer


@pytest.mark.parametrize("base", sorted(BASES))
@pytest.mark.parametrize("objective", bench.OBJECTIVES)
@pytest.mark.parametrize("staleness", bench.STALENESS)
def test_every_cell_is_a_valid_topology_with_its_bound_and_objective(base, objective,
                                                                     staleness):
    doc = bench.build_cell(BASES[base], objective, staleness, model="/m", state_dir="/s",
                           seed=7, m2_threshold=0.02)
    topo = parse_topology(doc)
    assert topo.run == f"bench-op-{objective.replace('_', '-')}-s{staleness}"
    (policy,) = topo.policies.values()
    assert (policy.model, policy.init_tiny, policy.max_staleness) == ("/m", False, staleness)
    assert policy.trainer.loss == objective and policy.trainer.keep_versions == 0
    assert (policy.trainer.seed, policy.trainer.state_dir) == (7, "/s/actor")
    assert topo.eval is None  # scored after the run, not beside it
    # the bound reaches every stage that enforces it, the objective the trainer
    assert topo.processors["staleness"].options["max_staleness"] == staleness
    assert topo.processors["batcher"].options["max_staleness"] == staleness
    trainer = _trainer_config(topo)
    assert (trainer.loss, _trainer_options(topo).spec.max_staleness) == (objective, staleness)
    assert trainer.m2_threshold == (0.02 if objective == "m2po" else 0.04)
    if topo.feeder.dataset is not None:
        assert Path(topo.feeder.dataset.path).is_absolute()
    assert "bench-op" not in BASES[base]["run"]  # the base document is left alone


def test_hyperparameters_the_objective_does_not_read_are_dropped():
    base = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    base["policies"]["actor"]["trainer"].update(tis_cap=3.0, clip_high=0.3)
    m2po = parse_topology(bench.build_cell(base, "m2po", 4, model="/m", state_dir="/s"))
    assert "tis_cap" not in m2po.policies["actor"].trainer.model_fields_set
    kept = parse_topology(bench.build_cell(base, "decoupled_ppo", 4, model="/m",
                                           state_dir="/s"))
    assert (kept.policies["actor"].trainer.tis_cap, kept.policies["actor"].trainer.clip_high
            ) == (3.0, 0.3)
    masked = parse_topology(bench.build_cell(base, "decoupled_ppo_mask", 4, model="/m",
                                             state_dir="/s"))
    assert masked.run == "bench-op-decoupled-ppo-mask-s4"
    assert (masked.policies["actor"].trainer.loss, masked.policies["actor"].trainer.tis_mask
            ) == ("decoupled_ppo", True)
    assert "tis_mask" not in kept.policies["actor"].trainer.model_fields_set
    assert _trainer_config(masked).tis_mask is True and _trainer_config(kept).tis_mask is False
    four = parse_topology(bench.build_cell(base, "decoupled_ppo_mb4", 4, model="/m",
                                           state_dir="/s"))
    assert (four.policies["actor"].trainer.loss, four.policies["actor"].trainer.minibatches,
            _trainer_config(four).minibatches) == ("decoupled_ppo", 4, 4)
    slow = parse_topology(bench.build_cell(base, "decoupled_ppo_mb4_lr", 4, model="/m",
                                           state_dir="/s"))
    assert (slow.policies["actor"].trainer.lr, _trainer_config(slow).lr) == (7.5e-6, 7.5e-6)
    with pytest.raises(ValueError, match="unknown objective"):
        bench.build_cell(base, "ppo", 4, model="/m", state_dir="/s")
    with pytest.raises(ValueError, match=">= 0"):
        bench.build_cell(base, "m2po", -1, model="/m", state_dir="/s")


def test_versions_at_checkpoints_and_scoring_each_version_once():
    at = bench.versions_at({0: 1.0, 1: 20.0, 2: 20.5, 3: 70.0}, [0.5, 30.0, 60.0, 90.0])
    assert at == {0.5: None, 30.0: 2, 60.0: 2, 90.0: 3}
    scored = []
    result = {"at": at, "_manifests": ["m"], "_topology": object()}
    bench.score_cell(result, lambda manifests, v: scored.append(v) or v / 10)
    assert scored == [2, 3] and result["accuracy"] == {30.0: 0.2, 60.0: 0.2, 90.0: 0.3}
    assert "_manifests" not in result and "_topology" not in result


def test_table_shows_accuracy_by_version_and_time_per_cell():
    row = {"objective": "m2po", "staleness": 16, "versions": 41, "at": {100.0: 12, 200.0: 41},
           "accuracy": {100.0: 0.25, 200.0: 0.5},
           "trainer": {"trainer/staleness_mean": 3.5, "trainer/staleness_max": 9.0,
                       "trainer/clip_frac": 0.0, "trainer/m2_masked_frac": 0.031,
                       "trainer/reward_mean": 0.25, "trainer/zero_advantage_frac": 1.0,
                       "trainer/approx_kl": 0.0123}}
    failed = {"objective": "clipped_tis", "staleness": 0, "error": "no weights published"}
    text = bench.table({"a": row, "b": failed}, [100.0, 200.0], 0.125)
    lines = text.splitlines()
    assert lines[0] == ("| objective | bound | t=100s | t=200s | versions | "
                        "staleness mean / max | clipped % | truncated % | m2 masked % | "
                        "train reward | no-advantage % | KL |")
    assert ("| m2po | 16 | 25.0 (v12) | 50.0 (v41) | 41 | 3.50 / 9 | 0.0 | – | 3.1 | "
            "0.250 | 100.0 | 0.012 |") in text
    assert "| clipped_tis | 0 | no weights published |" in text
    assert "held-out accuracy 12.5 %" in text


def test_arguments():
    args = bench.parse_args(["--duration", "60", "--objectives", "m2po,clipped_tis",
                             "--staleness", "0,16"])
    assert args.objectives == ["m2po", "clipped_tis"] and args.staleness == [0, 16]
    assert args.checkpoints == [15.0, 30.0, 45.0, 60.0]
    assert bench.parse_args(["--checkpoints", "5,10"]).checkpoints == [5.0, 10.0]
    assert bench.parse_args(["--objectives", "decoupled_ppo_mask"]).objectives == [
        "decoupled_ppo_mask"]
    for bad in (["--objectives", "ppo"], ["--staleness", "x"], ["--staleness", "-1"]):
        with pytest.raises(SystemExit):
            bench.parse_args(bad)
