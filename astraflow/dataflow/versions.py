"""The latest published weight version of each policy, read from ``weights.<policy>``."""

from __future__ import annotations

from typing import Protocol

from confluent_kafka import OFFSET_BEGINNING, Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.records import WeightManifest


class VersionSource(Protocol):
    """Anything that knows the latest published version per policy."""

    def refresh(self) -> object: ...

    def latest(self, policy: str) -> int | None: ...


class LatestVersions:
    """Follows every partition of the given ``weights.<policy>`` topics without a group.

    Every copy of a processor reads the whole weights topics (they are small: manifests
    only), like a global table; ``refresh`` drains what has arrived without blocking.
    """

    def __init__(self, config, codec, topics: dict[str, str]):
        self.codec = codec
        self._topic_policy = {topic: policy for policy, topic in topics.items()}
        self._latest: dict[str, int] = {}
        self.consumer = Consumer(config.consumer_conf(
            "astraflow-versions", **{"enable.auto.commit": False, "client.id": "versions"}))
        md = self.consumer.list_topics(timeout=10).topics
        parts = []
        for topic in topics.values():
            if topic not in md:
                raise KafkaException(f"weights topic {topic} does not exist")
            parts += [TopicPartition(topic, p, OFFSET_BEGINNING) for p in md[topic].partitions]
        self.consumer.assign(parts)

    def refresh(self, timeout: float = 0.0) -> list[WeightManifest]:
        """Drain what has arrived; returns the manifests read by this call."""
        fresh: list[WeightManifest] = []
        while True:
            msgs = self.consumer.consume(500, timeout)
            if not msgs:
                return fresh
            for m in msgs:
                if m.error():
                    if m.error().code() != KafkaError._PARTITION_EOF:
                        raise KafkaException(m.error())
                    continue
                manifest = self.codec.decode(m.value(), m.topic(), m.partition(), m.offset(),
                                             expect=WeightManifest)
                fresh.append(manifest)
                policy = self._topic_policy[m.topic()]
                self._latest[policy] = max(self._latest.get(policy, -1), manifest.version)
            timeout = 0.0

    def latest(self, policy: str) -> int | None:
        return self._latest.get(policy)

    def close(self) -> None:
        self.consumer.close()


class StaticVersions:
    """A fixed table of versions (for decision-logic tests and offline replays)."""

    def __init__(self, versions: dict[str, int] | None = None):
        self.versions = dict(versions or {})

    def refresh(self) -> None:
        pass

    def latest(self, policy: str) -> int | None:
        return self.versions.get(policy)
