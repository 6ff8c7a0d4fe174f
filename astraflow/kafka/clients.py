"""Thin typed wrappers over confluent-kafka clients: records in, records out."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer
from confluent_kafka.admin import AdminClient

from astraflow.kafka.access import refusal
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.table import TopicReader
from astraflow.wire.codec import Codec, RecordDecodeError, make_codec
from astraflow.wire.records import DeadLetter, Record

R = TypeVar("R", bound=Record)
log = logging.getLogger("astraflow.kafka")


def make_codec_for(config: KafkaConfig) -> Codec:
    return make_codec(config.schema_registry_url, config.schema_registry_options)


def flush_waiting(producer: Producer, limit_s: float, what: str) -> int:
    """``producer.flush`` for up to ``limit_s`` (through a broker outage), logging once a
    minute while records wait; how many are still undelivered."""
    start = time.monotonic()
    remaining = producer.flush(min(limit_s, 60.0))
    while remaining and time.monotonic() - start < limit_s:
        log.warning("%d %s wait for Kafka (%.0fs so far, giving up after %.0fs)", remaining,
                    what, time.monotonic() - start, limit_s)
        remaining = producer.flush(min(60.0, limit_s - (time.monotonic() - start)))
    return remaining


def make_admin(config: KafkaConfig) -> AdminClient:
    return AdminClient(config.admin_conf())


def _as_key(key: str | bytes | None) -> bytes | None:
    if key is None or isinstance(key, bytes):
        return key
    return key.encode()


class RecordProducer:
    """Produces records to topics, Avro-encoded with the configured codec.

    Pass ``transactional_id`` for a transactional producer (``begin``/``commit`` around
    produces). Delivery errors raise from ``flush``.
    """

    def __init__(
        self,
        config: KafkaConfig,
        codec: Codec | None = None,
        transactional_id: str | None = None,
        init: bool = True,
        **extra: object,
    ):
        conf = config.producer_conf(**extra)
        if transactional_id:
            conf["transactional.id"] = transactional_id
        else:  # records wait out a broker outage (a transaction's wait for one is its own)
            conf.setdefault("message.timeout.ms", int(config.outage_limit_s * 1000) + 30_000)
        self.wait_s = config.outage_limit_s
        self.producer = Producer(conf)
        self.codec = codec or make_codec_for(config)
        self.errors: list[KafkaError] = []
        self.refused: list[tuple[str, KafkaError]] = []  # topics that refused a record
        self.principal = config.principal()
        self.delivered = 0
        if transactional_id and init:
            self.producer.init_transactions(30)

    def _on_delivery(self, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.errors.append(err)
            if err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
                self.refused.append((_msg.topic(), err))
        else:
            self.delivered += 1

    def produce(
        self,
        topic: str,
        record: Record,
        key: str | bytes | None = None,
        partition: int | None = None,
    ) -> None:
        self.produce_raw(topic, self.codec.encode(record, topic), key, partition)

    def produce_raw(
        self,
        topic: str,
        value: bytes | None,
        key: str | bytes | None = None,
        partition: int | None = None,
        timestamp_ms: int = 0,
    ) -> None:
        kwargs: dict[str, int] = {"partition": partition} if partition is not None else {}
        if timestamp_ms:
            kwargs["timestamp"] = timestamp_ms
        while True:
            try:
                self.producer.produce(
                    topic, value=value, key=_as_key(key), on_delivery=self._on_delivery, **kwargs
                )
                return
            except BufferError:
                self.producer.poll(0.1)  # local queue full: serve deliveries, then retry

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every record is delivered: up to ``timeout`` (default: the config's
        ``outage_limit_s``, logging once a minute while Kafka does not answer)."""
        limit = self.wait_s if timeout is None else timeout
        remaining = flush_waiting(self.producer, limit, "records")
        if remaining:
            raise KafkaException(f"{remaining} messages still undelivered after {limit:.0f}s")
        if self.refused:  # denied: say who was refused what, and stop
            topic, err = self.refused[0]
            raise refusal(err, self.principal, "WRITE", f"topic {topic}")
        if self.errors:
            errs, self.errors = self.errors, []
            raise KafkaException(errs[0])

    def begin(self) -> None:
        self.producer.begin_transaction()

    def commit(self, timeout: float = 60.0) -> None:
        self.producer.commit_transaction(timeout)

    def abort(self, timeout: float = 60.0) -> None:
        self.producer.abort_transaction(timeout)


