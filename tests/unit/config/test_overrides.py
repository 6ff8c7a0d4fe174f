"""The override flags of astraflow.config.overrides and the component configurations of
astraflow.config.components: derived from the typed sections, with one default each."""

from __future__ import annotations

import pytest

from astraflow.config.components import eval_settings, feeder_spec, node_settings, trainer_spec
from astraflow.config.overrides import (
    EVAL_FLAGS,
    FEEDER_FLAGS,
    NODE_FLAGS,
    TRAINER_FLAGS,
    WARM_START_FLAGS,
    OverrideError,
    parse_argv,
)
from astraflow.config.topology import PolicySpec, PoolSpec, TrainerSpec, parse_topology


def _topo(**sections):
    return parse_topology({"run": "r", **sections})


def test_an_argv_list_parses_into_typed_values_in_the_order_of_the_table():
    argv = ["--levels", "1,2", "--epochs", "0", "--rate", "60", "--policy", "a", "--policy",
            "b", "--from-start", "--instance", "x"]
    assert parse_argv(FEEDER_FLAGS, argv, {"--instance": 1}) == {
        "rate": 60.0, "epochs": 0, "from_start": True, "policy": ["a", "b"], "levels": "1,2"}
    assert parse_argv(TRAINER_FLAGS, ["--no-std-normalize", "--lr=0.5"]) == {
        "lr": 0.5, "no_std_normalize": True}
    assert parse_argv(NODE_FLAGS, ["--workflow-options", 'w={"a": 1}']) == {
        "workflow_options": [("w", {"a": 1})]}
    # an unknown flag, a missing value or a value of the wrong type: no parse
    for bad in (["--bogus"], ["--lr"], ["--lr", "fast"], ["--dtype", "int4"], ["0.1"],
                ["--workflow-options", "w=[1]"]):
        assert parse_argv(TRAINER_FLAGS + NODE_FLAGS[2:3], bad) is None, bad
    assert parse_argv(NODE_FLAGS, ["--workflow-options", "w=[1]"]) is None


def test_the_warm_start_flags_are_model_inits():
    from astraflow.cli.main import build_parser

    names = {f.name for f in WARM_START_FLAGS}
    assert {"--warm-start-steps", "--carry-slip", "--warm-start-until"} <= names
    parser = build_parser()
    taken = set(vars(parser.parse_args(["model", "init", "d"]))) | set(vars(parser.parse_args(
        ["model", "init-role", "d", "--role", "verifier"])))
    assert {f.dest for f in WARM_START_FLAGS} <= taken


def test_the_defaults_of_the_processes_are_the_typed_sections():
    """ServiceOptions holds the policy's typed section itself, and repeats none of its
    settings; NodeOptions keeps defaults for code that builds it by hand, the typed
    sections' own."""
    import dataclasses

    from astraflow.raas.node import NodeOptions
    from astraflow.trainer.service import ServiceOptions

    spec = PolicySpec(model="m")
    built = ServiceOptions("p", spec)
    assert built.spec is spec and built.spec.trainer == TrainerSpec()
    own = {f.name for f in dataclasses.fields(ServiceOptions)} - {"spec"}
    declared = set(PolicySpec.model_fields) | set(TrainerSpec.model_fields)
    assert own & declared == set(), own & declared
    node = NodeOptions.from_settings(node_settings(_topo(policies={"a": {"model": "m"}}), "p"))
    assert node == NodeOptions(pool="p")
    assert NodeOptions().n_samples == PoolSpec().n_samples == 8


def test_a_flag_is_checked_as_the_file_is_and_named_when_refused():
    topo = _topo(policies={"actor": {"model": "m", "trainer": {"loss": "m2po"}}})
    assert trainer_spec(topo, "actor", {"m2_threshold": 0.1}).trainer.m2_threshold == 0.1
    for given, error in (
            ({"lr": -1.0}, "--lr: Input should be greater than 0"),
            ({"clip_low": 0.1}, "--clip-low: not read by loss m2po"),
            ({"max_staleness": -1}, "--max-staleness: Input should be greater than or equal"),
            ({"micro_batch_size": 2, "micro_batch_tokens": 9},
             "give micro_batch_size or micro_batch_tokens, not both")):
        with pytest.raises(OverrideError, match=error):
            trainer_spec(topo, "actor", given)
    with pytest.raises(OverrideError, match="--chat actor: "):
        node_settings(topo, "p", {"chat": [("actor", {"template": "sometimes"})]})
    with pytest.raises(OverrideError, match="--chat other: no such --policy-model"):
        node_settings(topo, "p", {"chat": [("other", {})]})
    with pytest.raises(OverrideError, match="--blind: for role verifier or selector"):
        eval_settings(topo, "actor", {"blind": True})
    with pytest.raises(OverrideError, match="--reward: not a reward"):
        eval_settings(topo, "actor", {"reward": "no-such-reward"})
    with pytest.raises(OverrideError, match="--workflow: unknown workflow"):
        feeder_spec(topo, {"workflow": "nope"})


def test_the_engine_of_a_flag_leaves_the_files_options_of_another_engine():
    topo = _topo(policies={"a": {"model": "m", "dtype": "float16"}},
                 pools={"p": {"engine": "vllm", "engine_options": {"cpus": 2}}})
    node = node_settings(topo, "p")
    assert (node.engine, node.engine_options, node.dtype) == ("vllm", {"cpus": 2}, "float16")
    node = node_settings(topo, "p", {"engine_options": {"kv_cache_gib": 1}})
    assert node.engine_options == {"cpus": 2, "kv_cache_gib": 1}
    node = node_settings(topo, "p", {"engine": "torch"})
    assert (node.engine, node.engine_options) == ("torch", {})


def test_every_flag_names_a_field_of_its_model_and_says_what_it_does():
    for table in (TRAINER_FLAGS, NODE_FLAGS, EVAL_FLAGS, FEEDER_FLAGS, WARM_START_FLAGS):
        dests = [f.dest for f in table]
        assert len(dests) == len(set(dests))
        for flag in table:
            assert flag.field in flag.model.model_fields, flag.name
            # a command's --help is its flags' descriptions (model init has its own)
            assert flag.description or table is WARM_START_FLAGS, flag.name
