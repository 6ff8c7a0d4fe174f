"""Staleness filter, router and batcher: decision logic without Kafka, then on a broker."""

from __future__ import annotations

import threading
from collections import Counter

from astraflow.dataflow import Incoming
from astraflow.dataflow.batcher import Batcher, BatcherOptions
from astraflow.dataflow.router import PolicyRouter, split_by_policy
from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.dataflow.staleness import StalenessFilter, StalenessOptions, staleness
from astraflow.dataflow.versions import StaticVersions
from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup, WeightManifest
from tests.conftest import wait_for


def seq(policy: str, versions: list[int], reward: float = 1.0) -> Sequence:
    n = len(versions)
    return Sequence(policy=policy, token_ids=list(range(n)),
                    loss_mask=[int(v >= 0) for v in versions], logprobs=[0.0] * n,
                    versions=versions, reward=reward, sample_index=0, finish_reason="stop")


def group(gid: str, *seqs: Sequence) -> TrajectoryGroup:
    return TrajectoryGroup(group_id=gid, prompt_id=gid, task_id=gid, workflow="w", source="s",
                           raas_id="r", pool="p", sequences=list(seqs),
                           rewards=[s.reward for s in seqs])


def incoming(rec, offset: int = 0, partition: int = 0, topic: str = "trajectories.raw"):
    return Incoming(topic, partition, offset, rec.group_id.encode(), rec)


def test_staleness_is_measured_from_the_oldest_generated_token():
    versions = StaticVersions({"actor": 10, "critic": 3})
    assert staleness(group("g", seq("actor", [-1, -1, 7, 9])), versions) == 3
    assert staleness(group("g", seq("actor", [-1, 10])), versions) == 0
    assert staleness(group("g", seq("actor", [-1, 9]), seq("critic", [0, 1])), versions) == 3
    assert staleness(group("g", seq("unknown", [-1, 0])), versions) == 0  # nothing published
    assert staleness(group("g", seq("actor", [-1, -1])), versions) == 0  # nothing generated


def test_staleness_filter_drops_and_counts():
    f = StalenessFilter("st", ["trajectories.raw"], ["trajectories"],
                        StalenessOptions(max_staleness=2), versions=StaticVersions({"actor": 10}))
    kept = list(f.process(incoming(group("ok", seq("actor", [-1, 8, 9])))))
    dropped = list(f.process(incoming(group("old", seq("actor", [-1, 7, 10])))))
    assert [o.topic for o in kept] == ["trajectories"] and dropped == []
    assert f.metrics()["staleness/dropped"] == 1 and f.metrics()["staleness/passed"] == 1
    assert f.metrics()["staleness/max_seen"] == 3


def test_router_splits_each_policy_sequences():
    g = group("g", seq("solver", [-1, 1], 1.0), seq("verifier", [-1, 2], 0.0),
              seq("solver", [-1, 1], 0.5))
    parts = split_by_policy(g)
    assert set(parts) == {"solver", "verifier"}
    assert [s.policy for s in parts["solver"].sequences] == ["solver", "solver"]
    assert parts["solver"].rewards == [1.0, 0.5]
    assert parts["verifier"].rewards == [0.0]
    r = PolicyRouter("r", ["trajectories"], ["samples.solver", "samples.verifier"])
    outs = list(r.process(incoming(g, topic="trajectories")))
    assert sorted(o.topic for o in outs) == ["samples.solver", "samples.verifier"]


def test_batcher_holds_until_full_and_reports_held_offsets():
    b = Batcher("b", ["samples.actor"], ["batches.actor"], BatcherOptions(batch_size=3))
    for i in range(5):
        assert list(b.process(incoming(group(f"g{i}", seq("actor", [-1, 0])), offset=10 + i,
                                       partition=i % 2, topic="samples.actor"))) == []
    out = list(b.flush(0))
    assert len(out) == 1
    batch: Batch = out[0].record
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    ranges = {(r.partition, r.start, r.end) for r in batch.source_offsets}
    assert ranges == {(0, 10, 13), (1, 11, 12)}
    assert b.held_offsets() == {("samples.actor", 1): 13, ("samples.actor", 0): 14}
    b.on_revoke([("samples.actor", 1)])
    assert b.held_offsets() == {("samples.actor", 0): 14}


def test_batcher_drops_groups_gone_stale_while_held():
    versions = StaticVersions({"actor": 1})
    b = Batcher("b", ["samples.actor"], ["batches.actor"],
                BatcherOptions(batch_size=2, max_staleness=1), versions=versions)
    b.process(incoming(group("a", seq("actor", [-1, 0])), topic="samples.actor"))
    assert list(b.flush(0)) == []
    versions.versions["actor"] = 3
    b.process(incoming(group("b", seq("actor", [-1, 3])), offset=1, topic="samples.actor"))
    assert list(b.flush(0)) == []  # "a" is now 3 versions old and was dropped
    assert b.metrics()["batcher/dropped_stale"] == 1


