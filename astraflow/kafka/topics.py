"""Idempotent topic creation from a topology, and topic inspection."""

from __future__ import annotations

from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import (
    AdminClient,
    AlterConfigOpType,
    ConfigEntry,
    ConfigResource,
    NewPartitions,
    NewTopic,
)

from astraflow.errors import AstraflowError
from astraflow.topology import ResolvedTopic


@dataclass
class TopicChange:
    topic: str
    action: str  # created | unchanged | updated
    detail: str = ""


def apply_topics(
    admin: AdminClient, topics: list[ResolvedTopic], timeout: float = 30.0
) -> list[TopicChange]:
    """Create missing topics, grow partition counts and align configs. Safe to re-run."""
    existing = admin.list_topics(timeout=timeout).topics
    changes: list[TopicChange] = []
    to_create = [t for t in topics if t.full_name not in existing]
    if to_create:
        futures = admin.create_topics(
            [
                NewTopic(t.full_name, t.partitions, t.replication_factor, config=t.configs)
                for t in to_create
            ],
            operation_timeout=timeout,
        )
        for name, fut in futures.items():
            try:
                fut.result()
                changes.append(TopicChange(name, "created"))
            except KafkaException as e:
                if e.args[0].code() != KafkaError.TOPIC_ALREADY_EXISTS:
                    raise
                changes.append(TopicChange(name, "unchanged", "created concurrently"))
    for t in topics:
        if t.full_name not in existing:
            continue
        details = []
        have = len(existing[t.full_name].partitions)
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
        changes.append(
            TopicChange(t.full_name, "updated" if details else "unchanged", "; ".join(details))
        )
    return changes


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
