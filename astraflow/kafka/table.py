"""Reading a topic without a consumer group: ``TopicReader`` (the records) and
``TopicTable`` (the latest value per key).

Both assign every partition of one topic (no group, nothing committed), start from the
beginning (or the end, the last N offsets, or given offsets), decode values with the
project's codec, and skip records that do not decode (counted per reason, logged). While
the broker is away they log once per ``outage_log_interval_s`` and keep trying; only a
fatal client error raises. "Caught up" means: every partition read up to the end it had
when the target was last taken (at creation, or by ``catch_up``), where a
``read_committed`` reader counts the last stable offset as the end.

``TopicTable`` is a global table in the sense of Kafka Streams: it folds the records of the
topic into ``key -> latest value``. The key is the Kafka key (decoded as UTF-8) unless a
key function is given; a tombstone (no value) deletes its key; ``reduce`` merges a new value
into the old one (e.g. keep the higher version); callbacks registered with ``on_change``
see ``(key, old, new)`` for every change. The folding (``TableState``) and the catch-up
bookkeeping (``CatchUp``) are plain objects, free of Kafka.
"""

from __future__ import annotations

import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from astraflow.kafka.access import refusal
from astraflow.kafka.config import TABLE_GROUP, KafkaConfig
from astraflow.wire.codec import Codec, RecordDecodeError, make_codec
from astraflow.wire.records import Record

log = logging.getLogger("astraflow.kafka.table")

V = TypeVar("V", bound=Record)
K = TypeVar("K")
T = TypeVar("T")

# "beginning", "end", -N (the last N offsets of each partition) or partition -> offset
Start = Literal["beginning", "end"] | int | dict[int, int]


@dataclass(frozen=True)
class Entry(Generic[V]):
    """One message read: where it was, its key, and its decoded value (None: tombstone)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: V | None
    timestamp_ms: int


# --- catch-up bookkeeping, no Kafka ------------------------------------------------------
@dataclass
class CatchUp:
    """Where each partition is read up to, and the end it must reach to be caught up.

    ``positions``: partition -> next offset to read; ``targets``: partition -> the end to
    reach; ``at_end``: partitions whose reader reported its end (``_PARTITION_EOF``) since
    their last record, which counts as reaching the target (a ``read_committed`` reader
    stops at the last stable offset, before an open transaction).
    """

    positions: dict[int, int] = field(default_factory=dict)
    targets: dict[int, int] = field(default_factory=dict)
    at_end: set[int] = field(default_factory=set)

    def retarget(self, ends: dict[int, int]) -> None:
        """Make ``ends`` the target; an end that moved forgets an earlier end-of-partition."""
        for p, end in ends.items():
            if self.targets.get(p) != end:
                self.at_end.discard(p)
        self.targets = dict(ends)

    def advance(self, partition: int, next_offset: int, record: bool = True) -> None:
        """The reader of ``partition`` is at ``next_offset`` (after a record, if ``record``)."""
        self.positions[partition] = max(self.positions.get(partition, next_offset), next_offset)
        if record:
            self.at_end.discard(partition)

    def reached_end(self, partition: int, offset: int) -> None:
        """The reader of ``partition`` reported its end at ``offset``."""
        self.advance(partition, offset, record=False)
        self.at_end.add(partition)

    def behind(self) -> list[int]:
        """Partitions not yet at their target."""
        return sorted(p for p, t in self.targets.items()
                      if p not in self.at_end and self.positions.get(p, -1) < t)

    def done(self) -> bool:
        """Whether every partition reached its target."""
        return not self.behind()


def start_offsets(start: Start, watermarks: dict[int, tuple[int, int]]) -> dict[int, int]:
    """Partition -> first offset to read, given ``start`` and each partition's (low, high)."""
    if start == "beginning":
        return {p: low for p, (low, _) in watermarks.items()}
    if start == "end":
        return {p: high for p, (_, high) in watermarks.items()}
    if isinstance(start, dict):
        return {p: max(start.get(p, low), low) for p, (low, _) in watermarks.items()}
    if isinstance(start, int) and not isinstance(start, bool) and start <= 0:
        return {p: max(low, high + start) for p, (low, high) in watermarks.items()}
    raise ValueError(f"start must be 'beginning', 'end', -N or partition -> offset, not {start!r}")