def manifest(policy: str, version: int) -> WeightManifest:
    return WeightManifest(policy=policy, version=version, base_version=None, kind="full",
                          dtype="float32", tensors=[], blobs=[], num_params=0, num_changed=0,
                          sparsity=0.0, encoded_bytes=0, trainer_step=version)


def run_in_thread(runtime: ProcessorRuntime) -> threading.Thread:
    t = threading.Thread(target=runtime.run, daemon=True)
    t.start()
    return t


def test_processor_chain_on_the_broker(kafka_config, make_topology):
    """raw -> staleness filter -> trajectories -> router -> samples.actor -> batcher."""
    topo, _ = make_topology(
        topics={"trajectories.raw": {}, "trajectories": {}, "samples.actor": {},
                "batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}},
        processors={
            "stale": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
                      "outputs": ["trajectories"], "options": {"max_staleness": 1},
                      "poll_timeout_s": 0.2},
            "route": {"kind": "router", "inputs": ["trajectories"],
                      "outputs": ["samples.actor"], "poll_timeout_s": 0.2},
            "batch": {"kind": "batcher", "inputs": ["samples.actor"],
                      "outputs": ["batches.actor"], "options": {"batch_size": 4},
                      "poll_timeout_s": 0.2},
        })
    producer = RecordProducer(kafka_config)
    producer.produce(topo.full_name("weights.actor"), manifest("actor", 5), key="actor")
    producer.flush()
    fresh = [group(f"fresh{i}", seq("actor", [-1, 4, 5])) for i in range(8)]
    stale = [group(f"stale{i}", seq("actor", [-1, 3, 5])) for i in range(3)]
    for g in fresh + stale:
        producer.produce(topo.full_name("trajectories.raw"), g, key=g.group_id)
    producer.flush()
    runtimes = [ProcessorRuntime(topo, name, instance="t") for name in ("stale", "route", "batch")]
    threads = [run_in_thread(rt) for rt in runtimes]
    try:
        wait_for(lambda: len(read_all(kafka_config, topo.full_name("batches.actor"),
                                      idle_s=0.5)) == 2, 60, "two batches")
    finally:
        for rt in runtimes:
            rt.stop()
        for t in threads:
            t.join(30)
    batches = [r.record for r in read_all(kafka_config, topo.full_name("batches.actor"),
                                          expect=Batch)]
    ids = Counter(g.group_id for b in batches for g in b.groups)
    assert ids == Counter(f"fresh{i}/actor" for i in range(8))
    assert runtimes[0].processor.dropped == 3


def test_batcher_restart_redelivers_held_groups_exactly_once(kafka_config, make_topology):
    topo, _ = make_topology(
        topics={"samples.actor": {"partitions": 2}, "batches.actor": {"partitions": 1}},
        processors={"batch": {"kind": "batcher", "inputs": ["samples.actor"],
                              "outputs": ["batches.actor"], "options": {"batch_size": 4},
                              "poll_timeout_s": 0.2}})
    src, dst = topo.full_name("samples.actor"), topo.full_name("batches.actor")
    producer = RecordProducer(kafka_config)
    for i in range(10):
        producer.produce(src, group(f"g{i}", seq("actor", [-1, 0])), key=f"g{i}")
    producer.flush()
    rt = ProcessorRuntime(topo, "batch", instance="a")
    t = run_in_thread(rt)
    wait_for(lambda: len(read_all(kafka_config, dst, idle_s=0.5)) == 2, 60, "two batches")
    wait_for(lambda: len(rt.processor.held) == 2, 10, "two held groups")
    rt.stop()
    t.join(30)
    # the two held groups were not committed: a new instance gets them again
    for i in range(10, 12):
        producer.produce(src, group(f"g{i}", seq("actor", [-1, 0])), key=f"g{i}")
    producer.flush()
    rt2 = ProcessorRuntime(topo, "batch", instance="b")
    t2 = run_in_thread(rt2)
    try:
        wait_for(lambda: len(read_all(kafka_config, dst, idle_s=0.5)) == 3, 60, "third batch")
    finally:
        rt2.stop()
        t2.join(30)
    batches = [r.record for r in read_all(kafka_config, dst, expect=Batch)]
    ids = Counter(g.group_id for b in batches for g in b.groups)
    assert ids == Counter(f"g{i}" for i in range(12))
