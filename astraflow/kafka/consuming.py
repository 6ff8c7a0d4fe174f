"""``Intake``: what the loop takes from its consumer each round, and how far it has read.

How many records a round takes, and whether it waits for them, follows the loop's commit
mode (``LoopSpec.commit_interval_s``): one poll per transaction waits up to the poll
timeout for ``max_batch``; a transaction that stays open takes what is already fetched, a
chunk at a time, and waits for the first record of a new one only. The intake keeps, per
partition, the next offset to commit (past the last record handed to the work), which
the loop commits with the transaction, held back where the work still holds a record."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Protocol

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from astraflow.kafka.spec import LoopSpec

# records handed to the work at a time while a transaction stays open: each such round's
# outputs go to the broker while the next round is made (commit_interval_s)
CHUNK = 500


class _Consuming(Protocol):
    def consume(self, num_messages: int, timeout: float) -> list[Message]: ...


class Intake:
    """Takes records from a consumer for the loop and tracks the positions to commit."""

    def __init__(self, spec: LoopSpec, on_error: Callable[[KafkaError, str | None], None]):
        """``on_error(err, topic)``: an error the consumer handed out in place of a record
        (neither the end of a partition nor fatal); it may raise."""
        self.spec = spec
        self.on_error = on_error
        self.positions: dict[tuple[str, int], int] = {}  # next offset to commit
        # one input topic (not a pattern): every record is of it, so a batch's last
        # offsets are found per partition alone
        one = spec.inputs[0] if len(spec.inputs) == 1 else None
        self._only_topic = one if one is not None and not one.startswith("^") else None

    def take(self, consumer: _Consuming, limit: int, wait: bool, committing: bool,
             settle: Callable[[], object]) -> list[Message]:
        """Up to ``limit`` records: waiting for them up to the poll timeout when ``wait``,
        else only those already fetched. ``committing``: a commit is in flight, so records
        already fetched are made first; ``settle()`` takes its outcome before a wait."""
        s = self.spec
        if s.commit_interval_s is None:
            got = consumer.consume(s.max_batch, s.poll_timeout_s)
        elif not wait:
            got = consumer.consume(min(limit, CHUNK), 0)
        else:
            got = consumer.consume(min(limit, CHUNK), 0) if committing else []
            if not got:
                settle()  # nothing to make meanwhile: take the commit's outcome now
                # consume(n, t) waits for all n: take the first record as soon as it comes
                got = consumer.consume(1, s.poll_timeout_s)
                if got and limit > 1:
                    got += consumer.consume(min(limit, CHUNK) - 1, 0)
        return self.accept(got)

    def accept(self, got: list[Message]) -> list[Message]:
        """The records of ``got`` (errors handed to ``on_error``, partition ends skipped),
        their partitions' positions moved past them."""
        # the hot path (every input passes here): one pass to find errors, which are rare,
        # and one to take the last offset of each partition (a batch is in offset order
        # within a partition) in a comprehension
        for m in got:
            if m.error() is not None:
                got = self._without_errors(got)
                break
        if not got:
            return got
        positions, topic = self.positions, self._only_topic
        if topic is not None:
            for part, offset in {m.partition(): m.offset() for m in got}.items():
                positions[(topic, part)] = offset + 1
        else:
            for tp, offset in {(m.topic(), m.partition()): m.offset() for m in got}.items():
                positions[tp] = offset + 1
        return got

    def _without_errors(self, got: list[Message]) -> list[Message]:
        out = []
        for m in got:
            err = m.error()
            if err is None:
                out.append(m)
            elif err.code() == KafkaError._PARTITION_EOF:
                continue
            elif err.fatal():
                raise KafkaException(err)
            else:
                self.on_error(err, m.topic())
        return out

    def offsets(self, held: dict[tuple[str, int], int]) -> list[TopicPartition]:
        """The offsets to commit, per partition in order: the position, or the first
        offset the work still ``held`` there if that is lower."""
        out = []
        for (topic, part), pos in sorted(self.positions.items()):
            h = held.get((topic, part))
            out.append(TopicPartition(topic, part, min(pos, h) if h is not None else pos))
        return out

    def forget(self, partitions: Iterable[tuple[str, int]]) -> None:
        """Drop the positions of ``partitions`` (revoked: their next owner starts at the
        committed offsets)."""
        for tp in partitions:
            self.positions.pop(tp, None)


__all__ = ["CHUNK", "Intake"]
