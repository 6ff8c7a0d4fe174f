"""Side readers: follow a retained topic (e.g. ``trajectories``) from its beginning.

Stateful pre-rollout processors (GRESO, curriculum) learn from the trajectory groups that
were produced, not from what they consumed. They read the whole retained topic without a
consumer group, like a global table: on ``open`` they catch up from offset 0 (this is how
their state survives a restart), then drain what arrives as they go.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.codec import RecordDecodeError
from astraflow.dataflow.base import Processor, ProcessorContext
from astraflow.records import Record, TrajectoryGroup

log = logging.getLogger("astraflow.follower")


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
    """Reads every partition of ``topic`` from the beginning, without committing anything.

    ``catch_up`` reads up to the end the topic had when it was called (the last stable
    offset, as readers are ``read_committed``); ``poll`` drains what has arrived since,
    without blocking. Records that fail to decode are logged and skipped: the processors
    that consume the topic dead-letter them.
    """

    def __init__(self, config, codec, topic: str, expect: type[Record] | None = None,
                 group: str = "astraflow-follower"):
        self.codec = codec
        self.topic = topic
        self.expect = expect
        self.consumer = Consumer(config.consumer_conf(group, **{
            "enable.auto.commit": False, "enable.partition.eof": True,
            "client.id": f"follower-{topic}"}))
        md = self.consumer.list_topics(timeout=10).topics
        if topic not in md or md[topic].error is not None:
            self.consumer.close()
            raise KafkaException(f"topic {topic} to follow does not exist")
        self.partitions = sorted(md[topic].partitions)
        self.consumer.assign([TopicPartition(topic, p, OFFSET_BEGINNING)
                              for p in self.partitions])

    def catch_up(self, timeout_s: float = 120.0) -> list[Observed]:
        """Everything up to the current end of every partition (blocks until there)."""
        out: list[Observed] = []
        at_end: set[int] = set()
        deadline = time.monotonic() + timeout_s
        while len(at_end) < len(self.partitions):
            if time.monotonic() > deadline:
                raise TimeoutError(f"catching up on {self.topic} took over {timeout_s:.0f}s")
            out += self._consume(0.2, at_end)
        return out

    def poll(self) -> list[Observed]:
        """What has arrived since the last call; never blocks."""
        out: list[Observed] = []
        while True:
            got = self._consume(0.0, set())
            if not got:
                return out
            out += got

    def _consume(self, timeout: float, at_end: set[int]) -> list[Observed]:
        out = []
        for m in self.consumer.consume(500, timeout):
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    at_end.add(m.partition())
                    continue
                raise KafkaException(err)
            try:
                rec = self.codec.decode(m.value(), m.topic(), m.partition(), m.offset(),
                                        expect=self.expect)
            except RecordDecodeError as e:
                log.warning("follower of %s: skipping undecodable record: %s", self.topic, e)
                continue
            out.append(Observed(m.partition(), m.offset(), rec))
        return out

    def close(self) -> None:
        """Close the consumer."""
        self.consumer.close()


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
                                     group=f"astraflow-follower.{context.component_id}")
            for obs in follower.catch_up():
                self.observe(obs)
            self.observations = follower

    def close(self) -> None:
        if isinstance(self.observations, TopicFollower):
            self.observations.close()

    def drain(self) -> None:
        """Feed every newly observed record to ``observe``."""
        if self.observations is not None:
            for obs in self.observations.poll():
                self.observe(obs)

    def observe(self, obs: Observed) -> None:
        """Learn from one observed record."""
        raise NotImplementedError
