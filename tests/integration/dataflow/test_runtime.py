"""The processor runtime on a real broker: exactly-once, dead letters, pause/resume, SIGTERM."""

from __future__ import annotations

import signal
import threading
from collections import Counter

import pytest

from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.clients import RecordProducer, make_admin, read_all
from astraflow.kafka.lag import lag, total_lag
from astraflow.kafka.table import TopicReader
from astraflow.wire.records import Batch, ComponentStatus, DeadLetter, Task
from tests.conftest import wait_for
from tests.unit.dataflow.test_runtime import task


def passthrough_topology(make_topology, partitions: int = 3, max_batch: int = 100):
    return make_topology(
        topics={"tasks.source": {"partitions": partitions}, "tasks": {"partitions": partitions}},
        processors={"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                            "outputs": ["tasks"], "max_batch": max_batch,
                            "poll_timeout_s": 0.2}},
    )


def produce_tasks(kafka_config, topic: str, ids) -> None:
    producer = RecordProducer(kafka_config)
    for i in ids:
        producer.produce(topic, task(i), key=f"p{i}")
    producer.flush()


def committed_ids(kafka_config, topic: str) -> list[str]:
    return [r.record.task_id for r in read_all(kafka_config, topic, idle_s=1.0, expect=Task)]


class RuntimeThread:
    def __init__(self, runtime: ProcessorRuntime):
        self.runtime = runtime
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):
        try:
            self.runtime.run()
        except BaseException as e:  # surfaced by the test
            self.error = e

    def stop(self):
        self.runtime.stop()
        self.thread.join(30)
        assert not self.thread.is_alive(), "runtime did not stop"
        if self.error:
            raise self.error


@pytest.mark.slow
def test_exactly_once_when_processor_is_sigkilled_mid_stream(
    kafka_config, make_topology, astraflow_cli, tmp_path
):
    topo, path = passthrough_topology(make_topology, max_batch=50)
    src, dst = topo.full_name("tasks.source"), topo.full_name("tasks")
    n = 40000
    produce_tasks(kafka_config, src, range(n))

    log = tmp_path / "processor.log"
    proc = astraflow_cli("processor", "run", "fwd", "--topology", str(path), "--instance", "0",
                         log=log)
    group = topo.group_of("fwd")
    # the kill waits on the output as a read_committed stream: records a transaction has
    # committed, so the restart resumes mid-stream from offsets the processor committed
    seen = TopicReader(kafka_config, dst, Task, isolation="read_committed")
    committed = 0

    def some_transactions_committed() -> bool:
        nonlocal committed
        committed += len(seen.poll(0.05))
        return committed >= 2000

    try:
        wait_for(some_transactions_committed, 90, "the first committed transactions", step=0)
        proc.send_signal(signal.SIGKILL)
        killed = proc.wait(10)
    finally:
        seen.close()
    assert killed == -signal.SIGKILL, f"the processor ended with {killed}, not by the kill"
    at_kill = len(committed_ids(kafka_config, dst))
    assert at_kill < n, f"processor finished ({at_kill}/{n} committed) before it was " \
                        "killed; the test proves nothing"

    proc2 = astraflow_cli("processor", "run", "fwd", "--topology", str(path), "--instance", "0",
                          log=log)
    wait_for(lambda: total_lag(lag(kafka_config, group, [src])) == 0, 180,
             "the restarted processor to catch up")
    proc2.send_signal(signal.SIGTERM)
    assert proc2.wait(30) == 0

    ids = committed_ids(kafka_config, dst)
    counts = Counter(ids)
    duplicates = {k: c for k, c in counts.items() if c > 1}
    assert not duplicates, f"{len(duplicates)} records appear more than once"
    assert set(counts) == {f"t{i}" for i in range(n)}, "records were lost"
    # the uncommitted view holds every committed record and whatever the killed
    # transaction had sent before the kill (none when it landed between transactions):
    # the committed view hid exactly those
    uncommitted = len(read_all(kafka_config, dst, idle_s=1.0, isolation="read_uncommitted"))
    assert uncommitted >= n, f"the uncommitted view holds {uncommitted} of {n} records"
    assert len(ids) == n


