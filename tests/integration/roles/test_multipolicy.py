"""Multi-policy runs on the broker: router + one batcher per policy, where each policy's batches
hold only its own sequences, and a RaaS node that follows two weight streams independently
(without a broker: tests/unit/roles/test_multipolicy.py)."""

from __future__ import annotations

import threading

import pytest

from astraflow.wire.records import Batch, TrajectoryGroup
from tests.conftest import running, wait_for
from tests.unit.roles.test_multipolicy import task, verify_group


def test_each_policy_trainer_sees_only_its_own_sequences(kafka_config, make_topology):
    """trajectories -> router -> samples.<policy> -> batcher per policy -> batches.<policy>."""
    from astraflow.dataflow.runtime import ProcessorRuntime
    from astraflow.kafka.clients import RecordProducer, read_all

    topo, _ = make_topology(
        topics={"trajectories": {}, "samples.solver": {}, "samples.verifier": {},
                "batches.solver": {"partitions": 1}, "batches.verifier": {"partitions": 1}},
        processors={
            "route": {"kind": "router", "inputs": ["trajectories"],
                      "outputs": ["samples.solver", "samples.verifier"], "poll_timeout_s": 0.2},
            "batch-solver": {"kind": "batcher", "inputs": ["samples.solver"],
                             "outputs": ["batches.solver"], "poll_timeout_s": 0.2,
                             "options": {"policy": "solver", "batch_size": 3}},
            "batch-verifier": {"kind": "batcher", "inputs": ["samples.verifier"],
                               "outputs": ["batches.verifier"], "poll_timeout_s": 0.2,
                               "options": {"policy": "verifier", "batch_size": 2}},
        })
    producer = RecordProducer(kafka_config)
    groups = [verify_group(f"g{i}", 4) for i in range(6)]
    for g in groups:
        producer.produce(topo.full_name("trajectories"), g, key=g.group_id)
    producer.flush()
    runtimes = [ProcessorRuntime(topo, name, instance="t")
                for name in ("route", "batch-solver", "batch-verifier")]
    threads = [threading.Thread(target=rt.run, daemon=True) for rt in runtimes]
    for t in threads:
        t.start()

    def batches(policy):
        return [r.record for r in read_all(kafka_config, topo.full_name(f"batches.{policy}"),
                                           idle_s=0.3, expect=Batch)]
    try:
        wait_for(lambda: len(batches("solver")) == 2 and len(batches("verifier")) == 3, 60,
                 "2 solver and 3 verifier batches")
    finally:
        for rt in runtimes:
            rt.stop()
        for t in threads:
            t.join(30)
    for policy, roles in (("solver", {"solver", "solver_retry"}), ("verifier", {"verifier"})):
        got = batches(policy)
        assert all(b.policy == policy for b in got)
        seqs = [s for b in got for g in b.groups for s in g.sequences]
        assert {s.policy for s in seqs} == {policy} and {s.role for s in seqs} == roles
        ids = sorted(g.group_id for b in got for g in b.groups)
        assert ids == sorted(f"g{i}/{policy}" for i in range(6))
    # every sequence arrived exactly once, at its own policy's trainer
    total = sum(len(g.sequences) for b in batches("solver") + batches("verifier")
                for g in b.groups)
    assert total == sum(len(g.sequences) for g in groups)


@pytest.mark.slow
def test_node_follows_each_policy_weights_independently(kafka_config, make_topology, tmp_path):
    import torch

    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.engine import TorchEngine
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import FileBlobStore, WeightPublisher
    from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer

    topo, _ = make_topology(topics={
        "tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1},
        "weights.solver": {"partitions": 1}, "weights.verifier": {"partitions": 1}})
    engines = {p: TorchEngine(tiny_model(seed), tiny_tokenizer(), policy=p)
               for p, seed in (("solver", 0), ("verifier", 1))}
    producer = RecordProducer(kafka_config)
    published: dict[str, dict] = {}
    for policy, versions in (("solver", 3), ("verifier", 2)):
        pub = WeightPublisher(FileBlobStore(str(tmp_path / policy)), policy, anchor_interval=10)
        state = {k: v.clone() for k, v in engines[policy].model.state_dict().items()}
        for _ in range(versions):
            for m in pub.publish(state):
                producer.produce(topo.full_name(f"weights.{policy}"), m, key=policy)
            published[policy] = state
            state = {k: v + 0.01 * torch.randn_like(v) for k, v in state.items()}
    producer.produce(topo.full_name("tasks"), task("1+2=", "3"), key="p")
    producer.flush()
    node = RaaSNode(topo, dict(engines), NodeOptions(
        instance="mp", n_samples=2, poll_timeout_s=0.2,
        workflow_options={"solve_verify": {"max_new_tokens": 3}}))
    with running(node):
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 60, "a trajectory group")
        (g,) = [r.record for r in read_all(kafka_config, out, idle_s=0.3, expect=TrajectoryGroup)]
    assert set(node._watchers) == {"solver", "verifier"}
    assert node.status().weight_versions == {"solver": 2, "verifier": 1}
    for policy, version in (("solver", 2), ("verifier", 1)):
        assert {s.min_version for s in g.sequences if s.policy == policy} == {version}
        for k, t in engines[policy].model.state_dict().items():
            assert torch.equal(t, published[policy][k]), (policy, k)
    assert "verify/verifier_accuracy" in g.metrics

