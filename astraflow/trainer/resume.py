"""Resuming a trainer from a written state older than its newest published version.

Trainer states are written every N versions (``astraflow.trainer.state``), so after a
crash the newest recorded state (version k) is usually older than the newest published
version L. The versions k+1..L were trained from batches whose positions each manifest
names (``meta`` ``batch_partition``/``batch_offset``, next to ``batch_id``): the trainer
re-reads them and retrains them *without publishing*, checking that each recomputed version
rounds to the published one bit for bit.

When every one does, the trainer goes on from L exactly as an uninterrupted one would.
When one differs (a backward that is not bit-reproducible, as CUDA's is without
``deterministic``; other flags, thread count, device or torch version) or its batch trains
nothing when recomputed, the published history cannot be continued exactly; the recompute
still retrains every batch of k+1..L once, so the recomputed weights have seen exactly the
batches of version L. The service then publishes them as a *rebase*: version L+1, a full
checkpoint only, whose ``meta`` says ``rebase_of`` L and why (``rebase_reason``), whose
consumed offsets are L's and which records its own trainer state; followers move to it
as to any full checkpoint, and training goes on from it. No batch is lost or trained twice.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from typing import Any

import torch
from confluent_kafka import Consumer, KafkaError, TopicPartition

from astraflow.kafka.config import TRAINER_REPLAY_GROUP_PREFIX, KafkaConfig
from astraflow.trainer.state import STATE_FILES_KEY, recorded_state_version
from astraflow.weights.bits import state_bytes_equal
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


# test hook: after recomputing this version, nudge the weights (as a GPU's
# non-reproducible backward would), so the recompute differs from the published version
PERTURB_ENV = "ASTRAFLOW_TRAINER_RECOMPUTE_PERTURB"

# a rebase version's meta: the version it follows (whose batches it has trained), and why
REBASE_KEY = "rebase_of"
REBASE_REASON_KEY = "rebase_reason"


# cuBLAS picks its reduction order per call unless its workspace is fixed (CUDA's note on
# reproducibility); set before cuBLAS starts, i.e. before the first CUDA matmul
CUBLAS_WORKSPACE = ":4096:8"


def make_deterministic() -> None:
    """What ``deterministic: true`` sets, in each trainer process before any CUDA work, so
    that a recompute reproduces the published versions bit for bit on the same hardware
    and software: deterministic kernels only (an op without one fails, naming it), a fixed
    cuBLAS workspace (``CUBLAS_WORKSPACE_CONFIG``, unless already set), cuDNN's
    deterministic algorithms and no autotuning (``cudnn.benchmark`` would pick by timing).
    On a CPU it costs nothing that matters; on a GPU some kernels are slower."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


def trained_batches(manifests: list[WeightManifest], version: int) -> int:
    """How many batches the weights of ``version`` have trained (its manifest's
    ``trainer_step``: the schedule's step count); ``version`` when no manifest of it is
    left (before rebases, versions and trained batches are one count)."""
    steps = [m.trainer_step for m in manifests if m.version == version]
    return max(steps) if steps else version


@dataclass
class Recomputed:
    """What ``recompute`` found: the seconds it took, and ``differs``: None when every
    recomputed version equals the published one, else the first difference (the trainer
    then holds weights that trained the same batches as the newest version but differ
    from it: they are published as a rebase)."""

    seconds: float
    differs: str | None = None


def _perturb(trainer: Any) -> None:
    """``PERTURB_ENV``: shift the first trained floating tensor by a hundredth of its
    largest magnitude (far more than one step of its published rounding)."""
    with torch.no_grad():
        for t in trainer.trained_state().values():
            if t.is_floating_point():
                local = t.to_local() if hasattr(t, "to_local") else t
                local.add_(1e-2 * (float(local.abs().max()) if local.numel() else 0.0) + 1e-3)
                break
    trainer.refresh_published()


def _agree(trainer: Any, differs: bool) -> bool:
    """Whether any rank of the trainer's group found a difference (every rank must take
    the same way on: rebase or not)."""
    return trainer.group.max_floats({"differs": float(differs)})["differs"] > 0


def recompute(
    trainer: Any,
    follower: Any,
    manifests: list[WeightManifest],
    start: int,
    latest: int,
    reader: BatchReader,
    where: str,
) -> Recomputed:
    """Retrain versions ``start+1..latest`` from their batches (``trainer`` holds the state
    of ``start``, ``follower`` the published weights of ``start``), checking each against
    the published version until one differs; every batch is retrained either way. With
    no difference ``follower`` ends at ``latest``. A version that cannot be retrained at
    all (no manifest, no batch position, another batch at its position) is refused:
    ``RuntimeError``."""
    t0 = time.perf_counter()
    by_version = {m.version: m for m in manifests}
    perturb_at = int(os.environ.get(PERTURB_ENV) or -1)
    differs: str | None = None
    for v in range(start + 1, latest + 1):
        m = by_version.get(v)
        if m is None:
            raise RuntimeError(f"{where}: version {v} has no manifest; cannot recompute it")
        if "batch_offset" not in m.meta or "batch_partition" not in m.meta:
            raise RuntimeError(
                f"{where}: version {v} names no batch position (meta batch_partition/"
                f"batch_offset), so it cannot be recomputed from the state of version "
                f"{start}; cannot resume")
        batch = reader.read(int(m.meta["batch_partition"]), int(m.meta["batch_offset"]))
        if "batch_id" in m.meta and batch.batch_id != m.meta["batch_id"]:
            raise RuntimeError(
                f"{where}: version {v} was trained on batch {m.meta['batch_id']}, its "
                f"position holds {batch.batch_id}; cannot resume")
        metrics = trainer.train_step(batch, current_version=v - 1)
        if v == perturb_at:
            _perturb(trainer)
        if differs is not None:
            log.info("recomputed version %d from batch %s (after a difference: not "
                     "compared)", v, batch.batch_id)
            continue
        follower.update(v)
        # each rank its rows (the follower holds them alone when it follows its part)
        bad = trainer.published_difference(follower.state,
                                           part=getattr(follower, "part", None) is not None)
        nothing = metrics["trainer/loss_tokens"] == 0
        if _agree(trainer, nothing or bad is not None):
            differs = (f"version {v} recomputed from the state of version {start} "
                       + ("trained nothing" if nothing else
                          f"differs from the published one (tensor {bad or 'on another rank'})"))
            log.warning("%s: %s; the versions after it are retrained without comparing, "
                        "the result is published as a rebase", where, differs)
            continue
        log.info("recomputed version %d from batch %s: equals the published one", v,
                 batch.batch_id)
    return Recomputed(time.perf_counter() - t0, differs)


__all__ = ["CUBLAS_WORKSPACE", "PERTURB_ENV", "REBASE_KEY", "REBASE_REASON_KEY", "BatchReader",
           "Recomputed",
           "first_difference", "make_deterministic", "newest_state", "recompute",
           "recorded_states", "trained_batches"]
