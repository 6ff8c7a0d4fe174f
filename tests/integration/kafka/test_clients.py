"""Records, topics and lag on a real broker."""

from __future__ import annotations

import time
from collections import Counter

from confluent_kafka import Consumer, Producer, TopicPartition

from astraflow.config.topology import parse_topology
from astraflow.kafka.clients import RecordConsumer, RecordProducer, make_admin, read_all
from astraflow.kafka.lag import lag, total_lag
from astraflow.kafka.topics import apply_topics, describe_topic
from astraflow.wire.records import Task
from tests.conftest import random_name, wait_for
from tests.unit.wire.test_codec import sample_records


def test_avro_round_trip_through_kafka(kafka_config, new_topic, new_group):
    topic = new_topic(partitions=2)
    records = sample_records()
    producer = RecordProducer(kafka_config)
    for i, rec in enumerate(records):
        producer.produce(topic, rec, key=f"k{i}")
    producer.flush()
    consumer = RecordConsumer(kafka_config, new_group(), [topic])
    got = list(consumer.iter_until(len(records), timeout_s=30))
    consumer.close()
    assert len(got) == len(records)
    by_key = {r.key.decode(): r.record for r in got}
    assert by_key == {f"k{i}": rec for i, rec in enumerate(records)}


def test_lag_is_exact_per_record_with_compression_and_linger(kafka_config, new_topic, new_group):
    """Lag counts records, not producer batches: many records share each compressed batch."""
    topic = new_topic(partitions=3)
    n, m = 1000, 291  # m records consumed and committed on partition 0
    producer = RecordProducer(kafka_config, **{"compression.type": "lz4", "linger.ms": 200,
                                               "batch.num.messages": 10000})
    per_partition = Counter()
    for i in range(n):
        p = i % 3
        per_partition[p] += 1
        producer.produce(topic, Task(task_id=f"t{i}", prompt_id=f"p{i}", workflow="w",
                                     payload="{}", source="s"), key=f"p{i}", partition=p)
    producer.flush()
    group = new_group()
    consumer = Consumer(kafka_config.consumer_conf(group))
    consumer.assign([TopicPartition(topic, 0, 0)])
    seen = 0
    last = None
    deadline = time.time() + 30
    while seen < m and time.time() < deadline:
        for msg in consumer.consume(m - seen, 5):
            assert not msg.error()
            seen += 1
            last = msg
    consumer.commit(offsets=[TopicPartition(topic, 0, last.offset() + 1)], asynchronous=False)
    consumer.close()

    rows = {r.partition: r for r in lag(kafka_config, group, [topic])}
    assert rows[0].end_offset == per_partition[0]
    assert rows[0].committed == m
    assert rows[0].lag == per_partition[0] - m
    for p in (1, 2):
        assert rows[p].committed is None
        assert rows[p].end_offset == per_partition[p]
        assert rows[p].lag == per_partition[p]
    assert total_lag(list(rows.values())) == n - m


def test_lag_reads_the_last_committed_offsets_while_a_transaction_is_open(
        kafka_config, new_topic, new_group):
    """A busy exactly-once processor nearly always has a transaction open: lag shows the
    offsets it last committed at once, and the end a read_committed reader sees."""
    topic, group = new_topic(), new_group()
    producer = Producer(kafka_config.producer_conf(**{"transactional.id": random_name("tx")}))
    producer.init_transactions(30)
    meta = Consumer(kafka_config.consumer_conf(group)).consumer_group_metadata()
    for offset in (1, 2):
        producer.begin_transaction()
        producer.produce(topic, b"x")
        producer.send_offsets_to_transaction([TopicPartition(topic, 0, offset)], meta)
        if offset == 1:
            producer.commit_transaction(30)
    producer.flush(30)
    try:
        [row] = lag(kafka_config, group, [topic], timeout=5.0)  # a stable fetch waits it out
        assert (row.committed, row.end_offset, row.lag) == (1, 2, 1)
    finally:
        producer.abort_transaction(30)