def test_garbage_goes_to_dlq_and_processor_goes_on(kafka_config, make_topology):
    topo, _ = passthrough_topology(make_topology, partitions=1)
    src = topo.full_name("tasks.source")
    rt = RuntimeThread(ProcessorRuntime(topo, "fwd", instance="a"))
    producer = RecordProducer(kafka_config)
    producer.produce(src, task(1), key="p1")
    producer.produce_raw(src, b"definitely not avro", key="junk")
    producer.produce(src, Batch(policy="x", batch_id="b", groups=[]), key="wrong-type")
    producer.produce_raw(src, producer.codec.encode(task(2), src)[:-5], key="cut")
    # decodes, but makes no sense: dead-lettered by the first component that reads it
    producer.produce(src, Task(task_id="", prompt_id="p9", workflow="single_turn",
                               payload="{}", source="test"), key="senseless")
    producer.produce(src, task(3), key="p3")
    producer.flush()
    try:
        wait_for(lambda: len(committed_ids(kafka_config, topo.full_name("tasks"))) == 2, 60,
                 "the two valid records")
        dead = read_all(kafka_config, topo.full_name("dlq"), expect=DeadLetter)
        by_key = {r.key: r.record for r in dead}
        assert set(by_key) == {b"junk", b"wrong-type", b"cut", b"senseless"}
        assert "InvalidRecord: Task: a task needs a task_id" in by_key[b"senseless"].error
        assert "SchemaMismatchError" in by_key[b"junk"].error
        assert "expected astraflow.Task" in by_key[b"wrong-type"].error
        assert "TruncatedRecordError" in by_key[b"cut"].error
        assert by_key[b"junk"].raw == b"definitely not avro"
        assert by_key[b"junk"].source_topic == src and by_key[b"junk"].offset == 1
        assert by_key[b"junk"].component_id == "fwd/a"
        # still alive: a later record goes through
        produce_tasks(kafka_config, src, [4])
        wait_for(lambda: len(committed_ids(kafka_config, topo.full_name("tasks"))) == 3, 30,
                 "a record after the garbage")
        assert rt.runtime.counters.dead_lettered == 4
        statuses = read_all(kafka_config, topo.full_name("status"), expect=ComponentStatus)
        assert statuses and statuses[-1].record.component_id == "fwd/a"
    finally:
        rt.stop()
    assert sorted(committed_ids(kafka_config, topo.full_name("tasks"))) == ["t1", "t3", "t4"]


def test_pause_and_resume(kafka_config, make_topology):
    topo, _ = passthrough_topology(make_topology, partitions=2)
    src, dst = topo.full_name("tasks.source"), topo.full_name("tasks")
    rt = RuntimeThread(ProcessorRuntime(topo, "fwd", instance="p"))
    try:
        produce_tasks(kafka_config, src, range(4))
        wait_for(lambda: len(committed_ids(kafka_config, dst)) == 4, 60, "records to flow")
        rt.runtime.pause("tasks.source")
        wait_for(lambda: rt.runtime.paused_topics == {"tasks.source": None}, 10, "pause")
        c = rt.runtime.counters
        # one whole empty round after the pause: nothing was in flight when records came
        waited = c.waiting_s
        wait_for(lambda: c.waiting_s > waited, 10, "an empty consume round while paused")
        consumed = c.consumed
        produce_tasks(kafka_config, src, range(4, 14))
        # the loop goes on polling (3 s of empty rounds) with ten records there to fetch
        waited = c.waiting_s
        wait_for(lambda: c.waiting_s >= waited + 3.0, 30, "3 s of empty rounds while paused")
        assert c.consumed == consumed
        assert len(committed_ids(kafka_config, dst)) == 4
        assert total_lag(lag(kafka_config, topo.group_of("fwd"), [src])) == 10
        assert rt.runtime.status().state == "paused"
        rt.runtime.resume("tasks.source", [0])
        rt.runtime.resume("tasks.source", [1])
        wait_for(lambda: len(committed_ids(kafka_config, dst)) == 14, 60, "resumed flow")
        assert rt.runtime.status().state == "running"
    finally:
        rt.stop()


