"""``Pauses``: which input partitions the loop's consumer is asked not to fetch from.

Any thread may ask to pause or resume a topic (all its partitions, or some); the loop's
thread applies the requests before each poll, and again after a rebalance (a partition
assigned anew is fetched from unless its topic is paused). A pause of all partitions
covers partitions assigned later; resuming some of them keeps the others paused."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterable
from typing import Protocol

from confluent_kafka import TopicPartition


class _Pausable(Protocol):
    def assignment(self) -> list[TopicPartition]: ...

    def pause(self, partitions: list[TopicPartition]) -> None: ...

    def resume(self, partitions: list[TopicPartition]) -> None: ...


class Pauses:
    """The paused topics and partitions, and the requests not applied yet."""

    def __init__(self) -> None:
        self._requests: queue.SimpleQueue[tuple[str, str, list[int] | None]] = (
            queue.SimpleQueue())
        self.paused: dict[str, set[int] | None] = {}  # full topic -> partitions (None: all)
        self._changed = True  # the assignment changed since they were last applied

    # --- from any thread ---------------------------------------------------------------
    def pause(self, topic: str, partitions: list[int] | None = None) -> None:
        """Ask to stop fetching from ``topic`` (full name), all or some partitions."""
        self._requests.put(("pause", topic, partitions))

    def resume(self, topic: str, partitions: list[int] | None = None) -> None:
        """Ask to fetch from ``topic`` again, all or some partitions."""
        self._requests.put(("resume", topic, partitions))

    # --- on the loop's thread ----------------------------------------------------------
    def assignment_changed(self) -> None:
        """Partitions were assigned or revoked: ``apply`` sets each one's state again."""
        self._changed = True

    def apply(self, consumer: _Pausable) -> None:
        """Take the requests made since the last call and pause or resume the consumer's
        assigned partitions to match (nothing is asked of it when nothing changed)."""
        changed, self._changed = self._changed, False
        while not self._requests.empty():
            op, topic, parts = self._requests.get_nowait()
            changed = True
            self.note(op, topic, parts, consumer.assignment)
        if not changed:
            return
        # a topic none of whose partitions is paused any more is not paused
        self.paused = {t: p for t, p in self.paused.items() if p is None or p}
        to_pause, to_resume = self.split(consumer.assignment())
        if to_pause:
            consumer.pause(to_pause)
        if to_resume:
            consumer.resume(to_resume)

    def note(self, op: str, topic: str, parts: list[int] | None,
             assignment: Callable[[], list[TopicPartition]]) -> None:
        """Record one request (``op``: "pause" or "resume"); ``assignment()`` gives the
        assigned partitions, asked only when some of an all-partitions pause resume."""
        if op == "pause":
            if parts is None:
                self.paused[topic] = None
            elif (current := self.paused.get(topic, set())) is not None:
                self.paused[topic] = current | set(parts)
        elif parts is None:
            self.paused.pop(topic, None)
        elif self.paused.get(topic) is not None:
            self.paused[topic] -= set(parts)
        else:  # resume some of an all-partitions pause: keep the rest paused
            assigned = {tp.partition for tp in assignment() if tp.topic == topic}
            self.paused[topic] = assigned - set(parts)

    def split(self, assigned: Iterable[TopicPartition]
              ) -> tuple[list[TopicPartition], list[TopicPartition]]:
        """``assigned`` as (to pause, to fetch from)."""
        to_pause, to_resume = [], []
        for tp in assigned:
            paused = self.paused.get(tp.topic, set())
            (to_pause if paused is None or tp.partition in paused else to_resume).append(tp)
        return to_pause, to_resume


__all__ = ["Pauses"]