def test_a_committed_offset_past_the_log_counts_from_the_start_where_the_consumer_resumes(
        kafka_config, new_topic, new_group):
    """A group that kept its offsets while its topic was deleted and made again (a broker
    whose coordinator was still loading) has a committed offset past the new log's end:
    its consumer resets to the earliest offset, so everything there is still to consume."""
    topic, group = new_topic(partitions=1), new_group()
    producer = RecordProducer(kafka_config)
    for i in range(3):
        producer.produce(topic, Task(task_id=f"t{i}", prompt_id="p", workflow="w",
                                     payload="{}", source="s"), key=f"{i}")
    producer.flush()
    consumer = Consumer(kafka_config.consumer_conf(group))
    consumer.commit(offsets=[TopicPartition(topic, 0, 1975)], asynchronous=False)
    consumer.close()

    [row] = lag(kafka_config, group, [topic])
    assert (row.committed, row.end_offset, row.start_offset) == (1975, 3, 0)
    assert (row.resumes_at, row.lag) == (0, 3)
    consumer = RecordConsumer(kafka_config, group, [topic])  # and the consumer agrees
    assert len(list(consumer.iter_until(3, timeout_s=30))) == 3
    consumer.close()


def test_topics_apply_is_idempotent_and_applies_configs(kafka_config):
    run = random_name("run")
    data = {
        "run": run,
        "topics": {
            "tasks": {"partitions": 2, "retention_ms": 3600000},
            "trajectories": {"compression": "zstd", "max_message_bytes": 2097152},
        },
    }
    topo = parse_topology(data)
    admin = make_admin(kafka_config)
    first = {c.topic: c.action for c in apply_topics(admin, topo.resolved_topics())}
    assert first[f"{run}.tasks"] == "created"
    assert first[f"{run}.dlq"] == "created"  # implicit topics come along
    second = {c.topic: c.action for c in apply_topics(admin, topo.resolved_topics())}
    assert set(second.values()) == {"unchanged"}
    desc = describe_topic(admin, f"{run}.trajectories")
    assert desc["configs"]["compression.type"] == "zstd"
    assert desc["configs"]["max.message.bytes"] == "2097152"
    assert len(describe_topic(admin, f"{run}.tasks")["partitions"]) == 2

    data["topics"]["tasks"] = {"partitions": 4, "retention_ms": 7200000}
    changes = {c.topic: c for c in apply_topics(admin, parse_topology(data).resolved_topics())}
    assert changes[f"{run}.tasks"].action == "updated"
    assert "partitions 2 -> 4" in changes[f"{run}.tasks"].detail
    # config changes reach the broker's view through the KRaft metadata log, not at once
    wait_for(lambda: describe_topic(admin, f"{run}.tasks")["configs"].get("retention.ms")
             == "7200000", 15, "the altered retention.ms")
    assert len(describe_topic(admin, f"{run}.tasks")["partitions"]) == 4


def test_read_all_hides_aborted_transactions(kafka_config, new_topic):
    topic = new_topic(partitions=1)
    producer = RecordProducer(kafka_config, transactional_id=random_name("tx"))
    task = Task(task_id="kept", prompt_id="p", workflow="w", payload="{}", source="s")
    producer.begin()
    producer.produce(topic, Task(task_id="aborted", prompt_id="p", workflow="w", payload="{}",
                                 source="s"))
    producer.producer.flush()
    producer.abort()
    producer.begin()
    producer.produce(topic, task)
    producer.commit()
    committed = read_all(kafka_config, topic, expect=Task)
    assert [r.record.task_id for r in committed] == ["kept"]
    everything = read_all(kafka_config, topic, expect=Task, isolation="read_uncommitted")
    assert [r.record.task_id for r in everything] == ["aborted", "kept"]
