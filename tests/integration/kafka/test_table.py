"""TopicTable and TopicReader on a real broker: tables that follow a topic, undecodable records,
the reader from the end and from the tail, a missing topic, reader errors (the folding and
catch-up logic without a broker: tests/unit/kafka/test_table.py)."""

from __future__ import annotations

import pytest

from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.kafka.table import TopicReader, TopicTable
from astraflow.wire.records import ComponentStatus, Task
from tests.unit.kafka.test_table import task


def status(component: str, produced: int) -> ComponentStatus:
    return ComponentStatus(component_id=component, kind="processor", host="h", produced=produced)


def test_table_follows_a_topic(kafka_config, new_topic):
    topic = new_topic(partitions=3)
    producer = RecordProducer(kafka_config)
    for i in range(6):
        producer.produce(topic, status(f"c{i % 3}", i), key=f"c{i % 3}")
    producer.flush()
    with TopicTable.open(kafka_config, topic, ComponentStatus) as table:
        assert not table.caught_up()
        assert table.catch_up(30)
        assert {k: v.produced for k, v in table.items()} == {"c0": 3, "c1": 4, "c2": 5}
        changes = []
        table.on_change(lambda k, old, new: changes.append((k, old and old.produced,
                                                            new and new.produced)))
        producer.produce(topic, status("c1", 10), key="c1")
        producer.produce_raw(topic, None, key="c2")  # tombstone
        producer.produce(topic, status("c9", 11), key="c9")
        producer.flush()
        got = table.wait_until(lambda t: t.get("c9"), timeout_s=30)
        assert got is not None and got.produced == 11
        assert table.wait_until(lambda t: "c2" not in t, timeout_s=30)
        assert {k: v.produced for k, v in table.items()} == {"c0": 3, "c1": 10, "c9": 11}
        assert sorted(changes) == [("c1", 4, 10), ("c2", 5, None), ("c9", None, 11)]


def test_undecodable_records_are_skipped_and_counted(kafka_config, new_topic):
    topic = new_topic()
    producer = RecordProducer(kafka_config)
    producer.produce(topic, status("a", 1), key="a")
    producer.produce_raw(topic, b"not avro", key="a")
    producer.produce(topic, task("t"), key="b")  # the wrong record type
    producer.produce(topic, status("c", 2), key="c")
    producer.flush()
    with TopicTable.open(kafka_config, topic, ComponentStatus) as table:
        assert table.catch_up(30)
        assert sorted(table.keys()) == ["a", "c"] and table.get("a").produced == 1
        reader = table.source
        assert isinstance(reader, TopicReader) and sum(reader.skipped.values()) == 2
    from astraflow.wire.codec import RecordDecodeError

    with pytest.raises(RecordDecodeError):  # strict readers (read_all) raise instead
        read_all(kafka_config, topic, expect=ComponentStatus)


def test_reader_from_the_end_and_from_the_tail(kafka_config, new_topic):
    topic = new_topic(partitions=2)
    producer = RecordProducer(kafka_config)
    for i in range(8):
        producer.produce(topic, task(f"t{i}"), key=f"t{i}", partition=i % 2)
    producer.flush()
    tail = TopicReader(kafka_config, topic, Task, start=-2)
    try:
        got = tail.catch_up(30)
        assert tail.caught_up()
        assert sorted(e.value.task_id for e in got) == ["t4", "t5", "t6", "t7"]
    finally:
        tail.close()
    with TopicTable.open(kafka_config, topic, Task, start="end") as table:
        assert table.caught_up() and len(table) == 0
        producer.produce(topic, task("new"), key="new")
        producer.flush()
        assert table.wait_until(lambda t: t.get("new"), timeout_s=30) is not None
        assert table.keys() == ["new"]


def test_a_missing_topic_raises(kafka_config):
    from confluent_kafka import KafkaException

    with pytest.raises(KafkaException, match="does not exist"):
        TopicTable.open(kafka_config, "no-such-topic-for-a-table", Task, metadata_timeout_s=5)


class _Err:
    """A stand-in for a consumer error message."""

    def __init__(self, code: int, fatal: bool = False):
        from confluent_kafka import KafkaError

        self.err = KafkaError(code, "test error", fatal=fatal)

    def error(self):
        return self.err

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return 0


class _FailingConsumer:
    """Consumer calls that fail the way they do while the broker is away."""

    def __init__(self, messages: list):
        self.messages = messages

    def consume(self, n: int, timeout: float) -> list:
        from confluent_kafka import KafkaError, KafkaException

        if not self.messages:
            raise KafkaException(KafkaError(KafkaError._TRANSPORT, "broker down"))
        return [self.messages.pop(0)]

    def get_watermark_offsets(self, *args, **kwargs):
        from confluent_kafka import KafkaError, KafkaException

        raise KafkaException(KafkaError(KafkaError._TIMED_OUT, "no answer"))

    position = get_watermark_offsets

    def close(self) -> None:
        pass


def test_reader_errors_are_counted_and_only_fatal_ones_raise(kafka_config, new_topic):
    from confluent_kafka import KafkaError, KafkaException

    topic = new_topic()
    producer = RecordProducer(kafka_config)
    producer.produce(topic, task("a"), key="a")
    producer.flush()
    reader = TopicReader(kafka_config, topic, Task)
    reader.consumer.close()
    reader.consumer = _FailingConsumer([_Err(KafkaError._ALL_BROKERS_DOWN)])  # type: ignore
    assert reader.poll(0.0) == []  # an error message, then a raised transport error
    assert reader.errors == 2 and reader.last_error.code() == KafkaError._TRANSPORT
    assert not reader.retarget() and reader.errors == 3
    table: TopicTable[str, Task] = TopicTable(reader)
    assert not table.catch_up(0.3)  # gives up after its timeout, nothing raised
    assert not table.caught_up() and len(table) == 0
    reader.consumer = _FailingConsumer([_Err(KafkaError._FATAL, fatal=True)])  # type: ignore
    with pytest.raises(KafkaException):
        reader.poll(0.0)
