"""The transactional loop's decisions, without a broker: outage tracking, which errors wait
for the broker, checkpoints and their size limits."""

from __future__ import annotations

import logging

import pytest
from confluent_kafka import KafkaError

from astraflow.kafka import loop as loop_mod
from astraflow.kafka.loop import BrokerUnreachable, Checkpoint, Outage, RecordTooLarge, transient
from astraflow.kafka.membership import REWIND_TRIES
from astraflow.wire.codec import make_codec
from astraflow.wire.records import DeadLetter, Task
from tests.fakes import Msg


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(loop_mod.time, "monotonic", c)
    return c


def test_an_outage_logs_once_per_interval_and_gives_up_past_its_limit(clock, caplog):
    caplog.set_level(logging.WARNING, logger="astraflow.loop")
    o = Outage("p/0", "host:9092", limit_s=300, interval_s=10)
    for _ in range(50):  # 50 failures in the first 5 s: one line
        o.failed("Connection refused")
        clock.t += 0.1
    assert len(caplog.records) == 1 and "not answering" in caplog.records[0].message
    for _ in range(60):  # 60 s more, one failure a second: one line per 10 s
        clock.t += 1.0
        o.failed("Connection refused")
    assert len(caplog.records) == 1 + 6
    assert "not answering for 1" in caplog.records[1].message  # ~15 s
    o.ok()
    assert "answers again after 65" in caplog.records[-1].message and o.since is None
    assert o.recent()
    clock.t += 601
    assert not o.recent()

    for _ in range(30):  # a failure every 10 s for 300 s: within the limit
        o.failed("x")
        clock.t += 10
    clock.t += 1
    with pytest.raises(BrokerUnreachable, match=r"p/0: Kafka at host:9092 has not answered "
                       r"for 301s, over kafka.outage_limit_s=300"):
        o.failed("Connection refused")


def test_a_failure_after_a_quiet_spell_starts_a_new_outage(clock, caplog):
    """A stale "connection refused" just after the broker came back, and one more 290 s
    later (the broker answered meanwhile, with aborts during a long rebalance): two short
    outages, not one of 290 s."""
    caplog.set_level(logging.INFO, logger="astraflow.loop")
    o = Outage("p/0", "host:9092", limit_s=300, interval_s=10, quiet_s=60)
    o.failed("Connect to 127.0.0.1:9092 failed: Connection refused")
    clock.t += 290
    o.failed("GroupCoordinator: Connection refused")
    assert o.since == clock.t and o.longest_s == 0.0
    assert any("no failure for 290s" in r.message for r in caplog.records)
    clock.t += 15  # failures within the quiet spell: one outage
    o.failed("x")
    clock.t += 59
    o.failed("x")
    assert o.since == clock.t - 74
    for _ in range(22):  # failing on, every 10 s: the limit is measured from the start
        clock.t += 10
        o.failed("x")
    clock.t += 10
    with pytest.raises(BrokerUnreachable, match="has not answered for 304s"):
        o.failed("x")


def test_which_errors_wait_for_the_broker():
    assert transient(KafkaError(KafkaError._TRANSPORT))
    assert transient(KafkaError(KafkaError._ALL_BROKERS_DOWN))
    assert transient(KafkaError(KafkaError._TIMED_OUT))
    assert transient(KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS))
    assert transient(KafkaError(KafkaError.UNKNOWN, retriable=True))
    assert not transient(KafkaError(KafkaError.INVALID_CONFIG))
    assert not transient(KafkaError(KafkaError._FENCED))
    assert not transient(None)


def test_a_request_to_a_cluster_node_that_left_is_asked_again():
    """A node of a cluster shut down (a rolling restart) fails the requests in flight to it
    with _DESTROY_BROKER: the evaluator exited on it once (bench/cluster_faults.py, b).
    Asked again, such a request goes to the partition's new leader."""
    from astraflow.kafka.table import _retriable

    err = KafkaError(KafkaError._DESTROY_BROKER)
    assert not err.retriable()  # librdkafka does not say so itself
    assert transient(err) and _retriable(err)
    assert not transient(KafkaError(KafkaError._DESTROY))  # the client itself closing


