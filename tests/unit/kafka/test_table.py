"""TopicTable and TopicReader without a broker: catch-up bookkeeping, start offsets, folding
records into a table (on a real broker: tests/integration/kafka/test_table.py)."""

from __future__ import annotations

import pytest

from astraflow.kafka.table import CatchUp, Entry, TableState, TopicTable, kafka_key, start_offsets
from astraflow.wire.records import Task


def task(task_id: str, attempt: int = 0) -> Task:
    return Task(task_id=task_id, prompt_id=task_id, workflow="math", payload="{}",
                source="test", attempt=attempt)


def entry(key: str | None, value: Task | None, offset: int = 0, partition: int = 0) -> Entry:
    return Entry("t", partition, offset, key.encode() if key is not None else None, value, 0)


# --- catch-up bookkeeping -----------------------------------------------------------------
def test_catch_up_reaches_targets_by_position():
    c = CatchUp(positions={0: 0, 1: 5})
    c.retarget({0: 3, 1: 5})  # partition 1 starts at its end
    assert c.behind() == [0]
    c.advance(0, 2)
    assert not c.done()
    c.advance(0, 3)
    assert c.done()


def test_catch_up_end_of_partition_counts_before_an_open_transaction():
    c = CatchUp(positions={0: 0})
    c.retarget({0: 10})  # high watermark 10, last stable offset 6
    c.advance(0, 6)
    assert not c.done()
    c.reached_end(0, 6)
    assert c.done()
    c.retarget({0: 10})  # same end: still there
    assert c.done()
    c.retarget({0: 12})  # the end moved: the old end-of-partition no longer counts
    assert c.behind() == [0]
    c.reached_end(0, 12)
    c.advance(0, 13)  # a record after the end: behind again until the next end
    c.retarget({0: 14})
    assert not c.done()


def test_start_offsets():
    marks = {0: (2, 10), 1: (0, 3)}
    assert start_offsets("beginning", marks) == {0: 2, 1: 0}
    assert start_offsets("end", marks) == {0: 10, 1: 3}
    assert start_offsets(-5, marks) == {0: 5, 1: 0}
    assert start_offsets({0: 1}, marks) == {0: 2, 1: 0}  # never below the low watermark
    with pytest.raises(ValueError):
        start_offsets(4, marks)
    with pytest.raises(ValueError):
        start_offsets("middle", marks)  # type: ignore[arg-type]


def test_setup_errors_worth_retrying():
    from confluent_kafka import KafkaError

    from astraflow.kafka.table import _retriable

    assert _retriable(KafkaError(KafkaError.NOT_LEADER_FOR_PARTITION))  # a topic just made
    assert _retriable(KafkaError(KafkaError._TRANSPORT))
    assert not _retriable(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART))
    assert not _retriable(None)


# --- folding records into a table ---------------------------------------------------------
def test_kafka_key():
    assert kafka_key(entry("a", None)) == "a"
    assert kafka_key(entry(None, None)) is None
    assert kafka_key(Entry("t", 0, 0, b"\xff\x00", None, 0)) == "ff00"


def test_table_state_keeps_the_latest_value_and_reports_changes():
    state: TableState[str, Task] = TableState()
    changes = []
    state.listeners.append(lambda k, old, new: changes.append((k, old, new)))
    a0, a1, b0 = task("a"), task("a", 1), task("b")
    assert state.apply(entry("a", a0))
    assert state.apply(entry("b", b0, 1))
    assert state.apply(entry("a", a1, 2))
    assert state.values == {"a": a1, "b": b0}
    assert changes == [("a", None, a0), ("b", None, b0), ("a", a0, a1)]


def test_tombstones_delete_and_keyless_records_are_dropped():
    state: TableState[str, Task] = TableState()
    changes = []
    state.listeners.append(lambda k, old, new: changes.append((k, old, new)))
    a = task("a")
    state.apply(entry("a", a))
    assert state.apply(entry("a", None, 1))
    assert state.values == {}
    assert changes[-1] == ("a", a, None)
    assert not state.apply(entry("a", None, 2))  # nothing to delete: no change
    assert not state.apply(entry(None, task("x"), 3))
    assert state.dropped == 1 and len(changes) == 2


def test_key_function_filter_and_reduce():
    state: TableState[str, Task] = TableState(
        key=lambda e: e.value.task_id if e.value is not None else None,
        filter=lambda e: e.value.source == "test",
        reduce=lambda old, new: new if new.attempt > old.attempt else old)
    changes = []
    state.listeners.append(lambda k, old, new: changes.append(new))
    first, retry = task("a", attempt=2), task("a", attempt=1)
    assert state.apply(entry("ignored", first))
    assert not state.apply(entry("other", retry, 1))  # reduce kept the higher attempt
    other = Task(task_id="b", prompt_id="b", workflow="m", payload="{}", source="elsewhere")
    assert not state.apply(entry("b", other, 2))  # filtered out
    assert not state.apply(entry("a", None, 3))  # the key function drops tombstones
    assert state.values == {"a": first} and changes == [first] and state.dropped == 2


class ListSource:
    """A ``RecordSource`` handing out prepared batches, one per poll."""

    topic = "t"

    def __init__(self, *batches: list[Entry]):
        self.batches = list(batches)
        self.polls = 0
        self.retargets = 0
        self.closed = False

    def poll(self, timeout: float = 0.0) -> list[Entry]:
        self.polls += 1
        return self.batches.pop(0) if self.batches else []

    def retarget(self, timeout: float = 5.0) -> bool:
        self.retargets += 1
        return True

    def caught_up(self) -> bool:
        return not self.batches

    def close(self) -> None:
        self.closed = True


def test_table_over_a_source_polls_waits_and_replays():
    a, b = task("a"), task("b")
    source = ListSource([], [entry("a", a)], [entry("b", b, 1)])
    table: TopicTable[str, Task] = TopicTable(source)
    assert table.wait_until(lambda t: t.get("b"), timeout_s=5) is b
    assert source.polls == 3 and len(table) == 2 and "a" in table
    assert table.items() == [("a", a), ("b", b)] and table.keys() == ["a", "b"]
    seen = []
    table.on_change(lambda k, old, new: seen.append(k), replay=True)
    assert seen == ["a", "b"]
    assert table.wait_until(lambda t: t.get("c"), timeout_s=0.05) is None
    with table:
        assert table.catch_up(1.0) and source.retargets == 1
    assert source.closed


def test_table_catch_up_applies_until_the_source_is_caught_up():
    source = ListSource([entry("a", task("a"))], [entry("a", None, 1)], [entry("b", task("b"), 2)])
    table: TopicTable[str, Task] = TopicTable(source)
    assert not table.caught_up()
    assert table.catch_up(5.0)
    assert table.keys() == ["b"] and table.caught_up()

