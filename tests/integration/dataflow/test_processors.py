"""Staleness filter, router and batcher on a broker: the processor chain, and a batcher
restarted with held groups delivering each exactly once (their decision logic without a
broker: ``tests/unit/dataflow/test_processors.py``)."""

from __future__ import annotations

import threading
from collections import Counter

from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.wire.records import Batch, WeightManifest
from tests.conftest import wait_for
from tests.unit.dataflow.test_processors import group, seq


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
