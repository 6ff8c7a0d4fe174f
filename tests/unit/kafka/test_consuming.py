"""What the loop takes from its consumer each round and the offsets it commits, without a
broker: how many records and how long to wait per commit mode, errors in place of records,
positions held back by the work."""

from __future__ import annotations

import pytest
from confluent_kafka import KafkaError, KafkaException

from astraflow.kafka.consuming import CHUNK, Intake
from astraflow.kafka.spec import LoopSpec
from tests.fakes import Msg


class Polls:
    """Answers each consume(n, timeout) with the next scripted batch; records the calls."""

    def __init__(self, *batches: list) -> None:
        self.batches, self.calls = list(batches), []

    def consume(self, n: int, timeout: float) -> list:
        self.calls.append((n, timeout))
        return self.batches.pop(0) if self.batches else []


def spec(inputs: tuple[str, ...] = ("in",), **kw) -> LoopSpec:
    return LoopSpec(component_id="c/0", group="g", transactional_id="g.0", inputs=list(inputs),
                    outputs=["out"], dlq="dlq", status_topic="status", **kw)


def intake(**kw) -> tuple[Intake, list]:
    errors: list = []
    return Intake(spec(**kw), lambda err, topic: errors.append((err.code(), topic))), errors


def test_one_transaction_per_poll_waits_for_a_full_batch():
    it, _ = intake(max_batch=50, poll_timeout_s=0.3)
    c = Polls([Msg("in", 0, 4)])
    settled = []
    assert len(it.take(c, 50, True, False, lambda: settled.append(1))) == 1
    assert c.calls == [(50, 0.3)] and settled == []


def test_an_open_transaction_takes_what_is_fetched_a_chunk_at_a_time():
    it, _ = intake(max_batch=100_000, poll_timeout_s=0.3, commit_interval_s=0.1)
    settled: list[int] = []

    # inputs in the open checkpoint already: no wait, no settling
    c = Polls([Msg("in", 0, 1)])
    it.take(c, 99_000, False, True, lambda: settled.append(1))
    assert c.calls == [(CHUNK, 0)] and settled == []
    c = Polls([])
    it.take(c, 7, False, False, lambda: settled.append(1))
    assert c.calls == [(7, 0)]

    # a new checkpoint while a commit is in flight: records already fetched are made first
    c = Polls([Msg("in", 0, 2)])
    assert len(it.take(c, 100_000, True, True, lambda: settled.append(1))) == 1
    assert c.calls == [(CHUNK, 0)] and settled == []

    # nothing fetched: the commit's outcome is taken, then the first record waited for
    # and whatever came with it taken at once
    c = Polls([], [Msg("in", 0, 3)], [Msg("in", 0, 4), Msg("in", 1, 9)])
    got = it.take(c, 100_000, True, True, lambda: settled.append(1))
    assert c.calls == [(CHUNK, 0), (1, 0.3), (CHUNK - 1, 0)] and settled == [1]
    assert [m.offset() for m in got] == [3, 4, 9]

    # no commit in flight: straight to the wait; one record allowed: no second call
    c = Polls([Msg("in", 0, 5)])
    it.take(c, 1, True, False, lambda: settled.append(1))
    assert c.calls == [(1, 0.3)] and settled == [1, 1]
    assert it.positions == {("in", 0): 6, ("in", 1): 10}


def test_errors_in_place_of_records():
    it, errors = intake()
    eof = KafkaError(KafkaError._PARTITION_EOF)
    refused = KafkaError(KafkaError.TOPIC_AUTHORIZATION_FAILED)
    got = it.accept([Msg("in", 0, 3), Msg("in", 0, 4, eof), Msg("in", 1, 8, refused),
                     Msg("in", 1, 9)])
    assert [(m.partition(), m.offset()) for m in got] == [(0, 3), (1, 9)]
    assert errors == [(KafkaError.TOPIC_AUTHORIZATION_FAILED, "in")]
    assert it.positions == {("in", 0): 4, ("in", 1): 10}

    with pytest.raises(KafkaException):
        it.accept([Msg("in", 0, 5), Msg("in", 0, 6, KafkaError(KafkaError._FENCED,
                                                               fatal=True))])


def test_positions_of_one_input_topic_or_several():
    batch = [Msg("in", 0, 3), Msg("in", 2, 40), Msg("in", 0, 4), Msg("in", 2, 41)]
    for inputs in (("in",), ("in", "other"), ("^in.*",)):
        it, _ = intake(inputs=inputs)
        it.positions[("in", 1)] = 7  # read before, none in this batch
        assert it.accept(batch) == batch
        assert it.positions == {("in", 0): 5, ("in", 1): 7, ("in", 2): 42}, inputs
        assert it.accept([]) == [] and len(it.positions) == 3


def test_the_offsets_committed_are_held_back_where_the_work_holds_a_record():
    it, _ = intake(inputs=("a", "b"))
    it.accept([Msg("b", 0, 19), Msg("a", 1, 4), Msg("a", 0, 10), Msg("a", 0, 11)])
    assert it.positions == {("b", 0): 20, ("a", 1): 5, ("a", 0): 12}
    tps = it.offsets({("a", 0): 7, ("b", 0): 30})
    assert [(t.topic, t.partition, t.offset) for t in tps] == [("a", 0, 7), ("a", 1, 5),
                                                                ("b", 0, 20)]
    it.forget([("a", 1), ("c", 0)])
    assert it.positions == {("b", 0): 20, ("a", 0): 12}
