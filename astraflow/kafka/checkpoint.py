"""``Checkpoint``: what one transaction of the loop writes, gathered before it commits, and
``CommitPolicy``: when an open checkpoint is due to commit.

A component adds its output records (and dead letters) to the checkpoint while it works
on a batch of inputs; the loop then produces them and commits the inputs' offsets in one
Kafka transaction, or aborts and rewinds. ``mark``/``rollback`` undo the records added
since a mark, so one bad input never costs its batch-mates their output. The checkpoint
also counts the inputs it was made from and when the first came (``took``), which is what
``CommitPolicy`` judges it by."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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
        self.dead = 0
        self.after_commit: list[Callable[[], None]] = []
        self.inputs = 0  # records consumed into this checkpoint
        self.first_at: float | None = None  # time.monotonic() when the first of them came

    @property
    def outputs(self) -> int:
        """Records added for topics other than the dead-letter topic."""
        return len(self.records) - self.dead

    def took(self, inputs: int, at: float) -> None:
        """Count ``inputs`` records consumed into this checkpoint at ``at`` (monotonic)."""
        if inputs:
            self.inputs += inputs
            if self.first_at is None:
                self.first_at = at

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
        # the hot path (every output passes here): the outputs are counted as the records
        # that are not dead letters, when asked
        self.records.append((topic, value, key, partition, timestamp_ms))
        if topic == self.dlq:
            self.dead += 1

    def mark(self) -> int:
        """Where ``rollback`` goes back to: the number of records added so far."""
        return len(self.records)

    def rollback(self, mark: int) -> None:
        """Drop what was added since ``mark()``."""
        if mark < self.sent:
            raise ValueError("cannot roll back records already sent in the transaction")
        self.dead -= sum(1 for r in self.records[mark:] if r[0] == self.dlq)
        del self.records[mark:]

    def dead_letter(self, letter: DeadLetter) -> None:
        """Add ``letter`` for the dead-letter topic; one over its size limit goes without
        the raw bytes of the input (its reason and where it was are kept)."""
        try:
            self.add(self.dlq, letter, letter.raw_key)
        except RecordTooLarge:  # keep the reason and where it was; drop the bytes
            letter.raw = b""
            letter.error += " (raw bytes dropped: over the dlq's max.message.bytes)"
            self.add(self.dlq, letter, letter.raw_key)

    def __bool__(self) -> bool:
        return bool(self.records)


@dataclass(frozen=True)
class CommitPolicy:
    """When the loop commits its open checkpoint (see ``LoopSpec.commit_interval_s``).

    ``interval_s`` None: every round commits what it made. A number: a checkpoint stays
    open over rounds that bring records, and commits once it holds ``max_batch`` inputs,
    its first input is ``interval_s`` old, or a round brings nothing more."""

    max_batch: int
    interval_s: float | None = None

    def due(self, cp: Checkpoint, got: bool, now: float) -> bool:
        """Whether ``cp`` commits now, after a round that brought records (``got``) or
        not, at ``now`` (monotonic)."""
        if cp.first_at is None:  # no input: commit what timers made, if anything
            return bool(cp)
        return (self.interval_s is None or not got or cp.inputs >= self.max_batch
                or now - cp.first_at >= self.interval_s)
