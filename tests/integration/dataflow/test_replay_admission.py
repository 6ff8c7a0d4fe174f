"""Admission and replay on a real broker.

1. With the RaaS pool stalled, the tasks in flight for it (records on ``tasks`` past its
   group's committed offset) never exceed the admission bound while the feeder keeps
   producing; each task the pool commits frees one place, which admission fills with one
   task, and nothing is lost or duplicated. (How soon it does is measured by
   ``bench/backpressure.py``, not asserted.)
2. A trainer behind on ``batches.<policy>`` holds admission until it catches up.
3. Replayed groups never violate the staleness bound, checked from what was published:
   the batches topic against the manifests on the weights topic.
4. The lag observer counts the groups on their way to a batcher and the batches that are
   still to become versions past the newest published one, and the tasks past a pool
   offset left from a deleted topic.
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter

import pytest
from confluent_kafka import Consumer, KafkaError, TopicPartition

from astraflow.dataflow.admission import LagObserver, transit_inputs
from astraflow.dataflow.base import ProcessorContext
from astraflow.dataflow.batcher import Batcher, BatcherOptions
from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.dataflow.versions import LatestVersions
from astraflow.kafka.clients import RecordProducer, make_codec_for, read_all
from astraflow.kafka.lag import LagReader, total_lag
from astraflow.kafka.table import TopicReader
from astraflow.wire.records import Batch, ComponentStatus, PartitionOffset, Task, WeightManifest
from tests.conftest import random_name, wait_for
from tests.integration.dataflow.test_processors import manifest, run_in_thread
from tests.unit.dataflow.test_processors import group, seq


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", prompt_id=f"p{i}", workflow="single_turn", payload="{}",
                source="test")


class Feeder:
    """Produces tasks to ``tasks.source`` at a fixed rate until stopped."""

    def __init__(self, config, topic: str, rate: float):
        self.producer = RecordProducer(config)
        self.topic, self.period = topic, 1.0 / rate
        self.sent = 0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.producer.produce(self.topic, task(self.sent), key=f"p{self.sent}")
            self.producer.flush()
            self.sent += 1
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(10)


class Follower:
    """Reads a topic without a group (read_committed): the data records and their offsets."""

    def __init__(self, config, topic: str, partitions: int):
        self.consumer = Consumer(config.consumer_conf("test-follower",
                                                      **{"enable.auto.commit": False}))
        self.consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        self.records: list[tuple[int, int, bytes]] = []  # partition, offset, key

    def drain(self, timeout: float = 0.0) -> int:
        for m in self.consumer.consume(1000, timeout):
            if m.error() is None:
                self.records.append((m.partition(), m.offset(), m.key()))
            elif m.error().code() != KafkaError._PARTITION_EOF:
                raise AssertionError(m.error())
        return len(self.records)

    def past(self, committed: dict[int, int]) -> int:
        return sum(1 for p, o, _ in self.records if o >= committed.get(p, 0))

    def close(self) -> None:
        self.consumer.close()


class FakePool:
    """Stands in for a RaaS pool: consumes ``tasks`` in the pool's group, "rolls out" a task
    for ``rollout_s`` and commits it. ``intended`` is updated before each commit, so a check
    that uses it can only under-count what is in flight, never over-count."""

    def __init__(self, config, topic: str, group_id: str, partitions: int):
        self.consumer = Consumer(config.consumer_conf(group_id, **{"enable.auto.commit": False}))
        self.topic = topic
        self.consumer.assign([TopicPartition(topic, p, -2) for p in range(partitions)])  # earliest
        self.intended: dict[int, int] = {}
        self.done = 0
        self.commit_times: list[float] = []

    def step(self, rollout_s: float = 0.0, timeout: float = 0.2) -> bool:
        m = self.consumer.poll(timeout)
        if m is None or m.error():
            return False
        time.sleep(rollout_s)
        self.intended[m.partition()] = m.offset() + 1
        self.consumer.commit(offsets=[TopicPartition(self.topic, m.partition(), m.offset() + 1)],
                             asynchronous=False)
        self.commit_times.append(time.monotonic())
        self.done += 1
        return True

    def close(self) -> None:
        self.consumer.close()


@pytest.mark.slow  # about 30 s: the pool stalls, works, stalls again
def test_admission_bounds_tasks_in_flight_while_the_pool_is_stalled(kafka_config,
                                                                    make_topology):
    topo, _ = make_topology(
        topics={"tasks.source": {"partitions": 3}, "tasks": {"partitions": 3},
                "batches.actor": {"partitions": 1}},
        processors={"admit": {"kind": "admission", "inputs": ["tasks.source"],
                              "outputs": ["tasks"], "poll_timeout_s": 0.2,
                              "options": {"policies": ["actor"], "poll_interval_s": 0.5,
                                          "max_held": 40, "max_pool_lag": 6}}},
        pools={"local": {"nodes": 3, "n_samples": 4}},
    )
    bound = 6  # fixed here (the measured target moves with the pool's throughput)
    tasks = topo.full_name("tasks")
    rt = ProcessorRuntime(topo, "admit", instance="a")
    thread = run_in_thread(rt)
    feeder = Feeder(kafka_config, topo.full_name("tasks.source"), rate=10)
    follower = Follower(kafka_config, tasks, 3)
    pool = FakePool(kafka_config, tasks, topo.raas_group("local"), 3)
    lags = LagReader(kafka_config)
    seen_in_flight: list[int] = []

    def in_flight() -> int:
        follower.drain()  # what was admitted up to now, then the (newer) commits
        n = follower.past(dict(pool.intended))
        seen_in_flight.append(n)
        assert n <= bound, f"{n} tasks in flight for the pool, bound {bound}"
        return n

    def watch(fed: int) -> None:
        """Check the bound at every step while the feeder produces ``fed`` more tasks."""
        target = feeder.sent + fed
        wait_for(lambda: in_flight() >= 0 and feeder.sent >= target, 30,
                 f"the feeder to produce {fed} more tasks", step=0.05)

    try:
        # A. the pool takes nothing: admission fills it up to the bound and holds the rest
        wait_for(lambda: in_flight() == bound, 30, "the pool to be filled up to its bound",
                 step=0.05)
        watch(40)
        assert in_flight() == bound
        status = rt.status()
        assert status.state == "holding", status
        m = status.metrics
        assert m["admission/bound_pool"] == bound and m["admission/pool_lag"] == bound
        assert m["admission/held"] > 0 and m["admission/trainer_lag"] == 0
        # offset lag also counts the transaction markers: the record count is what is bounded
        assert m["admission/pool_offset_lag"] >= bound
        # beyond max_held the processor pauses its input: the rest waits on tasks.source
        wait_for(lambda: rt.paused_topics == {"tasks.source": None}, 20, "input paused")
        assert rt.status().metrics["admission/input_paused"] == 1

        # B. each task the pool commits frees one place: admission fills it with exactly
        # one more task, and the pool is back at its bound
        for _ in range(5):
            before = follower.drain()
            assert pool.step(timeout=5.0)
            wait_for(lambda n=before: follower.drain(0.02) > n, 60, "a task admitted",
                     step=0.0)
            watch(3)  # the feeder goes on meanwhile: no second task follows
            assert follower.drain() == before + 1 and in_flight() == bound

        # C. the pool works (0.1 s per task): tasks flow, never beyond the bound
        done_before = pool.done
        wait_for(lambda: (pool.step(rollout_s=0.1, timeout=0.1) or True) and in_flight() >= 0
                 and pool.done - done_before >= 20, 30, "feeding to resume: 20 tasks rolled out",
                 step=0.0)
        assert rt.status().state in ("holding", "admitting")
        # the pool's commits are measured as its throughput (the target's input)
        wait_for(lambda: rt.status().metrics.get("admission/throughput/local", 0) > 0, 10,
                 "the pool's throughput measured from its commits")

        # D. stalled again: the bound holds while the feeder goes on
        watch(30)
        assert in_flight() == bound and rt.status().state == "holding"
        assert max(seen_in_flight) == bound

        # E. the feeder stops, the pool drains everything: each task exactly once
        feeder.stop()
        wait_for(lambda: (pool.step(timeout=0.05) or True) and
                 follower.drain() == feeder.sent and pool.done == feeder.sent, 120,
                 "every task through admission and the pool", step=0.0)
        wait_for(lambda: total_lag(lags.lag(topo.group_of("admit"),
                                            [topo.full_name("tasks.source")])) <= 3,
                 20, "admission to commit its input")  # at most one marker per partition
        keys = Counter(k for _, _, k in follower.records)
        assert keys == Counter(f"p{i}".encode() for i in range(feeder.sent))
        assert not rt.processor.held and rt.paused_topics == {}
    finally:
        feeder.stop()
        rt.stop()
        thread.join(30)
        follower.close()
        pool.close()
        lags.close()
    # tasks went to the least loaded partitions: every partition got some
    assert {p for p, _, _ in follower.records} == {0, 1, 2}


def test_admission_holds_while_the_trainer_is_behind(kafka_config, make_topology):
    topo, _ = make_topology(
        topics={"tasks.source": {"partitions": 1}, "tasks": {"partitions": 1},
                "batches.actor": {"partitions": 1}},
        processors={"admit": {"kind": "admission", "inputs": ["tasks.source"],
                              "outputs": ["tasks"], "poll_timeout_s": 0.2,
                              "options": {"policies": ["actor"], "max_trainer_lag": 1,
                                          "max_pool_lag": 100}}},
    )
    producer = RecordProducer(kafka_config)
    batches = topo.full_name("batches.actor")
    for i in range(3):
        producer.produce(batches, Batch(policy="actor", batch_id=f"b{i}", groups=[]),
                         key="actor")
    producer.flush()
    rt = ProcessorRuntime(topo, "admit", instance="a")
    thread = run_in_thread(rt)
    tasks = topo.full_name("tasks")
    try:
        for i in range(5):
            producer.produce(topo.full_name("tasks.source"), task(i), key=f"p{i}")
        producer.flush()
        wait_for(lambda: rt.status().metrics.get("admission/held") == 5, 20, "tasks held")
        reads = [rt.processor.last]  # each lag read is a new observation

        def two_more_reads_holding_all_five() -> bool:
            assert len(rt.processor.held) == 5, "a task was admitted with the trainer behind"
            if rt.processor.last is not reads[-1]:
                reads.append(rt.processor.last)
            return len(reads) > 2

        wait_for(two_more_reads_holding_all_five, 10, "two more lag reads", step=0.05)
        st = rt.status()
        assert st.state == "holding" and st.metrics["admission/trainer_lag"] == 3
        assert st.metrics["admission/bound_trainer"] == 1
        assert read_all(kafka_config, tasks, idle_s=0.5) == []
        # the trainer consumes two batches: one left, within the bound
        trainer = Consumer(kafka_config.consumer_conf(f"{topo.run}.trainer.actor"))
        trainer.commit(offsets=[TopicPartition(batches, 0, 2)], asynchronous=False)
        trainer.close()
        wait_for(lambda: len(read_all(kafka_config, tasks, idle_s=0.2)) == 5, 60,
                 "tasks admitted once the trainer caught up", step=0.05)
        assert rt.status().state == "admitting"
    finally:
        rt.stop()
        thread.join(30)


def test_replayed_groups_never_violate_the_staleness_bound(kafka_config, make_topology):
    max_staleness = 1
    topo, _ = make_topology(
        topics={"samples.actor": {"partitions": 1}, "batches.actor": {"partitions": 1},
                "weights.actor": {"partitions": 1}},
        processors={"batch": {
            "kind": "batcher", "inputs": ["samples.actor"], "outputs": ["batches.actor"],
            "poll_timeout_s": 0.2,
            "options": {"policy": "actor", "batch_size": 4, "max_staleness": max_staleness,
                        "replay_ratio": 0.5, "replay_capacity": 16,
                        "replay_selection": "uniform", "replay_seed": 7}}})
    producer = RecordProducer(kafka_config)
    weights, samples = topo.full_name("weights.actor"), topo.full_name("samples.actor")
    rt = ProcessorRuntime(topo, "batch", instance="r")
    thread = run_in_thread(rt)
    per_phase, phases = 6, 6
    # a phase is done once each of its groups is in a committed batch or still held: the
    # next manifest may not be produced earlier, or a batch the batcher seals before it sees
    # that manifest would carry a timestamp after it (the runtime counts a record consumed
    # before the batcher has handled it, so the consumed count alone does not tell)
    out = TopicReader(kafka_config, topo.full_name("batches.actor"), Batch)
    fresh_out = 0

    def all_handled(n: int) -> bool:
        nonlocal fresh_out
        fresh_out += sum(len(e.value.groups) - e.value.replayed for e in out.poll(0.05))
        return fresh_out + len(rt.processor.held) == n and len(rt.processor.held) < 2

    try:
        wait_for(lambda: rt.running.is_set(), 30, "the batcher to start")
        for v in range(phases):
            producer.produce(weights, manifest("actor", v), key="actor")
            producer.flush()
            if v > 0:  # the batcher sees version v before the groups generated with it
                wait_for(lambda v=v: rt.processor.versions.latest("actor") == v, 20,
                         f"the batcher to see version {v}")
            for i in range(per_phase):
                gid = f"v{v}-{i}"
                g = group(gid, seq("actor", [-1, v, v], float(i % 2)),
                          seq("actor", [-1, v], float(i % 3 == 0)))
                producer.produce(samples, g, key=gid)
            producer.flush()
            wait_for(lambda v=v: all_handled(per_phase * (v + 1)), 30, f"phase {v} batched",
                     step=0)
        metrics = rt.processor.metrics()
    finally:
        out.close()
        rt.stop()
        thread.join(30)

    manifests = [(r.timestamp_ms, r.record.version)
                 for r in read_all(kafka_config, weights, expect=WeightManifest)]
    batches = [r.record for r in read_all(kafka_config, topo.full_name("batches.actor"),
                                          expect=Batch)]

    def latest_at(ms: int) -> int:
        return max(v for t, v in manifests if t <= ms)

    replayed_at_edge = 0
    fresh_ids: list[str] = []
    for b in batches:
        latest = latest_at(b.created_at_ms)
        n_fresh = len(b.groups) - b.replayed
        fresh_ids += [g.group_id for g in b.groups[:n_fresh]]
        assert sum(r.end - r.start for r in b.source_offsets) == n_fresh  # replays excluded
        for g in b.groups:
            oldest = min(s.min_version for s in g.sequences)
            assert latest - oldest <= max_staleness, (
                f"batch {b.batch_id} at v{latest} holds {g.group_id} from v{oldest}")
        for g in b.groups[n_fresh:]:
            assert g.meta.get("replay_uses")
            replayed_at_edge += latest - min(s.min_version for s in g.sequences) == max_staleness
    assert sum(b.replayed for b in batches) == metrics["batcher/replayed"] > 10
    assert replayed_at_edge > 0, "no replay was exactly max_staleness old: the edge is untested"
    assert metrics["batcher/replay_evicted_stale"] > 0
    assert len(fresh_ids) == len(set(fresh_ids))  # each fresh group served fresh once
    print(f"{len(batches)} batches, {metrics['batcher/replayed']:.0f} replayed groups "
          f"({replayed_at_edge} exactly {max_staleness} version old), "
          f"{metrics['batcher/replay_evicted_stale']:.0f} evicted stale")

    # a restarted batcher rebuilds its replay buffer from the batches it produced
    b2 = Batcher("batch", ["samples.actor"], ["batches.actor"],
                 BatcherOptions(policy="actor", batch_size=4, replay_ratio=0.5,
                                replay_capacity=16))
    b2.open(ProcessorContext(topo, kafka_config, make_codec_for(kafka_config), "batch/x"))
    try:
        assert len(b2.replay) == 16
        assert all("replay_uses" not in e.group.meta for e in b2.replay.entries)
        assert {e.group.group_id for e in b2.replay.entries} <= set(fresh_ids)
    finally:
        b2.close()


def test_admission_runs_standalone_from_the_cli(kafka_config, make_topology, astraflow_cli):
    topo, path = make_topology(
        topics={"tasks.source": {"partitions": 2}, "tasks": {"partitions": 2}},
        processors={"admit": {"kind": "admission", "inputs": ["tasks.source"],
                              "outputs": ["tasks"], "poll_timeout_s": 0.2,
                              "options": {"max_pool_lag": 10}}},
    )
    producer = RecordProducer(kafka_config)
    for i in range(15):
        producer.produce(topo.full_name("tasks.source"), task(i), key=f"p{i}")
    producer.flush()
    proc = astraflow_cli("processor", "run", "admit", "--topology", str(path), "--instance", "c")
    tasks = topo.full_name("tasks")
    wait_for(lambda: len(read_all(kafka_config, tasks, idle_s=0.3)) == 10, 60,
             "ten tasks admitted (the pool bound)")

    def two_holding_statuses() -> list | None:  # published 1 s apart, each after a lag read
        statuses = [r.record for r in read_all(kafka_config, topo.full_name("status"),
                                               expect=ComponentStatus, idle_s=0.3)]
        holding = [s for s in statuses if s.component_id == "admit/c" and s.state == "holding"
                   and s.metrics.get("admission/held") == 5]
        return statuses if len(holding) >= 2 else None

    statuses = wait_for(two_holding_statuses, 30, "two statuses of admit/c holding five tasks")
    assert len(read_all(kafka_config, tasks, idle_s=0.3)) == 10  # the pool took none
    last = statuses[-1]
    assert last.component_id == "admit/c" and last.state == "holding"
    assert last.metrics["admission/pool_lag"] == 10 and last.metrics["admission/held"] == 5
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0


@pytest.mark.slow
def test_admission_in_front_of_a_real_raas_node(kafka_config, kafka_bootstrap, make_topology,
                                                tmp_path):
    """The group naming end to end: a real node of pool ``local`` commits its tasks in the
    run's RaaS group, and admission keeps no more in flight than its target (2, 1 node x 1
    task x 2, until the node's throughput is measured)."""
    from tests.integration.raas.test_raas import start_node
    from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer

    model_dir = tmp_path / "model"
    tiny_model().save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)
    topo, path = make_topology(
        topics={"tasks.source": {"partitions": 2}, "tasks": {"partitions": 2},
                "trajectories.raw": {"partitions": 1}},
        processors={"admit": {"kind": "admission", "inputs": ["tasks.source"],
                              "outputs": ["tasks"], "poll_timeout_s": 0.2}},
        pools={"local": {"nodes": 1, "n_samples": 2}},
    )
    n = 12
    producer = RecordProducer(kafka_config)
    for i in range(n):
        t = Task(task_id=f"t{i}", prompt_id=f"p{i}", workflow="single_turn",
                 payload=json.dumps({"prompt": f"{i}+1=", "answer": str(i + 1)}),
                 source="test", policies=["actor"])
        producer.produce(topo.full_name("tasks.source"), t, key=f"p{i}")
    producer.flush()
    rt = ProcessorRuntime(topo, "admit", instance="a")
    thread = run_in_thread(rt)
    tasks = topo.full_name("tasks")
    follower = Follower(kafka_config, tasks, 2)
    lags = LagReader(kafka_config)
    log = tmp_path / "node.log"
    node = start_node(kafka_bootstrap, path, model_dir, "n0", log, "--pool", "local",
                      "--no-follow-weights", "--workflow-options",
                      'single_turn={"max_new_tokens": 4, "env_latency": 0.3}')
    out = topo.full_name("trajectories.raw")
    peak, bound = 0, 2

    def all_rolled_out_within_the_bound() -> bool:
        nonlocal peak, bound
        # the target starts at 2 and follows the node's measured throughput: the most it
        # has been so far bounds what is in flight now
        bound = max([bound, *rt.processor.peak_bounds.values()])
        follower.drain()  # admitted so far; the commits read after can only be newer
        committed = {r.partition: (r.committed or 0)
                     for r in lags.lag(topo.raas_group("local"), [tasks])}
        in_flight = follower.past(committed)
        peak = max(peak, in_flight)
        assert in_flight <= bound, f"{in_flight} tasks in flight, target at most {bound}"
        if len(read_all(kafka_config, out, idle_s=0.1)) == n:
            return True
        assert node.poll() is None, log.read_text()[-2000:]
        return False

    try:
        wait_for(all_rolled_out_within_the_bound, 120, f"all {n} tasks rolled out", step=0.1)
        groups = [r.record for r in read_all(kafka_config, out, idle_s=0.3)]
        assert sorted(g.task_id for g in groups) == sorted(f"t{i}" for i in range(n))
        assert 2 <= peak <= bound
    finally:
        node.send_signal(signal.SIGTERM)
        node.wait(30)
        rt.stop()
        thread.join(30)
        follower.close()
        lags.close()