def test_a_checkpoint_refuses_a_record_over_its_topics_limit():
    codec = make_codec()
    cp = Checkpoint(codec, "run.dlq", {"run.tasks": 2000, "run.dlq": 1500})
    small = Task(task_id="t", prompt_id="p", workflow="w", payload="{}", source="s")
    big = Task(task_id="t", prompt_id="p", workflow="w", payload="x" * 5000, source="s")
    cp.add("run.tasks", small, "p")
    mark = cp.mark()
    with pytest.raises(RecordTooLarge, match=r"a Task of \d+ bytes for run.tasks, which "
                       r"accepts at most 2000 \(max.message.bytes\)"):
        cp.add("run.tasks", big, "p")
    cp.add("run.other", big)  # no limit known for it
    cp.rollback(mark)
    assert (len(cp.records), cp.outputs, cp.dead) == (1, 1, 0)

    # a dead letter over the dlq's limit keeps its reason and drops the raw bytes
    letter = DeadLetter(source_topic="run.tasks", partition=0, offset=7, component_id="c",
                        error="RecordTooLarge: ...", raw=b"y" * 5000)
    cp.dead_letter(letter)
    assert cp.dead == 1 and letter.raw == b"" and "raw bytes dropped" in letter.error
    assert len(cp.records[-1][1]) < 1500


class StubProducer:
    """Stands in for a confluent-kafka Producer: records the calls the loop makes."""

    def __init__(self) -> None:
        self.producer = self
        self.errors: list = []
        self.calls: list[str] = []

    def abort_transaction(self, timeout: float) -> None:
        self.calls.append("abort")

    def purge(self) -> None:
        self.calls.append("purge")


class StubConsumer:
    def __init__(self, committed: dict[tuple[str, int], int]) -> None:
        self._committed = committed

    def committed(self, tps, timeout: float):
        from confluent_kafka import TopicPartition

        return [TopicPartition(t.topic, t.partition, self._committed[(t.topic, t.partition)])
                for t in tps]


def _loop(monkeypatch, committed=None):
    from astraflow.kafka.config import KafkaConfig
    from astraflow.kafka.loop import LoopSpec, RuntimeCounters, TransactionalLoop

    class Work:
        counters = RuntimeCounters()

    spec = LoopSpec(component_id="c/0", group="g", transactional_id="g.0", inputs=["in"],
                    outputs=["out"], dlq="dlq", status_topic="status")
    loop = TransactionalLoop(spec, Work(), KafkaConfig(bootstrap_servers="x:1"), make_codec())
    loop.txn.producer = StubProducer()
    made: list[StubProducer] = []
    monkeypatch.setattr(loop.txn, "_new_producer", lambda: made.append(StubProducer()) or made[-1])
    loop.member.consumer = StubConsumer(committed or {})
    return loop, made


def _exc(code, **flags):
    from confluent_kafka import KafkaException

    return KafkaException(KafkaError(code, **flags))


def test_a_failed_transaction_is_aborted_or_its_producer_replaced(monkeypatch):
    from confluent_kafka import TopicPartition

    tps = [TopicPartition("in", 0, 42)]
    # the broker answered "abort" (a rebalance meanwhile): abort on the same producer
    loop, made = _loop(monkeypatch)
    first = loop.producer
    loop.outage.failed("1/1 brokers are down")  # a stale report from before: it answered
    e = _exc(KafkaError.ILLEGAL_GENERATION, txn_requires_abort=True)
    assert loop.txn.failed(e, "sending offsets", tps) is False
    assert first.calls == ["abort"] and not made and loop.outage.since is None

    # the broker went away mid-transaction: a new producer (it aborts the old epoch's
    # transaction), the old one's records purged
    loop, made = _loop(monkeypatch)
    first = loop.producer
    assert loop.txn.failed(_exc(KafkaError._TRANSPORT), "sending offsets", tps) is False
    assert first.calls == ["purge"] and loop.producer is made[0]

    # the answer to the commit was lost: the group's offsets say whether it went through
    loop, made = _loop(monkeypatch, committed={("in", 0): 42})
    assert loop.txn.failed(_exc(KafkaError._TIMED_OUT, retriable=True), "committing", tps)
    loop, made = _loop(monkeypatch, committed={("in", 0): 40})
    assert not loop.txn.failed(_exc(KafkaError._TIMED_OUT, retriable=True), "committing", tps)

    # fenced with no outage in sight: another copy with this transactional id
    loop, made = _loop(monkeypatch)
    with pytest.raises(RuntimeError, match="fatal producer error.*give each copy its own"):
        loop.txn.failed(_exc(KafkaError._FENCED, fatal=True), "committing", tps)
    # ... but right after an outage, a producer timed out by the coordinator is replaced
    loop.outage.failed("down")
    loop.outage.ok()
    assert loop.txn.failed(_exc(KafkaError._FENCED, fatal=True), "committing", []) is False
    assert len(made) == 1