@dataclass
class Received(Generic[R]):
    """One consumed message: where it came from and its decoded record."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    record: R
    timestamp_ms: int


class RecordConsumer:
    """Consumes and decodes records; ``read_committed`` and manual commits by default."""

    def __init__(
        self,
        config: KafkaConfig,
        group_id: str,
        topics: list[str] | None = None,
        codec: Codec | None = None,
        **extra: object,
    ):
        self.consumer = Consumer(config.consumer_conf(group_id, **extra))
        self.codec = codec or make_codec_for(config)
        if topics:
            self.consumer.subscribe(topics)

    def poll(
        self, max_messages: int = 500, timeout: float = 1.0, expect: type[R] | None = None
    ) -> list[Received[R]]:
        """Decoded records of the next messages; undecodable ones raise RecordDecodeError."""
        out: list[Received[R]] = []
        for msg in self.consumer.consume(max_messages, timeout):
            if msg.error():
                if msg.error().code() == KafkaError._PARTITION_EOF:
                    continue
                raise KafkaException(msg.error())
            record = self.codec.decode(
                msg.value(), msg.topic(), msg.partition(), msg.offset(), expect=expect
            )
            out.append(
                Received(
                    msg.topic(),
                    msg.partition(),
                    msg.offset(),
                    msg.key(),
                    record,
                    msg.timestamp()[1],
                )
            )
        return out

    def iter_until(
        self, count: int, timeout_s: float, expect: type[R] | None = None
    ) -> Iterator[Received[R]]:
        """Yield records until ``count`` were seen or ``timeout_s`` passed."""
        seen = 0
        deadline = time.time() + timeout_s
        while seen < count and time.time() < deadline:
            for r in self.poll(timeout=0.5, expect=expect):
                seen += 1
                yield r

    def commit(self) -> None:
        self.consumer.commit(asynchronous=False)

    def close(self) -> None:
        self.consumer.close()


def dead_letter(msg: Message, component_id: str, reason: str) -> DeadLetter:
    """The ``DeadLetter`` for a consumed message that cannot be processed, raw bytes kept."""
    return DeadLetter(
        source_topic=msg.topic(),
        partition=msg.partition(),
        offset=msg.offset(),
        component_id=component_id,
        error=reason,
        raw=msg.value() or b"",
        raw_key=msg.key(),
    )


def read_all(
    config: KafkaConfig,
    topic: str,
    idle_s: float = 2.0,
    timeout_s: float = 60.0,
    expect: type[R] | None = None,
    codec: Codec | None = None,
    isolation: str = "read_committed",
) -> list[Received[R]]:
    """Read a whole topic from the beginning without a consumer group, up to its end (or
    until ``timeout_s``, or ``idle_s`` without a message); undecodable records raise."""
    reader: TopicReader[R] = TopicReader(
        config, topic, expect, codec=codec or make_codec_for(config), isolation=isolation,
        strict=True, client_id="read-all")
    try:
        entries = reader.catch_up(timeout_s, idle_s=idle_s)
    finally:
        reader.close()
    return [Received(e.topic, e.partition, e.offset, e.key, e.value, e.timestamp_ms)
            for e in entries if e.value is not None]


__all__ = [
    "RecordProducer",
    "RecordConsumer",
    "Received",
    "RecordDecodeError",
    "make_admin",
    "make_codec_for",
    "read_all",
]