def test_the_observer_counts_groups_on_their_way_and_batches_not_yet_published(
        kafka_config, make_topology):
    """Groups past the committed offsets of the processors between the nodes and the
    batcher count in records (transaction markers left out), and a trainer's batches
    count from where its newest published version had consumed when that is behind its
    commits (a trainer that writes a version while it trains the next batch)."""
    one = {"partitions": 1}
    topo, _ = make_topology(
        topics={"tasks": one, "trajectories.raw": one, "trajectories": one,
                "samples.actor": one, "batches.actor": one, "weights.actor": one},
        processors={
            "staleness": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
                          "outputs": ["trajectories"]},
            "router": {"kind": "router", "inputs": ["trajectories"],
                       "outputs": ["samples.actor"]},
            "batcher": {"kind": "batcher", "inputs": ["samples.actor"],
                        "outputs": ["batches.actor"], "options": {"batch_size": 4}}})
    full = topo.full_name
    producer = RecordProducer(kafka_config, transactional_id=random_name("tx"))
    for topic, n in (("trajectories.raw", 5), ("samples.actor", 2), ("batches.actor", 3)):
        producer.begin()  # one transaction each: a marker after the records
        for i in range(n):
            record = (Batch(policy="actor", batch_id=f"b{i}", groups=[])
                      if topic == "batches.actor" else group(f"{topic}-{i}"))
            producer.produce(full(topic), record, key=f"k{i}")
        producer.commit()

    def commit(group_id: str, topic: str, offset: int) -> None:
        c = Consumer(kafka_config.consumer_conf(group_id))
        c.commit(offsets=[TopicPartition(full(topic), 0, offset)], asynchronous=False)
        c.close()

    commit(topo.group_of("staleness"), "trajectories.raw", 2)  # 3 left on the way
    commit(topo.trainer_group("actor"), "batches.actor", 2)  # b2 being trained
    transit = {"actor": [(full(t), g) for t, g in transit_inputs(topo, "actor")]}
    trainers = {"actor": (full("batches.actor"), topo.trainer_group("actor"))}
    versions = LatestVersions(kafka_config, make_codec_for(kafka_config),
                              {"actor": full("weights.actor")})
    observer = LagObserver(kafka_config, full("tasks"), {"local": topo.raas_group("local")},
                           trainers, transit, versions)
    try:
        # until its side readers have read a range, it counts the range in full (markers
        # too): an upper bound, then exact
        first = observer.observe()
        assert first.trainer_transit["actor"] >= 3 + 2 and first.trainer_lag["actor"] >= 1
        wait_for(lambda: observer.observe().trainer_transit == {"actor": 3 + 2}, 20,
                 "the groups on their way counted exactly")
        # nothing published consumed anything yet: the batches past the trainer's commit
        wait_for(lambda: observer.observe().trainer_lag == {"actor": 1}, 20,
                 "the batches past the trainer's commit counted exactly")
        published = manifest("actor", 7)
        published.consumed_offsets = [PartitionOffset(full("batches.actor"), 0, 1)]
        producer.begin()
        producer.produce(full("weights.actor"), published, key="actor")
        producer.commit()
        # b1 was committed before version 7 (made from b0) became visible: it still
        # becomes a version after 7
        wait_for(lambda: observer.observe().trainer_lag == {"actor": 2}, 20,
                 "the batches past version 7's offsets counted")
        # b2 skipped as well (every group stale): of the batches committed past version
        # 7's offsets only the last may still become a version; b1 never will
        commit(topo.trainer_group("actor"), "batches.actor", 3)
        wait_for(lambda: observer.observe().trainer_lag == {"actor": 1}, 20,
                 "one batch committed past version 7's offsets counted, not the skipped")
        commit(topo.group_of("batcher"), "samples.actor", 1)  # one taken into a batch
        wait_for(lambda: observer.observe().trainer_transit == {"actor": 3 + 1}, 20,
                 "the batcher's commit counted")
    finally:
        observer.close()


def test_the_observer_counts_tasks_past_a_pool_offset_left_from_a_deleted_topic(
        kafka_config, make_topology):
    """A pool group whose committed offset lies past the end of ``tasks`` (kept while the
    topic was deleted and made again) resumes from the start: every task there is in
    flight. Counted as none, admission let 47 tasks through against a bound of 8."""
    topo, _ = make_topology(topics={"tasks": {"partitions": 1}})
    tasks = topo.full_name("tasks")
    producer = RecordProducer(kafka_config)
    for i in range(3):
        producer.produce(tasks, task(i), key=f"p{i}")
    producer.flush()
    pool = Consumer(kafka_config.consumer_conf(topo.raas_group("local")))
    pool.commit(offsets=[TopicPartition(tasks, 0, 1975)], asynchronous=False)
    pool.close()
    observer = LagObserver(kafka_config, tasks, {"local": topo.raas_group("local")}, {})
    try:
        wait_for(lambda: observer.observe().pool_in_flight == {"local": {0: 3}}, 20,
                 "the three tasks counted in flight")
    finally:
        observer.close()
