"""``Checkpoint``: what one transaction of the loop writes, gathered before it commits.

A component adds its output records (and dead letters) to the checkpoint while it works
on a batch of inputs; the loop then produces them and commits the inputs' offsets in one
Kafka transaction, or aborts and rewinds. ``mark``/``rollback`` undo the records added
since a mark, so one bad input never costs its batch-mates their output."""

from __future__ import annotations

from collections.abc import Callable

from astraflow.errors import AstraflowError
from astraflow.wire.codec import Codec
from astraflow.wire.records import DeadLetter, Record


class RecordTooLarge(AstraflowError):
    """A record is larger than its topic accepts (``max.message.bytes``)."""


class Checkpoint:
    """The records of one transaction, encoded when added, and what to do once committed."""

    def __init__(self, codec: Codec, dlq: str, max_bytes: dict[str, int]):
        self.codec = codec
        self.dlq = dlq
        self.max_bytes = max_bytes
        # topic, value, key, partition, timestamp (ms; 0: the producer's clock)
        self.records: list[tuple[str, bytes, bytes | str | None, int | None, int]] = []
        self.sent = 0  # records[:sent] are in the open transaction
        self.outputs = 0
        self.dead = 0
        self.after_commit: list[Callable[[], None]] = []

    def add(self, topic: str, record: Record | None, key: bytes | str | None = None,
            partition: int | None = None, raw: bytes | None = None,
            timestamp_ms: int = 0) -> None:
        """Add ``record`` (or its bytes ``raw``) for ``topic``, stamped ``timestamp_ms``
        (0: when produced); ``RecordTooLarge`` when it is over the topic's
        ``max.message.bytes`` (nothing is added then)."""
        value = raw if raw is not None else self.codec.encode(record, topic)
        limit = self.max_bytes.get(topic)
        if limit is not None and len(value) > limit:
            raise RecordTooLarge(
                f"a {type(record).__name__ if record is not None else 'record'} of "
                f"{len(value)} bytes for {topic}, which accepts at most {limit} "
                f"(max.message.bytes)"
            )
        self.records.append((topic, value, key, partition, timestamp_ms))
        if topic == self.dlq:
            self.dead += 1
        else:
            self.outputs += 1

    def mark(self) -> int:
        """Where ``rollback`` goes back to: the number of records added so far."""
        return len(self.records)

    def rollback(self, mark: int) -> None:
        """Drop what was added since ``mark()``."""
        if mark < self.sent:
            raise ValueError("cannot roll back records already sent in the transaction")
        dead = sum(1 for r in self.records[mark:] if r[0] == self.dlq)
        self.dead -= dead
        self.outputs -= len(self.records) - mark - dead
        del self.records[mark:]

    def dead_letter(self, letter: DeadLetter) -> None:
        try:
            self.add(self.dlq, letter, letter.raw_key)
        except RecordTooLarge:  # keep the reason and where it was; drop the bytes
            letter.raw = b""
            letter.error += " (raw bytes dropped: over the dlq's max.message.bytes)"
            self.add(self.dlq, letter, letter.raw_key)

    def __bool__(self) -> bool:
        return bool(self.records)
