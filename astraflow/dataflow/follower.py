"""Side readers: follow a retained topic (e.g. ``trajectories``) from its beginning.

Stateful pre-rollout processors (GRESO, curriculum) learn from the trajectory groups that
were produced, not from what they consumed. They read the whole retained topic without a
consumer group, like a global table: on ``open`` they catch up from offset 0 (this is how
their state survives a restart), then drain what arrives as they go.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from astraflow.dataflow.base import Processor, ProcessorContext, SideAccess
from astraflow.kafka.config import TABLE_GROUP
from astraflow.kafka.table import Entry, TopicReader
from astraflow.wire.records import Record, TrajectoryGroup


@dataclass
class Observed:
    """One record read by a follower, with where it was read."""

    partition: int
    offset: int
    record: Record


class ObservationSource(Protocol):
    """Anything that hands out newly observed records (a follower, or a list in tests)."""

    def poll(self) -> list[Observed]: ...

    def close(self) -> None: ...


class TopicFollower:
    """Reads every partition of ``topic`` from the beginning, without committing anything
    (a ``TopicReader``).

    ``catch_up`` reads up to the end the topic had when it was called (the last stable
    offset, as readers are ``read_committed``); ``poll`` drains what has arrived since,
    without blocking. Records that fail to decode are logged and skipped: the processors
    that consume the topic dead-letter them.
    """

    def __init__(self, config, codec, topic: str, expect: type[Record] | None = None,
                 client_id: str | None = None):
        self.topic = topic
        self.reader: TopicReader[Record] = TopicReader(
            config, topic, expect, codec=codec, client_id=client_id or f"follower-{topic}")

    def catch_up(self, timeout_s: float = 120.0) -> list[Observed]:
        """Everything up to the current end of every partition (blocks until there)."""
        out = _observed(self.reader.catch_up(timeout_s))
        if not self.reader.caught_up():
            raise TimeoutError(f"catching up on {self.topic} took over {timeout_s:.0f}s")
        return out

    def poll(self) -> list[Observed]:
        """What has arrived since the last call; never blocks."""
        return _observed(self.reader.poll(0.0))

    def close(self) -> None:
        """Close the consumer."""
        self.reader.close()


def _observed(entries: list[Entry[Record]]) -> list[Observed]:
    return [Observed(e.partition, e.offset, e.value) for e in entries if e.value is not None]


class StaticObservations:
    """Hands out records pushed with ``add`` (decision-logic tests, offline replays)."""

    def __init__(self) -> None:
        self.pending: list[Observed] = []

    def add(self, record: Record, partition: int = 0, offset: int | None = None) -> None:
        """Queue ``record`` as if read from ``partition``."""
        self.pending.append(Observed(partition, len(self.pending) if offset is None else offset,
                                     record))

    def poll(self) -> list[Observed]:
        """Everything added since the last call."""
        out, self.pending = self.pending, []
        return out

    def close(self) -> None:
        """Nothing to close."""


class ObservingProcessor(Processor):
    """A processor that learns from a followed topic (``options.observe_topic``).

    ``open`` catches up on the whole retained topic before the first input is processed,
    so the state learnt from it is rebuilt after a restart; ``drain`` feeds what arrived
    since to ``observe``. Pass ``observations`` to drive it without Kafka.
    """

    def __init__(self, name: str, inputs: list[str], outputs: list[str], options: Any = None,
                 observations: ObservationSource | None = None):
        super().__init__(name, inputs, outputs, options)
        self.observations = observations

    def open(self, context: ProcessorContext) -> None:
        if self.observations is None:
            topic = context.topology.full_name(self.options.observe_topic)
            follower = TopicFollower(context.config, context.codec, topic,
                                     expect=TrajectoryGroup,
                                     client_id=f"follower.{context.component_id}")
            for obs in follower.catch_up():
                self.observe(obs)
            self.observations = follower

    def close(self) -> None:
        if isinstance(self.observations, TopicFollower):
            self.observations.close()

    def side_access(self, topology: Any) -> SideAccess:
        """It follows ``options.observe_topic`` without a group."""
        return SideAccess(reads=(self.options.observe_topic,), reader_groups=(TABLE_GROUP,))

    def drain(self) -> None:
        """Feed every newly observed record to ``observe``."""
        if self.observations is not None:
            for obs in self.observations.poll():
                self.observe(obs)

    def observe(self, obs: Observed) -> None:
        """Learn from one observed record."""
        raise NotImplementedError
