"""Offsets of topics as the cluster reports them (admin ListOffsets): watermarks, the
offset at a time, the newest record's timestamp. No consumer, no group."""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import MissingTopicsError

_NO_LEADER_YET = {KafkaError.NOT_LEADER_FOR_PARTITION, KafkaError.LEADER_NOT_AVAILABLE,
                  KafkaError.UNKNOWN_TOPIC_OR_PART}


def list_offsets(admin: Any, tps: Iterable[TopicPartition], spec: OffsetSpec,
                 retry_s: float = 15.0) -> dict[tuple[str, int], Any]:
    """``(topic, partition) -> ListOffsetsResultInfo`` (its ``offset`` and ``timestamp``)
    of ``spec`` for every partition in ``tps``, in one request (retried for up to
    ``retry_s`` while a partition has no leader yet)."""
    req = {tp: spec for tp in tps}
    if not req:
        return {}
    deadline = time.monotonic() + retry_s
    while True:
        try:
            res = admin.list_offsets(req, request_timeout=30)
            return {(tp.topic, tp.partition): fut.result() for tp, fut in res.items()}
        except KafkaException as e:
            # a topic created a moment ago may have no leader yet
            err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
            if err is None or err.code() not in _NO_LEADER_YET or time.monotonic() > deadline:
                raise
            time.sleep(0.2)


class Offsets:
    """Partition counts, watermarks and time lookups of single topics."""

    def __init__(self, config: KafkaConfig):
        self.admin = make_admin(config)
        self._partitions: dict[str, int] = {}

    def partitions(self, topic: str) -> int:
        """How many partitions ``topic`` has (asked once); ``MissingTopicsError`` when it
        does not exist."""
        if topic not in self._partitions:
            md = self.admin.list_topics(topic, timeout=10).topics.get(topic)
            if md is None or md.error is not None or not md.partitions:
                raise MissingTopicsError(f"topic {topic} does not exist (see `astraflow run "
                                         "list`)")
            self._partitions[topic] = len(md.partitions)
        return self._partitions[topic]

    def lookup(self, topic: str, spec: OffsetSpec) -> dict[int, int]:
        """Partition -> the offset ``spec`` names."""
        tps = [TopicPartition(topic, p) for p in range(self.partitions(topic))]
        return {p: info.offset for (_, p), info in list_offsets(self.admin, tps, spec).items()}

    def watermarks(self, topic: str) -> dict[int, tuple[int, int]]:
        """Partition -> (low, high) watermark."""
        low, high = self.lookup(topic, OffsetSpec.earliest()), self.lookup(
            topic, OffsetSpec.latest())
        return {p: (low[p], high[p]) for p in low}

    def at_time(self, topic: str, ms: int | None) -> dict[int, int] | None:
        """Partition -> the first offset at or after time ``ms`` (the high watermark when
        nothing is that new); None for no time."""
        if ms is None:
            return None
        marks = self.watermarks(topic)
        found = self.lookup(topic, OffsetSpec.for_timestamp(ms))
        return {p: (o if o >= 0 else marks[p][1]) for p, o in found.items()}


__all__ = ["Offsets", "list_offsets"]
