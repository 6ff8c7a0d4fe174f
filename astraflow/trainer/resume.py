"""Resuming a trainer from a written state older than its newest published version.

Trainer states are written every N versions (``astraflow.trainer.state``), so after a
crash the newest recorded state (version k) is usually older than the newest published
version L. The versions k+1..L were trained from batches whose positions each manifest
names (``meta`` ``batch_partition``/``batch_offset``, next to ``batch_id``): the trainer
re-reads them, retrains them *without publishing*, and checks that each recomputed version
rounds to the published one bit for bit. Only then does it go on from L; a difference
(other flags, thread count, device, torch version) is refused, since the published history
could not be continued exactly.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from typing import Any

from confluent_kafka import Consumer, KafkaError, TopicPartition

from astraflow.kafka.config import TRAINER_REPLAY_GROUP_PREFIX, KafkaConfig
from astraflow.trainer.state import STATE_FILES_KEY, recorded_state_version
from astraflow.weights.delta import state_bytes_equal
from astraflow.wire.records import Batch, BlobRef, WeightManifest

log = logging.getLogger("astraflow.trainer")


def newest_state(manifests: list[WeightManifest]) -> tuple[int, dict[str, str]]:
    """The newest version whose state a manifest records, and that manifest's ``meta``;
    ``(0, {})`` when none does (version 0 is the model directory)."""
    best: tuple[int, dict[str, str]] = (0, {})
    for m in manifests:
        v = recorded_state_version(m.version, m.meta)
        if v is not None and (not best[1] or v > best[0]):
            best = (v, m.meta)
    return best


def recorded_states(manifests: list[WeightManifest]) -> list[tuple[int, list[BlobRef]]]:
    """Every recorded state (version, its blobs), oldest first, once each."""
    out: dict[int, list[BlobRef]] = {}
    for m in manifests:
        v = recorded_state_version(m.version, m.meta)
        if v is None or v in out:
            continue
        out[v] = [
            BlobRef(uri=m.meta[f"{k}_uri"], bytes=int(m.meta[f"{k}_bytes"]),
                    sha256=m.meta[f"{k}_sha256"])
            for k in ("optimizer", "master")
            if f"{k}_uri" in m.meta
        ]
        if STATE_FILES_KEY in m.meta:  # a sharded state's files in the blob store
            out[v] += [BlobRef(uri=f["uri"], bytes=int(f["bytes"]), sha256=f["sha256"])
                       for f in json.loads(m.meta[STATE_FILES_KEY])]
    return sorted(out.items())


def first_difference(a: dict[str, Any], b: dict[str, Any]) -> str | None:
    """The name of the first tensor whose bytes differ (or that one side lacks)."""
    if set(a) != set(b):
        return sorted(set(a) ^ set(b))[0]
    for k in a:
        if not state_bytes_equal({k: a[k]}, {k: b[k]}):
            return k
    return None


class BatchReader:
    """Reads single ``Batch`` records by position (no consumer group, read_committed)."""

    def __init__(self, config: KafkaConfig, topic: str, codec: Any, timeout_s: float = 30.0):
        self.topic = topic
        self.codec = codec
        self.timeout_s = timeout_s
        self.consumer = Consumer(config.consumer_conf(
            f"{TRAINER_REPLAY_GROUP_PREFIX}{uuid.uuid4().hex[:8]}",
            **{"enable.partition.eof": True}))

    def read(self, partition: int, offset: int) -> Batch:
        where = f"{self.topic}[{partition}]@{offset}"
        self.consumer.assign([TopicPartition(self.topic, partition, offset)])
        deadline = time.monotonic() + self.timeout_s
        try:
            while time.monotonic() < deadline:
                msg = self.consumer.poll(0.5)
                if msg is None:
                    continue
                err = msg.error()
                if err is not None:
                    if err.code() == KafkaError._PARTITION_EOF:
                        raise RuntimeError(f"{where}: no such record (the topic ends before it)")
                    raise RuntimeError(f"reading {where}: {err}")
                if msg.offset() != offset:
                    raise RuntimeError(
                        f"{where}: no longer on the topic (the next record is at "
                        f"{msg.offset()}: deleted by retention?)")
                rec = self.codec.decode(msg.value(), self.topic, partition, offset, expect=Batch)
                assert isinstance(rec, Batch)
                return rec
        finally:
            self.consumer.unassign()
        raise RuntimeError(f"{where}: not read within {self.timeout_s:.0f}s")

    def close(self) -> None:
        self.consumer.close()


def recompute(
    trainer: Any,
    follower: Any,
    manifests: list[WeightManifest],
    start: int,
    latest: int,
    reader: BatchReader,
    where: str,
) -> float:
    """Retrain versions ``start+1..latest`` from their batches (``trainer`` holds the state
    of ``start``, ``follower`` the published weights of ``start``), checking each against
    the published version; ``follower`` ends at ``latest``. Returns the seconds taken."""
    t0 = time.perf_counter()
    by_version = {m.version: m for m in manifests}
    for v in range(start + 1, latest + 1):
        m = by_version.get(v)
        if m is None:
            raise RuntimeError(f"{where}: version {v} has no manifest; cannot recompute it")
        if "batch_offset" not in m.meta or "batch_partition" not in m.meta:
            raise RuntimeError(
                f"{where}: version {v} names no batch position (meta batch_partition/"
                f"batch_offset), so it cannot be recomputed from the state of version "
                f"{start}; cannot resume exactly")
        batch = reader.read(int(m.meta["batch_partition"]), int(m.meta["batch_offset"]))
        if "batch_id" in m.meta and batch.batch_id != m.meta["batch_id"]:
            raise RuntimeError(
                f"{where}: version {v} was trained on batch {m.meta['batch_id']}, its "
                f"position holds {batch.batch_id}; cannot resume exactly")
        metrics = trainer.train_step(batch, current_version=v - 1)
        follower.update(v)
        bad = first_difference(trainer.published_state(), follower.state)
        if metrics["trainer/loss_tokens"] == 0 or bad is not None:
            raise RuntimeError(
                f"{where}: version {v} recomputed from the state of version {start} differs "
                f"from the published version {v} (tensor {bad or 'all: nothing trained'}); "
                "cannot resume exactly: restart with the flags, --threads and device the "
                "run was started with")
        log.info("recomputed version %d from batch %s: equals the published one", v,
                 batch.batch_id)
    return time.perf_counter() - t0


__all__ = ["BatchReader", "first_difference", "newest_state", "recompute", "recorded_states"]