def test_a_transactional_call_that_never_returns_is_given_up_and_its_producer_abandoned(
        monkeypatch):
    """librdkafka can block in send_offsets_to_transaction past its timeout when the broker
    goes away mid-call: the loop stops waiting, and replaces the producer without touching
    the stuck one."""
    import threading

    from confluent_kafka import KafkaException

    loop, made = _loop(monkeypatch)
    loop._call_timeout_s = 0.05
    release = threading.Event()
    with pytest.raises(KafkaException, match="no answer from the transactional call"):
        loop._retrying("committing", lambda: loop.txn.bounded(lambda: release.wait(5)))
    assert loop.txn.stuck
    stuck = loop.producer
    assert loop.txn.failed(_exc(KafkaError._TIMED_OUT, retriable=True), "sending offsets",
                        []) is False
    assert loop.producer is made[0] and stuck.calls == [] and loop.txn.abandoned == [stuck]
    assert not loop.txn.stuck
    release.set()
    assert loop.txn.bounded(lambda: 7) == 7


class ScriptedConsumer:
    """Hands out scripted polls (a list of messages, or a callable making one), then stops
    the loop; records seeks."""

    def __init__(self, loop, script: list) -> None:
        from confluent_kafka import TopicPartition

        self.loop, self.script, self.seeks = loop, list(script), []
        self.parts = [TopicPartition("in", 0), TopicPartition("in", 1)]

    def consume(self, n: int, timeout: float):
        if not self.script:
            self.loop.stop()
            return []
        step = self.script.pop(0)
        return step() if callable(step) else step

    def assignment(self):
        return list(self.parts)

    def pause(self, tps) -> None: ...

    def resume(self, tps) -> None: ...

    def committed(self, tps, timeout: float):
        return list(tps)  # offset -1001: nothing committed yet

    def seek(self, tp) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def consumer_group_metadata(self) -> object:
        return object()


class TxnProducer(StubProducer):
    """Records the transactional calls, and which records each commit carried."""

    def __init__(self) -> None:
        super().__init__()
        self.open: list[bytes] = []
        self.committed: list[list[bytes]] = []

    def begin_transaction(self) -> None:
        self.calls.append("begin")

    def produce(self, topic, value=None, key=None, partition=-1, *args) -> None:
        if not isinstance(value, (bytes, type(None))):  # RecordProducer.produce: a record
            value = b"status"
        self.open.append(value)

    def poll(self, timeout: float = 0) -> int:
        return 0

    def send_offsets_to_transaction(self, tps, meta, timeout: float) -> None:
        self.calls.append("offsets")

    def commit_transaction(self, timeout: float) -> None:
        self.calls.append("commit")
        self.committed.append(self.open)
        self.open = []

    def abort_transaction(self, timeout: float) -> None:
        super().abort_transaction(timeout)
        self.open = []


def test_a_rebalance_drops_the_open_transaction_and_rewinds(monkeypatch):
    """An open transaction spans polls (commit_interval_s): when partitions are revoked in
    one of them, none of what it holds may commit, and every partition goes back to its
    committed offset."""
    from astraflow.kafka.config import KafkaConfig
    from astraflow.kafka.loop import LoopSpec, RuntimeCounters, TransactionalLoop
    from astraflow.wire.records import ComponentStatus

    class Forward:
        counters = RuntimeCounters()
        revoked: list = []

        def handle(self, msgs, cp) -> None:
            for m in msgs:
                cp.add("out", None, raw=f"{m.partition()}@{m.offset()}".encode())

        def held_offsets(self) -> dict:
            return {}

        def on_revoke(self, partitions) -> None:
            self.revoked.append(partitions)

        def status(self) -> ComponentStatus:
            return ComponentStatus(component_id="c/0", kind="processor", host="h")

    spec = LoopSpec(component_id="c/0", group="g", transactional_id="g.0", inputs=["in"],
                    outputs=["out"], dlq="dlq", status_topic="status", max_batch=100,
                    commit_interval_s=60.0)
    work = Forward()
    loop = TransactionalLoop(spec, work, KafkaConfig(bootstrap_servers="x:1"), make_codec())
    loop.txn.producer = TxnProducer()

    def revoke_then_more():
        loop.member.on_revoke(loop.consumer, [loop.consumer.parts[0]])
        return [Msg("in", 1, 7)]

    # the first poll finds nothing: its round commits the first status; then 0@5 is
    # handled and sent, and the next poll revokes partition 0
    loop.member.consumer = ScriptedConsumer(loop, [[], [Msg("in", 0, 5)], [],
                                            revoke_then_more, [Msg("in", 1, 3)],
                                            []])
    loop._rounds()
    p = loop.producer
    # 0@5 was sent in an open transaction, which the revocation aborted; 1@7 came in the
    # same poll and went with it; after the rewind 1@3 commits on its own (then the status)
    assert p.calls[:5] == ["begin", "commit", "begin", "abort", "begin"]
    assert p.committed[1] == [b"1@3"] and b"0@5" not in sum(p.committed, [])
    assert ("in", 0, -2) in loop.consumer.seeks and ("in", 1, -2) in loop.consumer.seeks
    assert loop.counters.produced == 1 and loop.positions == {("in", 1): 4}