# --- reading records ---------------------------------------------------------------------
# errors worth asking again for: no leader yet (a new topic), or Kafka not answering
_RETRIABLE = {
    KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN, KafkaError._TIMED_OUT,
    KafkaError._RESOLVE, KafkaError._UNKNOWN_PARTITION, KafkaError._WAIT_COORD,
    KafkaError.REQUEST_TIMED_OUT, KafkaError.NOT_LEADER_FOR_PARTITION,
    KafkaError.LEADER_NOT_AVAILABLE, KafkaError.UNKNOWN_LEADER_EPOCH,
    KafkaError.FENCED_LEADER_EPOCH, KafkaError.OFFSET_NOT_AVAILABLE,
    KafkaError._DESTROY_BROKER,  # asked of a cluster node that left: the next one answers
}


def _error_of(e: KafkaException) -> KafkaError | None:
    arg = e.args[0] if e.args else None
    return arg if isinstance(arg, KafkaError) else None


def _retriable(err: KafkaError | None) -> bool:
    return err is not None and (err.code() in _RETRIABLE or bool(err.retriable()))


class TopicReader(Generic[V]):
    """Reads every partition of ``topic`` without a consumer group, decoding values.

    ``value_type`` is the record type expected (None: any record type). ``strict`` makes a
    record that does not decode raise ``RecordDecodeError`` (for callers that must not act
    on a partial view); otherwise it is skipped, counted in ``skipped`` by reason, and
    logged. Raises ``KafkaException`` when the topic does not exist or Kafka does not answer
    while it is being set up.
    """

    def __init__(self, config: KafkaConfig, topic: str, value_type: type[V] | None = None, *,
                 codec: Codec | None = None, start: Start = "beginning",
                 isolation: str = "read_committed", strict: bool = False,
                 client_id: str | None = None, metadata_timeout_s: float = 10.0,
                 batch: int = 500):
        self.topic = topic
        self.value_type = value_type
        self.codec = codec or make_codec(config.schema_registry_url,
                                         config.schema_registry_options)
        self.strict = strict
        self.batch = batch
        self.skipped: Counter[str] = Counter()
        self.errors = 0
        self.last_error: KafkaError | None = None
        self.progress = CatchUp()
        self._log_interval_s = config.outage_log_interval_s
        self._last_log = -math.inf
        self.principal = config.principal()
        self.consumer = Consumer(config.consumer_conf(TABLE_GROUP, **{
            "enable.auto.commit": False, "enable.partition.eof": True,
            "isolation.level": isolation, "client.id": client_id or f"table-{topic}"}))
        try:
            self.partitions = self._partitions(metadata_timeout_s)
            marks = self._watermarks(metadata_timeout_s)
            offsets = start_offsets(start, marks)
            self.consumer.assign([TopicPartition(topic, p, o) for p, o in offsets.items()])
        except BaseException:
            self.consumer.close()
            raise
        for p, o in offsets.items():
            self.progress.advance(p, o, record=False)
        self.progress.retarget({p: high for p, (_, high) in marks.items()})

    def _partitions(self, timeout: float) -> list[int]:
        md = self.consumer.list_topics(self.topic, timeout=timeout).topics.get(self.topic)
        denied = refusal(md.error if md is not None else None, self.principal, "DESCRIBE",
                         f"topic {self.topic}")
        if denied is not None:
            raise denied
        if md is None or md.error is not None or not md.partitions:
            raise KafkaException(KafkaError(KafkaError.UNKNOWN_TOPIC_OR_PART,
                                            f"topic {self.topic} does not exist"))
        return sorted(md.partitions)

    def _watermarks(self, timeout: float) -> dict[int, tuple[int, int]]:
        """(low, high) of every partition; retried up to ``timeout`` while a partition has
        no leader yet (a topic just created) or Kafka does not answer."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                return {p: self.consumer.get_watermark_offsets(
                    TopicPartition(self.topic, p), timeout=max(0.1, deadline - time.monotonic()),
                    cached=False) for p in self.partitions}
            except KafkaException as e:
                if not _retriable(_error_of(e)) or time.monotonic() >= deadline:
                    raise
                time.sleep(0.1)  # back off before asking again

    def poll(self, timeout: float = 0.0) -> list[Entry[V]]:
        """What has arrived: waits up to ``timeout`` for the first message, then drains
        without blocking."""
        out: list[Entry[V]] = []
        while True:
            try:
                msgs = self.consumer.consume(self.batch, timeout)
            except KafkaException as e:
                self._error(_error_of(e), str(e))
                return out
            if not msgs:
                return out
            for m in msgs:
                entry = self._entry(m)
                if entry is not None:
                    out.append(entry)
            timeout = 0.0

    def _entry(self, m: Message) -> Entry[V] | None:
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                self.progress.reached_end(m.partition(), m.offset())
            else:
                self._error(err, str(err))
            return None
        self.progress.advance(m.partition(), m.offset() + 1)
        value = None
        if m.value() is not None:
            try:
                value = self.codec.decode(m.value(), m.topic(), m.partition(), m.offset(),
                                          expect=self.value_type)
            except RecordDecodeError as e:
                if self.strict:
                    raise
                self._skip(e)
                return None
        return Entry(m.topic(), m.partition(), m.offset(), m.key(), value,  # type: ignore[arg-type]
                     m.timestamp()[1])

    def _skip(self, e: RecordDecodeError) -> None:
        reason = type(e).__name__
        self.skipped[reason] += 1
        n = sum(self.skipped.values())
        if n <= 10 or n % 100 == 0:
            log.warning("%s: skipping an undecodable record (%d so far): %s", self.topic, n, e)

    def _error(self, err: KafkaError | None, text: str) -> None:
        self.errors += 1
        self.last_error = err
        denied = refusal(err, self.principal, "READ", f"topic {self.topic}")
        if denied is not None:  # never retried: one line naming who, what, where
            raise denied
        if err is not None and err.fatal():
            raise KafkaException(err)
        now = time.monotonic()
        if now - self._last_log >= self._log_interval_s:
            self._last_log = now
            log.warning("%s: reader error (%d so far), retrying: %s", self.topic, self.errors,
                        text)

    def retarget(self, timeout: float = 5.0) -> bool:
        """Make the ends the partitions have now the catch-up target; False (logged) when
        Kafka does not answer."""
        try:
            marks = self._watermarks(timeout)
        except KafkaException as e:
            self._error(_error_of(e), f"reading the end offsets: {e}")
            return False
        self.progress.retarget({p: high for p, (_, high) in marks.items()})
        return True

    def caught_up(self) -> bool:
        """Whether every partition was read up to its target."""
        behind = self.progress.behind()
        if behind:  # the position also steps over transaction markers
            try:
                tps = self.consumer.position([TopicPartition(self.topic, p) for p in behind])
            except KafkaException:
                return False
            for tp in tps:
                if tp.offset >= 0:
                    self.progress.advance(tp.partition, tp.offset, record=False)
        return self.progress.done()

    def catch_up(self, timeout_s: float = 60.0, idle_s: float | None = None) -> list[Entry[V]]:
        """Everything up to the ends the partitions have now; stops early after ``timeout_s``
        or ``idle_s`` without a message (check ``caught_up()`` to tell)."""
        out: list[Entry[V]] = []
        deadline = time.monotonic() + timeout_s
        self.retarget(min(timeout_s, 5.0))
        last = time.monotonic()
        while not self.caught_up():
            now = time.monotonic()
            if now >= deadline or (idle_s is not None and now - last >= idle_s):
                break
            got = self.poll(min(0.2, deadline - now))
            if got:
                last = time.monotonic()
                out += got
        return out

    def close(self) -> None:
        """Close the consumer."""
        self.consumer.close()


# --- the table ---------------------------------------------------------------------------
def kafka_key(entry: Entry) -> str | None:
    """The default table key: the message key as text (None for a message without one)."""
    if entry.key is None:
        return None
    try:
        return entry.key.decode()
    except UnicodeDecodeError:
        return entry.key.hex()


ChangeCallback = Callable[[K, V | None, V | None], None]


class TableState(Generic[K, V]):
    """``key -> latest value`` and the rules folding records into it (no Kafka).

    ``key(entry)`` gives the key (default: the message key as text); a key of None drops
    the record. ``filter(entry)`` (on records with a value) drops those it returns False
    for. A tombstone deletes its key. ``reduce(old, new)`` gives the value kept when a key
    already has one (default: the new one); keeping the old object is no change.
    """

    def __init__(self, key: Callable[[Entry[V]], K | None] | None = None,
                 filter: Callable[[Entry[V]], bool] | None = None,  # noqa: A002
                 reduce: Callable[[V, V], V] | None = None):
        self.key = key or kafka_key  # type: ignore[assignment]
        self.filter = filter
        self.reduce = reduce
        self.values: dict[K, V] = {}
        self.listeners: list[ChangeCallback] = []
        self.applied = 0
        self.dropped = 0

    def apply(self, entry: Entry[V]) -> bool:
        """Fold one record in; True when the table changed (listeners were called)."""
        if entry.value is not None and self.filter is not None and not self.filter(entry):
            self.dropped += 1
            return False
        key = self.key(entry)
        if key is None:
            self.dropped += 1
            return False
        self.applied += 1
        old = self.values.get(key)
        if entry.value is None:
            if key not in self.values:
                return False
            del self.values[key]
            new = None
        else:
            new = entry.value if old is None or self.reduce is None else \
                self.reduce(old, entry.value)
            if new is old:
                return False
            self.values[key] = new
        for callback in list(self.listeners):
            callback(key, old, new)
        return True


class RecordSource(Protocol[V]):
    """What a ``TopicTable`` reads from (a ``TopicReader``, or a list in tests)."""

    topic: str

    def poll(self, timeout: float = 0.0) -> list[Entry[V]]: ...

    def retarget(self, timeout: float = 5.0) -> bool: ...

    def caught_up(self) -> bool: ...

    def close(self) -> None: ...


class TopicTable(Generic[K, V]):
    """The latest value per key of one topic, read without a consumer group.

    Make one with ``TopicTable.open(config, topic, RecordType, ...)``; ``poll``/``update``
    take in what arrived, ``catch_up`` reads to the current end, ``wait_until`` polls until
    a condition holds. Not thread-safe: use it from one thread.
    """

    def __init__(self, source: RecordSource[V], *,
                 key: Callable[[Entry[V]], K | None] | None = None,
                 filter: Callable[[Entry[V]], bool] | None = None,  # noqa: A002
                 reduce: Callable[[V, V], V] | None = None):
        self.source = source
        self.state: TableState[K, V] = TableState(key, filter, reduce)

    @classmethod
    def open(cls, config: KafkaConfig, topic: str, value_type: type[V] | None = None, *,
             key: Callable[[Entry[V]], K | None] | None = None,
             filter: Callable[[Entry[V]], bool] | None = None,  # noqa: A002
             reduce: Callable[[V, V], V] | None = None, codec: Codec | None = None,
             start: Start = "beginning", client_id: str | None = None,
             metadata_timeout_s: float = 10.0) -> TopicTable[K, V]:
        """A table over ``topic`` (see ``TopicReader`` and ``TableState`` for the options);
        nothing is read before the first ``poll``."""
        reader = TopicReader(config, topic, value_type, codec=codec, start=start,
                             client_id=client_id, metadata_timeout_s=metadata_timeout_s)
        return cls(reader, key=key, filter=filter, reduce=reduce)

    @property
    def topic(self) -> str:
        """The topic read."""
        return self.source.topic

    def on_change(self, callback: ChangeCallback, replay: bool = False) -> ChangeCallback:
        """Call ``callback(key, old, new)`` on every change (``new`` None: deleted); with
        ``replay``, first once per entry held now (``old`` None). Returns ``callback``."""
        self.state.listeners.append(callback)
        if replay:
            for k, v in list(self.state.values.items()):
                callback(k, None, v)
        return callback

    def poll(self, timeout: float = 0.0) -> int:
        """Take in what has arrived (waiting up to ``timeout`` for the first message);
        how many changes it made."""
        return sum(self.state.apply(e) for e in self.source.poll(timeout))

    def update(self) -> int:
        """``poll`` without waiting."""
        return self.poll(0.0)

    def caught_up(self) -> bool:
        """Whether the table reached the ends taken at creation or by the last ``catch_up``."""
        return self.source.caught_up()

    def catch_up(self, timeout_s: float = 60.0) -> bool:
        """Read up to the ends the partitions have now (at most ``timeout_s``); whether the
        table got there."""
        deadline = time.monotonic() + timeout_s
        self.source.retarget(min(timeout_s, 5.0))
        while not self.source.caught_up():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self.poll(min(0.2, left))
        return True

    def wait_until(self, predicate: Callable[[TopicTable[K, V]], T], timeout_s: float,
                   poll_s: float = 0.5) -> T | None:
        """Poll until ``predicate(self)`` returns something truthy and return that; None
        after ``timeout_s``. Checked at once, then whenever messages arrived or ``poll_s``
        passed without any."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = predicate(self)
            if result:
                return result
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            self.poll(min(poll_s, left))

    def get(self, key: K, default: V | None = None) -> V | None:
        """The latest value of ``key`` (``default`` when none)."""
        return self.state.values.get(key, default)

    def items(self) -> list[tuple[K, V]]:
        """(key, latest value) pairs, in the order the keys first arrived."""
        return list(self.state.values.items())

    def keys(self) -> list[K]:
        """The keys held."""
        return list(self.state.values)

    def values(self) -> list[V]:
        """The latest values held."""
        return list(self.state.values.values())

    def __len__(self) -> int:
        return len(self.state.values)

    def __contains__(self, key: object) -> bool:
        return key in self.state.values

    def __iter__(self) -> Iterator[K]:
        return iter(list(self.state.values))

    def close(self) -> None:
        """Close the reader."""
        self.source.close()

    def __enter__(self) -> TopicTable[K, V]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CatchUp", "Entry", "RecordSource", "Start", "TableState", "TopicReader",
           "TopicTable", "kafka_key", "start_offsets"]
