"""The producer side of the loop without a broker: which records each transaction carries,
in what order its calls are made, and what a commit in flight leaves once settled."""

from __future__ import annotations

import threading

import pytest
from confluent_kafka import KafkaError, KafkaException

from astraflow.kafka.checkpoint import Checkpoint
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.outage import Outage
from astraflow.kafka.spec import LoopSpec, RuntimeCounters
from astraflow.kafka.transactions import Transactions
from astraflow.wire.codec import make_codec


class Producer:
    """Stands in for the transactional producer (and its RecordProducer wrapper)."""

    def __init__(self, fail: dict[str, BaseException] | None = None,
                 gate: threading.Event | None = None) -> None:
        self.producer = self
        self.errors: list = []
        self.calls: list = []
        self.fail = fail or {}
        self.gate = gate  # commit_transaction waits for it

    def _call(self, name: str) -> None:
        self.calls.append(name)
        if name in self.fail:
            raise self.fail[name]

    def begin_transaction(self) -> None:
        self._call("begin")

    def produce(self, topic, value=None, key=None, partition=-1, timestamp=0) -> None:
        self.calls.append(("produce", topic, value, key, partition, timestamp))

    def produce_raw(self, topic, value, key, partition, ts) -> None:
        self.calls.append(("raw", topic, value, key, partition, ts))

    def poll(self, timeout: float = 0) -> int:
        return 0

    def send_offsets_to_transaction(self, tps, meta, timeout: float) -> None:
        self._call("offsets")

    def commit_transaction(self, timeout: float) -> None:
        if self.gate is not None:
            self.gate.wait(5)
        self._call("commit")

    def abort_transaction(self, timeout: float) -> None:
        self._call("abort")

    def purge(self) -> None:
        self.calls.append("purge")


def transactions(producer: Producer, went_through: bool = False) -> Transactions:
    spec = LoopSpec(component_id="c/0", group="g", transactional_id="g.0", inputs=["in"],
                    outputs=["out"], dlq="dlq", status_topic="status")
    txn = Transactions(spec, KafkaConfig(bootstrap_servers="x:1"), make_codec(),
                       RuntimeCounters(), Outage("c/0", "x:1", 300, 10),
                       lambda what, call: call(), lambda err: None,
                       lambda tps: went_through)
    txn.producer = producer
    return txn


def checkpoint(*values: bytes) -> Checkpoint:
    cp = Checkpoint(make_codec(), "dlq", {})
    for v in values:
        cp.add("out", None, raw=v)
    return cp


def produced(p: Producer) -> list:
    return [c[2] for c in p.calls if isinstance(c, tuple)]


def test_records_sent_ahead_go_once_and_a_new_transaction_sends_them_all():
    from confluent_kafka import TopicPartition

    p = Producer()
    txn = transactions(p)
    cp = checkpoint(b"1", b"2")
    txn.send_early(cp)
    cp.add("out", None, key="k", partition=2, raw=b"3", timestamp_ms=77)
    txn.send_early(cp)
    assert p.calls[0] == "begin" and produced(p) == [b"1", b"2", b"3"]
    assert p.calls[-1] == ("produce", "out", b"3", "k", 2, 77) and cp.sent == 3

    statuses = []
    assert txn.attempt(cp, lambda: [TopicPartition("in", 0, 5)],
                       lambda: statuses.append(len(p.calls)), lambda tps: object())
    # no second begin, nothing sent twice; the status after the records, then the
    # offsets and the commit
    assert p.calls.count("begin") == 1 and produced(p) == [b"1", b"2", b"3"]
    assert statuses == [4] and p.calls[-2:] == ["offsets", "commit"]
    assert (txn.counters.transactions, txn.counters.produced, txn.open) == (1, 3, False)

    # a transaction begun anew (after an abort) sends every record of its checkpoint
    p.calls.clear()
    assert txn.attempt(cp, list, None, lambda tps: None)
    assert p.calls[0] == "begin" and produced(p) == [b"1", b"2", b"3"]
    assert "offsets" not in p.calls  # no offsets: none sent


def test_a_full_local_queue_waits_for_room_for_that_record():
    class Full(Producer):
        def produce(self, topic, value=None, key=None, partition=-1, timestamp=0) -> None:
            if value == b"2":
                raise BufferError()
            super().produce(topic, value, key, partition, timestamp)

    p = Full()
    txn = transactions(p)
    txn.send(checkpoint(b"1", b"2", b"3"))
    assert [c[0] for c in p.calls[1:]] == ["produce", "raw", "produce"]


def test_a_commit_in_flight_is_settled_before_the_next():
    gate = threading.Event()
    p = Producer(gate=gate)
    txn = transactions(p)
    cp = checkpoint(b"1")
    done = []
    cp.after_commit.append(lambda: done.append("cp"))
    assert txn.start_commit(cp, list, lambda tps: None)
    assert not txn.finished() and txn.inflight is not None
    txn.send_early(checkpoint(b"next"))  # one transaction at a time: not sent meanwhile
    assert produced(p) == [b"1"]
    gate.set()
    txn.wait()
    assert txn.finished() and done == []  # counted when settled, on the loop's thread
    assert txn.settle() and done == ["cp"] and txn.inflight is None
    assert (txn.counters.transactions, txn.counters.produced) == (1, 1)
    assert txn.settle()  # nothing in flight


def test_a_commit_in_flight_that_failed_is_aborted_when_settled():
    abort = KafkaException(KafkaError(KafkaError.ILLEGAL_GENERATION, txn_requires_abort=True))
    p = Producer(fail={"commit": abort})
    txn = transactions(p)
    assert txn.start_commit(checkpoint(b"1"), list, lambda tps: None)
    txn.wait()
    assert txn.settle() is False and p.calls[-1] == "abort"
    assert txn.counters.transactions == 0 and not txn.open

    # the answer to a commit was lost, and the group's offsets say it went through
    p = Producer(fail={"commit": KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                                           retriable=True))})
    txn = transactions(p, went_through=True)
    made = []
    txn._new_producer = lambda: made.append(Producer()) or made[-1]
    assert txn.start_commit(checkpoint(b"1"), list, lambda tps: None)
    txn.wait()
    assert txn.settle() is True and txn.counters.transactions == 1
    # a new producer (it aborts what the old one left open); the old one's records purged
    assert txn.producer is made[0] and p.calls[-2:] == ["commit", "purge"]

    # anything but a Kafka error: aborted, and raised on the loop's thread
    p = Producer(fail={"commit": ValueError("a bug")})
    txn = transactions(p)
    txn.start_commit(checkpoint(b"1"), list, lambda tps: None)
    txn.wait()
    with pytest.raises(ValueError, match="a bug"):
        txn.settle()
    assert p.calls[-1] == "abort"


def test_an_open_transaction_dropped_or_left_to_the_next_producer():
    p = Producer()
    txn = transactions(p)
    txn.abort_open()  # none open: nothing to abort
    assert p.calls == []
    txn.send(checkpoint(b"1"))
    txn.abort_open()
    assert p.calls[-1] == "abort" and not txn.open and not txn.tainted

    p = Producer(fail={"abort": KafkaException(KafkaError(KafkaError._TRANSPORT))})
    txn = transactions(p)
    txn.send(checkpoint(b"1"))
    txn.abort_open()  # the abort failed: the next producer fences it
    assert txn.tainted and not txn.open

    txn = transactions(Producer())
    txn.send(checkpoint(b"1"))
    txn.forsake_open()
    assert txn.tainted and not txn.open
