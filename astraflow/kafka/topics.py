"""Topics as the cluster should hold them (``ResolvedTopic``, from a topology), their
idempotent creation, and topic inspection."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
    TopicMetadata,
)
from pydantic import BaseModel

from astraflow.errors import AstraflowError
from astraflow.kafka.replication import replication


class ResolvedTopic(BaseModel):
    """A topic as created on the cluster."""

    name: str  # logical name, e.g. "tasks"
    full_name: str  # with the run prefix, e.g. "demo.tasks"
    partitions: int
    replication_factor: int | None  # None: the cluster's default (``for_cluster``)
    configs: dict[str, str]
    schema_type: Any  # record class
    replication_key: str = "topic_defaults.replication_factor"  # the key that sets it

    def describe(self) -> str:
        return f"{self.full_name} ({self.partitions} partitions, {self.schema_type.__name__})"

    def for_cluster(self, brokers: int, replicas: int | None = None) -> ResolvedTopic:
        """This topic on a cluster of ``brokers`` brokers: its replication factor set
        (``min(3, brokers)`` unless the topology gives one) and ``min.insync.replicas``
        (2 from 3 replicas, unless the topology's configs set it). ``replicas``: those the
        topic has already (Kafka keeps them), which its ``min.insync.replicas`` follows.
        A ``ReplicationError`` naming the key when the cluster is too small."""
        if replicas is not None:  # however many brokers answer now
            brokers, explicit = replicas, replicas
        else:
            explicit = self.replication_factor
        rf, configs = replication(brokers, explicit, self.replication_key, self.configs,
                                  f"topics.{self.name}.configs.min.insync.replicas")
        return self.model_copy(update={"replication_factor": rf, "configs": configs})



@dataclass
class TopicChange:
    topic: str
    action: str  # created | unchanged | updated
    detail: str = ""


def apply_topics(
    admin: AdminClient, topics: list[ResolvedTopic], timeout: float = 30.0
) -> list[TopicChange]:
    """Create missing topics, grow partition counts and align configs. Safe to re-run.

    A topic's replication factor is the topology's, else ``min(3, brokers)``, and its
    ``min.insync.replicas`` 2 from 3 replicas on (``ResolvedTopic.for_cluster``); an
    existing topic keeps its replicas (the change's detail says when the topology asks
    for other)."""
    md = admin.list_topics(timeout=timeout)
    existing = md.topics
    brokers = len(md.brokers)
    new = [t.for_cluster(brokers) for t in topics if t.full_name not in existing]
    changes = _create(admin, new, timeout)
    for t in topics:
        if t.full_name in existing:
            changes.append(_align(admin, t, existing[t.full_name]))
    return changes


def _create(admin: AdminClient, topics: list[ResolvedTopic], timeout: float,
            ) -> list[TopicChange]:
    if not topics:
        return []
    futures = admin.create_topics(
        [NewTopic(t.full_name, t.partitions, t.replication_factor, config=t.configs)
         for t in topics],
        operation_timeout=timeout,
    )
    changes = []
    for name, fut in futures.items():
        try:
            fut.result()
            changes.append(TopicChange(name, "created"))
        except KafkaException as e:
            if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                raise
            changes.append(TopicChange(name, "unchanged", "created concurrently"))
    _await_usable(admin, {t.full_name: t.partitions for t in topics}, timeout)
    return changes


def _await_usable(admin: AdminClient, partitions: dict[str, int], timeout: float) -> None:
    """Wait until every topic of ``partitions`` (name -> partition count) is in the
    metadata with a leader for each partition. The controller accepts a topic before the
    brokers' metadata caches have it: a client that opens it at once (``up``'s status
    table) would otherwise be told it does not exist. ``KafkaException`` after
    ``timeout`` seconds, naming what is still missing."""
    deadline = time.monotonic() + timeout
    while True:
        md = admin.list_topics(timeout=max(0.1, deadline - time.monotonic())).topics
        waiting = [n for n, count in partitions.items()
                   if n not in md or md[n].error is not None
                   or len(md[n].partitions) < count
                   or any(p.leader < 0 for p in md[n].partitions.values())]
        if not waiting:
            return
        if time.monotonic() >= deadline:
            raise KafkaException(KafkaError(
                KafkaError.UNKNOWN_TOPIC_OR_PART,
                f"topics created but without leaders after {timeout:.0f} s: "
                f"{', '.join(sorted(waiting))}"))
        time.sleep(0.1)  # the brokers' metadata catches up within moments


def _align(admin: AdminClient, wanted: ResolvedTopic, md: TopicMetadata) -> TopicChange:
    """Grow ``wanted``'s partitions and set its configs on the existing topic ``md``."""
    details = []
    replicas = max((len(p.replicas) for p in md.partitions.values()), default=1)
    note = ([] if wanted.replication_factor in (None, replicas) else [
        f"has replication factor {replicas} (the topology asks {wanted.replication_factor}; "
        "Kafka changes it only by reassigning the partitions)"])
    t = wanted.for_cluster(replicas, replicas=replicas)
    have = len(md.partitions)
    if have < t.partitions:
        admin.create_partitions([NewPartitions(t.full_name, t.partitions)])[
            t.full_name
        ].result()
        details.append(f"partitions {have} -> {t.partitions}")
    elif have > t.partitions:
        details.append(f"has {have} partitions (> {t.partitions}; Kafka cannot shrink)")
    resource = ConfigResource(ConfigResource.Type.TOPIC, t.full_name)
    current = admin.describe_configs([resource])[resource].result()
    differing = {
        k: v for k, v in t.configs.items() if k not in current or current[k].value != v
    }
    if differing:
        entries = [
            ConfigEntry(k, v, incremental_operation=AlterConfigOpType.SET)
            for k, v in differing.items()
        ]
        res = ConfigResource(
            ConfigResource.Type.TOPIC, t.full_name, incremental_configs=entries
        )
        admin.incremental_alter_configs([res])[res].result()
        details.append("configs " + ", ".join(f"{k}={v}" for k, v in differing.items()))
    return TopicChange(t.full_name, "updated" if details else "unchanged",
                       "; ".join(details + note))


class MissingTopicsError(AstraflowError, RuntimeError):
    """A component's topics do not exist on the cluster (one line, no traceback)."""


def missing_topics(admin: AdminClient, names: list[str], timeout: float = 10.0) -> list[str]:
    existing = admin.list_topics(timeout=timeout).topics
    return [n for n in names if n not in existing]


def describe_topic(admin: AdminClient, name: str, timeout: float = 10.0) -> dict[str, object]:
    """Partitions (leader, replicas) and non-default configs of one topic."""
    md = admin.list_topics(name, timeout=timeout).topics.get(name)
    if md is None or md.error is not None:
        raise KafkaException(md.error if md else f"topic {name} not found")
    resource = ConfigResource(ConfigResource.Type.TOPIC, name)
    configs = admin.describe_configs([resource])[resource].result()
    return {
        "name": name,
        "partitions": {
            p.id: {"leader": p.leader, "replicas": list(p.replicas), "isrs": list(p.isrs)}
            for p in md.partitions.values()
        },
        "configs": {k: c.value for k, c in sorted(configs.items()) if not c.is_default},
    }
