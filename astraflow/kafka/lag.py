"""Consumer-group lag per partition: log-end offset minus committed offset."""

from __future__ import annotations

import time
from dataclasses import dataclass

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.kafka.config import KafkaConfig

OFFSET_INVALID = -1001


@dataclass(frozen=True)
class PartitionLag:
    group: str
    topic: str
    partition: int
    end_offset: int  # log-end offset (high watermark)
    committed: int | None  # None: the group has committed nothing on this partition
    start_offset: int  # earliest retained offset
    lag: int  # records the group has yet to consume

    @property
    def committed_display(self) -> str:
        return "-" if self.committed is None else str(self.committed)

    @property
    def resumes_at(self) -> int:
        """Where the group's consumers read next: its committed offset, else the earliest
        retained one (``auto.offset.reset=earliest``), as also where the committed offset
        lies outside the log: past its end (the topic deleted and made again under the
        same name while the group kept its offsets) or before its start (retention)."""
        return resume_offset(self.committed, self.start_offset, self.end_offset)


def resume_offset(committed: int | None, start: int, end: int) -> int:
    """Where a consumer with ``auto.offset.reset=earliest`` resumes on a partition whose
    log spans ``[start, end]``, given the group's committed offset (None: none)."""
    if committed is None or not start <= committed <= end:
        return start
    return committed


class LagReader:
    """Reads consumer-group lag; keeps two non-member consumers per group between calls.

    Committed offsets are fetched with ``Consumer.committed`` rather than the admin
    ListConsumerGroupOffsets call: the latter crashes librdkafka 2.x when the group
    coordinator answers "load in progress" on a freshly started broker.

    They are the offsets last committed, as Kafka's own ``kafka-consumer-groups`` shows
    them: a read_committed consumer asks for stable offsets, which the coordinator refuses
    while the group has a transaction open, and a busy exactly-once processor nearly
    always has one, so the fetch would wait out its timeout. Log-end offsets stay
    read_committed: the last stable offset, the end a transactional reader sees.
    """

    def __init__(self, config: KafkaConfig):
        self.config = config
        # per group: (committed offsets, log-end offsets); both carry the group's own id,
        # the one its ACLs let a reader describe
        self._consumers: dict[str, tuple[Consumer, Consumer]] = {}

    def _pair(self, group: str) -> tuple[Consumer, Consumer]:
        if group not in self._consumers:
            # never subscribes, so it never joins the group it reads offsets of
            conf = lambda isolation: Consumer(self.config.consumer_conf(  # noqa: E731
                group, **{"enable.auto.commit": False, "client.id": "astraflow-lag",
                          "isolation.level": isolation}))
            self._consumers[group] = (conf("read_uncommitted"), conf("read_committed"))
        return self._consumers[group]

    def lag(self, group: str, topics: list[str], timeout: float = 10.0) -> list[PartitionLag]:
        """Lag of ``group`` on every partition of ``topics``.

        With no committed offset, or one outside the log, the lag counts from the
        earliest retained offset, where a consumer with ``auto.offset.reset=earliest``
        starts (``PartitionLag.resumes_at``).
        """
        consumer, ends = self._pair(group)
        md = ends.list_topics(timeout=timeout).topics
        parts: list[TopicPartition] = []
        for t in topics:
            if t not in md or md[t].error is not None:
                raise KafkaException(f"topic {t} does not exist")
            parts += [TopicPartition(t, p) for p in sorted(md[t].partitions)]
        if not parts:
            return []
        committed = {(tp.topic, tp.partition): tp.offset
                     for tp in _retrying(lambda: consumer.committed(parts, timeout=timeout),
                                         timeout)}
        out = []
        for tp in parts:
            start, end = _retrying(
                lambda tp=tp: ends.get_watermark_offsets(tp, timeout=timeout, cached=False),
                timeout)
            c = committed.get((tp.topic, tp.partition), OFFSET_INVALID)
            c_val = None if c < 0 else c
            behind = end - resume_offset(c_val, start, end)
            out.append(PartitionLag(group, tp.topic, tp.partition, end, c_val, start,
                                    max(0, behind)))
        return out

    def close(self) -> None:
        for pair in self._consumers.values():
            for c in pair:
                c.close()
        self._consumers.clear()


_TRANSIENT = {
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError._TIMED_OUT,
}


def _retrying(call, timeout: float):
    """Retry ``call`` on transient errors (a broker just started, a leader moving)."""
    deadline = time.monotonic() + timeout
    delay = 0.1
    while True:
        try:
            return call()
        except KafkaException as e:
            err = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
            transient = err is not None and (err.code() in _TRANSIENT or err.retriable())
            if not transient or time.monotonic() + delay > deadline:
                raise
            time.sleep(delay)
            delay = min(delay * 2, 1.0)


def lag(config: KafkaConfig, group: str, topics: list[str],
        timeout: float = 10.0) -> list[PartitionLag]:
    """One-off lag of ``group`` on ``topics`` (see ``LagReader`` for repeated reads)."""
    reader = LagReader(config)
    try:
        return reader.lag(group, topics, timeout)
    finally:
        reader.close()


def total_lag(rows: list[PartitionLag]) -> int:
    return sum(r.lag for r in rows)


def format_lag_table(rows: list[PartitionLag]) -> str:
    header = ("GROUP", "TOPIC", "PARTITION", "END OFFSET", "COMMITTED", "LAG")
    body = [
        (r.group, r.topic, str(r.partition), str(r.end_offset), r.committed_display, str(r.lag))
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in [header, *body]]
    return "\n".join(lines)