class SilentGroupConsumer:
    """A consumer whose reads of the group's committed offsets time out (the first
    ``silent`` of them; None: all), and whose metadata requests fail ``down`` times first
    (the broker away), then answer."""

    def __init__(self, down: int = 0, silent: int | None = None) -> None:
        from confluent_kafka import TopicPartition

        self.down, self.silent, self.reads, self.closed = down, silent, 0, False
        self.parts, self.seeks = [TopicPartition("in", 0)], []

    def assignment(self):
        return list(self.parts)

    def committed(self, tps, timeout: float):
        from confluent_kafka import TopicPartition

        self.reads += 1
        if self.silent is None or self.reads <= self.silent:
            raise _exc(KafkaError._TIMED_OUT, retriable=True)
        return [TopicPartition(t.topic, t.partition, 7) for t in tps]

    def list_topics(self, topic: str, timeout: float):
        if self.down:
            self.down -= 1
            raise _exc(KafkaError._TRANSPORT)
        return object()

    def seek(self, tp) -> None:
        self.seeks.append((tp.topic, tp.partition, tp.offset))

    def close(self) -> None:
        self.closed = True


def test_a_rewind_whose_committed_offsets_never_come_starts_a_new_consumer(monkeypatch,
                                                                           caplog):
    """After an abort the loop reads the group's committed offsets to go back to: when those
    reads keep timing out while the broker answers otherwise, the consumer is closed and a
    new member joins (its assignment starts at the committed offsets); while the broker
    answers nothing, the reads go on (up to the outage limit)."""
    caplog.set_level(logging.WARNING, logger="astraflow.loop")

    def rewind(consumer: SilentGroupConsumer):
        loop, _ = _loop(monkeypatch)
        loop.work.on_revoke = lambda partitions: None
        loop.work.held_offsets = lambda: {}
        loop._call_timeout_s = 0.05
        fresh = SilentGroupConsumer()
        loop.member.consumer = consumer
        loop.positions.update({("in", 0): 12})
        monkeypatch.setattr(loop.member, "_subscribed", lambda: fresh)
        loop._rewind()
        return loop, fresh

    # two metadata requests unanswered: three rounds of reads, then one more once it answers
    old = SilentGroupConsumer(down=2)
    loop, fresh = rewind(old)
    assert old.closed and loop.consumer is fresh and fresh.reads == 0 and not old.seeks
    assert old.reads == 3 * REWIND_TRIES + 1 and loop.positions == {}
    assert any("starting a new consumer (reading committed offsets: Local: Timed out)"
               in r.message for r in caplog.records), caplog.text

    # the broker answers and so does the next read (the outage just ended): the same
    # consumer goes back to the committed offset
    old = SilentGroupConsumer(down=1, silent=2 * REWIND_TRIES)
    loop, fresh = rewind(old)
    assert loop.consumer is old and not old.closed and old.seeks == [("in", 0, 7)]


def test_when_an_open_transaction_commits():
    """commit_interval_s: at once when a poll finds nothing more (light load), at max_batch
    inputs, or once its first input is commit_interval_s old; None: every round."""
    from astraflow.kafka.checkpoint import CommitPolicy

    policy = CommitPolicy(max_batch=100, interval_s=0.1)
    cp = Checkpoint(make_codec(), "dlq", {})
    assert not policy.due(cp, False, 5.0)  # nothing at all
    cp.add("out", None, raw=b"x")
    assert policy.due(cp, False, 5.0)  # a timer's output, no input
    cp.took(10, 5.0)
    assert not policy.due(cp, True, 5.05)  # records keep coming
    assert policy.due(cp, False, 5.05)  # the poll found nothing more
    assert policy.due(cp, True, 5.2)  # old enough
    cp.took(90, 5.04)  # the first input's time stays
    assert (cp.inputs, cp.first_at) == (100, 5.0)
    assert policy.due(cp, True, 5.05)  # full
    assert CommitPolicy(max_batch=100).due(cp, True, 5.0)  # no interval: every round