def test_sigterm_finishes_and_leaves_the_group(kafka_config, make_topology, astraflow_cli):
    topo, path = passthrough_topology(make_topology)
    src, dst = topo.full_name("tasks.source"), topo.full_name("tasks")
    produce_tasks(kafka_config, src, range(50))
    proc = astraflow_cli("processor", "run", "fwd", "--topology", str(path), "--instance", "t")
    wait_for(lambda: len(committed_ids(kafka_config, dst)) == 50, 60, "records to flow")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    admin = make_admin(kafka_config)
    group = topo.group_of("fwd")
    desc = admin.describe_consumer_groups([group])[group].result()
    assert len(desc.members) == 0, "the processor did not leave its consumer group"
    assert total_lag(lag(kafka_config, group, [src])) == 0


@pytest.mark.kafka
def test_an_output_over_its_topics_max_message_bytes_is_dead_lettered(kafka_config,
                                                                      make_topology):
    """A 3 MB task for an output topic that takes 1 MiB goes to dlq with the reason and its
    bytes; the records around it go through and the processor keeps running."""
    topo, _ = make_topology(
        topics={"tasks.source": {"partitions": 1},
                "tasks": {"partitions": 1, "max_message_bytes": 1_048_576}},
        processors={"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                            "outputs": ["tasks"], "poll_timeout_s": 0.2}})
    src, dst, dlq = (topo.full_name(t) for t in ("tasks.source", "tasks", "dlq"))
    big = Task(task_id="big", prompt_id="p", workflow="single_turn", payload="x" * 3_000_000,
               source="test")
    producer = RecordProducer(kafka_config, **{"message.max.bytes": 8_000_000})
    for i in range(3):
        producer.produce(src, task(i), key="p")
    producer.produce(src, big, key="p")
    for i in range(3, 6):
        producer.produce(src, task(i), key="p")
    producer.flush()
    rt = RuntimeThread(ProcessorRuntime(topo, "fwd", instance="0", config=kafka_config))
    try:
        wait_for(lambda: len(committed_ids(kafka_config, dst)) == 6, 60, "the small tasks")
        dead = [r.record for r in read_all(kafka_config, dlq, expect=DeadLetter)]
        assert len(dead) == 1 and dead[0].offset == 3 and len(dead[0].raw) > 3_000_000
        assert "RecordTooLarge" in dead[0].error and "accepts at most 1048576" in dead[0].error
        assert committed_ids(kafka_config, dst) == [f"t{i}" for i in range(6)]
        assert rt.thread.is_alive()
    finally:
        rt.stop()


@pytest.mark.slow
def test_exactly_once_while_instances_join_and_leave_mid_stream(kafka_config, make_topology):
    """Transactions stay open across polls and commit while the next records are made: a
    rebalance in the middle drops what is open and waits for the commit in flight, so that
    each input is committed once with its output however the partitions move."""
    topo, _ = passthrough_topology(make_topology, partitions=4, max_batch=2000)
    src, dst = topo.full_name("tasks.source"), topo.full_name("tasks")
    group = topo.group_of("fwd")
    done = threading.Event()
    sent = []

    def produce() -> None:  # small flushed chunks: records keep coming during rebalances
        producer = RecordProducer(kafka_config)
        while not done.is_set():
            for i in range(len(sent), len(sent) + 50):
                producer.produce(src, task(i), key=f"p{i}")
                sent.append(i)
            producer.flush()

    feeder = threading.Thread(target=produce, daemon=True)
    a = RuntimeThread(ProcessorRuntime(topo, "fwd", instance="a", config=kafka_config))
    feeder.start()
    b = None
    try:
        wait_for(lambda: a.runtime.counters.transactions >= 5, 60, "a's first transactions")
        b = RuntimeThread(ProcessorRuntime(topo, "fwd", instance="b", config=kafka_config))
        wait_for(lambda: b.runtime.counters.produced > 0, 60, "b taking partitions over")
        a.stop()
        moved = b.runtime.counters.consumed
        wait_for(lambda: b.runtime.counters.consumed > moved + 1000, 60, "b after a left")
        done.set()
        feeder.join(30)
        wait_for(lambda: total_lag(lag(kafka_config, group, [src])) == 0, 90, "lag 0")
    finally:
        done.set()
        if b is not None:
            b.stop()
        if a.thread.is_alive():
            a.stop()
    ids = committed_ids(kafka_config, dst)
    assert Counter(ids) == Counter(f"t{i}" for i in sent)
