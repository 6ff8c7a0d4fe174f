"""The trainer process: ``batches.<policy>`` in, versioned weights on ``weights.<policy>`` out.

One Kafka transaction per training step holds the new version's ``WeightManifest``(s), the
consumer offsets of the batch it was trained on (``send_offsets_to_transaction``), any dead
letters and, when due, a ``ComponentStatus``. The weight blobs (delta/full checkpoint) are
written to the blob store *before* the transaction; a crash before the commit leaves only
unreferenced blobs (garbage for ``astraflow weights gc``). Each manifest's ``meta`` names
the batch it was trained on (``batch_id``, ``batch_partition``, ``batch_offset``).

Published weights are the trained (fp32 master) weights rounded to ``publish_dtype`` (bf16
by default), so the deltas are taken between consecutive bf16 versions: bit-exact and
sparse. The *trainer state* (the optimizer state and, when the published weights are a
rounding, the master weights) is written every ``state_interval`` versions by a background
thread (``astraflow.trainer.state``) and recorded in the ``meta`` of the first manifest
committed after the write finished (``state_version``, ``optimizer_uri``/``_sha256``/
``_bytes``, ``master_uri``/...), at the latest ``state_lag`` versions after it; the newest
``keep_optimizer`` recorded states are kept.

Restart (after SIGKILL, anywhere):

1. the transactional producer (id ``<run>.trainer.<policy>.<instance>``) is created first:
   ``init_transactions`` fences a dead predecessor and aborts its open transaction, so
   ``read_committed`` readers are not held up by it;
2. every manifest on ``weights.<policy>`` is read; with a public key configured (signed
   weights) one not signed by its key is refused, logged and dead-lettered, and never
   used (the newest trusted version is L then). The newest recorded state (version k;
   none: version 0, the model directory) is loaded, sha256-verified, and its master weights
   must round to version k's published weights (rebuilt with a ``WeightFollower``) bit for
   bit. With ``publish_dtype`` ``same`` the published weights are the trained ones;
3. the versions k+1..L after it (L the newest published) are retrained from the batches
   their manifests name, without publishing, and compared with the published versions bit
   for bit (``astraflow.trainer.resume``); where one differs, the retrained weights (which
   have trained exactly L's batches) are published as version L+1, a rebase: a full
   checkpoint with L's consumed offsets and its own trainer state (``_rebase``);
4. consumption resumes at the group's committed offsets: version L's ``consumed_offsets``
   (committed in the same transaction), or past them where batches after it were
   dead-lettered or skipped (every group stale; such a batch changes nothing).

So no batch is lost and none is trained twice, and a resumed trainer continues bit for bit
as an uninterrupted one would have (or, after a rebase, from weights that trained the
same batches). Version 0 (the initial weights) is published when
``weights.<policy>`` is empty; version ``k`` is the model after ``k`` batches (less one
for each rebase at or before it: a manifest's ``trainer_step`` is the count).

The service is the Kafka work around parts of their own: the restore (steps 2 and 3,
``astraflow.trainer.restore``), the publishing of versions into the blob store
(``astraflow.trainer.publishing``) and the background state writes (a
``TrainerStateWriter``, ``astraflow.trainer.state``). In a group of processes rank 0 runs
the loop and tells the others what to do in typed records (``astraflow.trainer.commands``).
"""

from __future__ import annotations

import logging
import os
import resource
import signal
import socket
import time
from concurrent.futures import Future
from dataclasses import dataclass, replace
from pathlib import Path

from confluent_kafka import Message

from astraflow.config.topology import PolicySpec, Topology, TrainerSpec
from astraflow.dataflow.runtime import loop_spec
from astraflow.kafka.clients import (
    dead_letter,
    make_codec_for,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.loop import Checkpoint, RuntimeCounters, TransactionalLoop
from astraflow.trainer.checkpoint_writer import CheckpointWriter
from astraflow.trainer.commands import Flush, RankCommand, Stop, TrainStep
from astraflow.trainer.parallel import Group, solo
from astraflow.trainer.publishing import Publishing, delete_blob
from astraflow.trainer.restore import Restorer, resume_positions
from astraflow.trainer.resume import (
    REBASE_KEY,
    REBASE_REASON_KEY,
    recorded_states,
)
from astraflow.trainer.state import (
    StateWriter,
    TrainerStateWriter,
    WrittenState,
)
from astraflow.trainer.trainer import Trainer
from astraflow.weights.signing import refusal_letter, signer_from, verifier_from
from astraflow.wire.codec import RecordDecodeError
from astraflow.wire.records import (
    Batch,
    BlobRef,
    ComponentStatus,
    PartitionOffset,
    WeightManifest,
)
from astraflow.wire.validate import InvalidRecord, check_record

log = logging.getLogger("astraflow.trainer")

CRASH_ENV = "ASTRAFLOW_TRAINER_CRASH_AT"  # test hook: SIGKILL self before committing version N


def default_state_dir(run: str, policy: str) -> Path:
    return Path("~/.local/state/astraflow/trainer").expanduser() / f"{run}.{policy}"


def default_blob_store(topology: Topology, state_dir: Path) -> str:
    """The run's ``weights.blobs`` topic when the topology has one (components then share
    nothing but Kafka), else a directory in the trainer's state dir."""
    if "weights.blobs" in topology.topics:
        return f"kafka://{topology.full_name('weights.blobs')}"
    return (state_dir / "blobs").absolute().as_uri()


@dataclass
class ServiceOptions:
    """What the trainer process of one policy runs with: the policy's typed section
    (``spec``: its model, its ``trainer:``, its sampling, staleness bound and LoRA, each
    setting as declared and validated there, flags applied:
    ``astraflow.config.components.trainer_spec``) and what is the process's own, which no
    topology declares: its instance id and its consumer's timing."""

    policy: str
    spec: PolicySpec
    instance: str | None = None  # default: $ASTRAFLOW_INSTANCE, else 0
    poll_timeout_s: float = 0.5
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 3_600_000  # a step may take long on a big model


def state_lag(spec: TrainerSpec) -> int:
    """Versions after which a state write must be recorded (waited for): ``state_max_lag``,
    at most (and by default) the state interval."""
    return min(spec.state_max_lag or spec.state_interval, spec.state_interval)


@dataclass
class ServiceCounters(RuntimeCounters):
    steps: int = 0


class TrainerService:
    """Runs the trainer of one policy against Kafka until ``stop()`` (or SIGTERM)."""

    def __init__(
        self,
        topology: Topology,
        options: ServiceOptions,
        config: KafkaConfig | None = None,
        trainer: Trainer | None = None,
        group: Group | None = None,
    ):
        """``group``: this process is one rank of a trainer group (``trainer.parallel``);
        rank 0 runs the transactional loop and hands every batch to the others. None: this
        process alone, a group of one (``trainer``'s, else ``solo`` on the spec's
        device)."""
        self.topology = topology
        self.spec = options.spec.trainer  # the policy's trainer: section, as declared
        # the trainer's processes
        self.dist = (group if group is not None else trainer.group if trainer is not None
                     else solo(self.spec.device))
        self.rank = self.dist.rank
        self.options = options
        self.policy = options.policy
        self.config = (config or topology.kafka).effective().for_component(
            f"trainer.{self.policy}", topology.run)
        self.instance = options.instance or os.environ.get("ASTRAFLOW_INSTANCE") or "0"
        self.group = topology.trainer_group(self.policy)
        self.transactional_id = f"{self.group}.{self.instance}"
        self.component_id = f"trainer.{self.policy}/{self.instance}"
        self.batches_topic = topology.full_name(f"batches.{self.policy}")
        self.weights_topic = topology.full_name(f"weights.{self.policy}")
        self.state_dir = (
            Path(self.spec.state_dir).expanduser()
            if self.spec.state_dir
            else (default_state_dir(topology.run, self.policy))
        )
        self.blob_uri = self.spec.blob_store or default_blob_store(topology, self.state_dir)
        self.codec = make_codec_for(self.config)
        # signed weights: every manifest published is signed when a key is configured
        self.signer = signer_from(topology.weight_signing)
        # ... and with a public key, a resume uses only manifests signed by its key
        self.verifier = verifier_from(topology.weight_signing)
        self.counters = ServiceCounters()
        self.trainer = trainer
        self.version: int | None = None
        self.resumed_from: int | None = None
        self.last_metrics: dict[str, float] = {}
        # since this process started: groups dropped as too stale, and batches skipped
        # because every group of theirs was (reported as trainer/stale_*)
        self.stale_dropped = 0
        self.stale_skipped_batches = 0
        self.positions: dict[tuple[str, int], int] = {}
        # recorded trainer states, oldest first: (version, optimizer and master blobs)
        self._state_refs: list[tuple[int, list[BlobRef]]] = []
        self.state_version: int | None = None  # the newest recorded state
        self._loop_start = time.monotonic()
        self._steps = 0  # in this process
        crash = os.environ.get(CRASH_ENV)
        self._crash_at = int(crash) if crash else None
        self._committing: int | None = None  # the version in the open transaction
        self._stopping = False  # a rank > 0 was told to stop
        # publish_overlap: the version whose blobs are being written while the next batch
        # trains; its batch's offset is held back from commits until it is committed
        self._pending: _Pending | None = None
        t = self.spec
        self.overlap = (t.publish_overlap == "on"
                        or (t.publish_overlap == "auto" and t.device.startswith("cuda")))
        self.checkpoint_dir = self._checkpoint_dir()
        self.loop = None if self.rank else TransactionalLoop(
            loop_spec(topology, self.component_id, self.group, self.transactional_id,
                      [f"batches.{self.policy}"], [f"weights.{self.policy}"],
                      max_batch=1, poll_timeout_s=options.poll_timeout_s, keeps_position=True,
                      consumer_options={"session.timeout.ms": options.session_timeout_ms,
                                        "max.poll.interval.ms": options.max_poll_interval_ms}),
            self, self.config, self.codec, before_commit=self._crash_hook)

    def stop(self) -> None:
        """Finish the current step (its transaction included), then return from ``run``."""
        if self.loop is not None:
            self.loop.stop()

    def _checkpoint_dir(self) -> Path | None:
        """Where trainer states go through ``torch.distributed.checkpoint`` (None: the blob
        format in the blob store). A group without ``checkpoint_dir`` writes them there
        first, then puts them into the blob store: only when its processes share a host
        (the directory)."""
        if self.spec.checkpoint_dir:
            return Path(self.spec.checkpoint_dir).expanduser()
        if self.dist.world == 1:
            return None
        if os.environ.get("LOCAL_WORLD_SIZE", str(self.dist.world)) != str(self.dist.world):
            raise ValueError("trainer processes on several hosts write their states to a "
                             "directory every host mounts: set trainer.checkpoint_dir "
                             "(--checkpoint-dir)")
        return self.state_dir / "checkpoints" / f"{self.policy}.staging"

    # --- start-up ------------------------------------------------------------------------
    def _open(self):
        from astraflow.weights.stores import open_store

        self.store = open_store(self.blob_uri, self.config)
        if self.trainer is None:
            self.trainer = Trainer.for_policy(self.options.spec, self.policy,
                                              group=self.dist)
        self.writer: TrainerStateWriter
        if self.checkpoint_dir is None:
            self.writer = StateWriter(self.store, self.policy, self.trainer)
        else:  # DCP; in the blob store after all when no checkpoint_dir was given
            into_store = self.store if (self.rank == 0 and not self.spec.checkpoint_dir
                                        ) else None
            self.writer = CheckpointWriter(self.trainer, self.checkpoint_dir, self.policy,
                                           store=into_store, owner=self.rank == 0)
        lora = self.trainer.lora
        self.publishing = Publishing(
            self.trainer, self.store, self.policy, anchor_interval=self.spec.anchor_interval,
            keep_versions=self.spec.keep_versions, model_path=self.options.spec.model,
            lora=lora,
            signer=self.signer, name=self.component_id)
        self.restorer = Restorer(
            self.trainer, self.store, self.config, self.codec, policy=self.policy,
            weights_topic=self.weights_topic, batches_topic=self.batches_topic,
            state_dir=self.state_dir, lora=lora, verifier=self.verifier,
            name=self.component_id)

    def _restore(self) -> None:
        """Steps 2 and 3 of a restart (the module docstring) by the ``Restorer``; then
        the service takes up where it arrived: its version, positions and recorded states,
        a rebase when the recompute differs, or version 0 on an empty topic."""
        manifests = self.restorer.read_manifests()
        self.publishing.history = list(manifests)
        if not manifests:
            self._publish_initial()
            return
        t0 = time.perf_counter()
        r = self.restorer.restore(manifests)
        if r.published is not None:
            self.publishing.restart(version=r.latest, state=r.published, part=r.part)
        last = r.last
        self.positions = {(p.topic, p.partition): p.offset for p in last.consumed_offsets}
        self.version = self.resumed_from = r.latest
        self.state_version = r.start if r.recorded else None
        self._state_refs = recorded_states(manifests)
        self._drop_old_states()
        if r.differs is not None:
            self._rebase(last, r.differs)
        if self.loop is not None:  # rank 0 alone, after the group's last collective here
            self.loop.positions.update(resume_positions(
                self.config, self.group, self.positions, r.latest, self.component_id))
        log.info(
            "%s: resumed at version %d from the state of version %d (%d manifests applied, "
            "%d bytes); optimizer state %s; master weights %s; recomputed versions %s in "
            "%.2fs%s; %.2fs in all; consuming from %s",
            self.component_id,
            r.latest,
            r.start,
            r.applied,
            r.bytes_fetched,
            r.optimizer,
            r.master,
            f"{r.start + 1}..{r.latest}" if r.latest > r.start else "none",
            r.replay_seconds,
            "" if r.differs is None else f", published as rebase version {self.version}",
            time.perf_counter() - t0,
            _fmt_positions(self.positions) or "the group's committed offsets",
        )

    def _rebase(self, last: WeightManifest, why: str) -> None:
        """Publish what the recompute arrived at as version ``last.version + 1``: a full
        checkpoint (nothing to take a delta from: the publisher starts without a base)
        whose meta says it rebases ``last`` and why, with ``last``'s consumed offsets (it
        has trained exactly the batches ``last`` had) and its own trainer state recorded,
        so no later resume has to recompute across it. Every rank calls it; rank 0
        commits."""
        latest = last.version
        version = latest + 1
        self.publishing.restart()
        written = self._state_step(version, {}, final=True)
        meta = dict(written.meta) if written is not None else {}
        meta[REBASE_KEY] = str(latest)
        meta[REBASE_REASON_KEY] = why
        ms = self.publishing.publish(version, list(last.consumed_offsets), meta)
        self.version = version
        if ms is not None:  # rank 0
            self._commit_alone(ms)
            self.publishing.history += ms
        if written is not None:
            self.state_version = written.version
            self._state_refs.append((written.version, written.refs))
            self._drop_old_states()
        log.warning("%s: %s: published the recomputed weights as version %d, a rebase of "
                    "version %d (full checkpoint; the same batches trained)",
                    self.component_id, why, version, latest)

    def _commit_alone(self, manifests: list[WeightManifest]) -> None:
        """Rank 0: ``manifests`` (with the model's files named, signed) in a transaction of
        their own, no offsets."""
        self.publishing.add_model_files(manifests)
        cp = self.loop.checkpoint()
        for m in self.publishing.signed(manifests):
            cp.add(self.weights_topic, m, key=self.policy)
        self.loop.commit(cp, offsets=False)

    def _dead_letter_refused(self) -> None:
        """Dead-letter the manifests the resume refused, with the reason, in a transaction
        of their own."""
        if not self.restorer.refused:
            return
        cp = self.loop.checkpoint()
        for m, why in self.restorer.refused:
            cp.dead_letter(refusal_letter(m, why, self.weights_topic, self.component_id,
                                          self.codec))
        self.loop.commit(cp, offsets=False)  # counted by the loop
        self.restorer.refused = []

    def _publish_initial(self) -> None:
        """Version 0: the model as it is, a full checkpoint with the model's files."""
        self.publishing.restart()
        ms = self.publishing.publish(0)
        self.version = 0
        if ms is None:  # a rank > 0: rank 0 publishes
            return
        self._commit_alone(ms)
        self.publishing.history = list(ms)
        log.info("%s: published initial weights as version 0 (%s, %d bytes) on %s",
                 self.component_id, ms[-1].dtype, ms[-1].encoded_bytes, self.weights_topic)

    def wait_fraction(self) -> float:
        wall = time.monotonic() - self._loop_start
        return self.counters.waiting_s / wall if wall > 0 else 0.0

    def status(self) -> ComponentStatus:
        c = self.counters
        metrics = {k: float(v) for k, v in self.last_metrics.items()}
        metrics["trainer/wait_fraction"] = self.wait_fraction()
        metrics["trainer/version"] = float(self.version if self.version is not None else -1)
        metrics["trainer/stale_dropped_total"] = float(self.stale_dropped)
        metrics["trainer/stale_skipped_batches"] = float(self.stale_skipped_batches)
        # the process's peak resident memory (Linux: ru_maxrss in KiB): model, masters,
        # optimizer state and activations, what LoRA saves against full fine-tuning
        metrics["trainer/peak_rss_bytes"] = float(
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)
        return ComponentStatus(
            component_id=self.component_id,
            kind="trainer",
            host=socket.gethostname(),
            policy=self.policy,
            state="stopping" if self.loop is not None and self.loop.stopping else "running",
            produced=c.produced,
            consumed=c.consumed,
            dead_lettered=c.dead_lettered,
            waiting_s=c.waiting_s,
            busy_s=c.busy_s,
            weight_versions={self.policy: self.version if self.version is not None else -1},
            started_at_ms=c.started_at_ms,
            metrics=metrics,
        )

    # --- the Work the transactional loop runs -------------------------------------------
    def run(self) -> ServiceCounters:
        if self.loop is None:
            self._follow()
        else:
            self.loop.run()
            # a clean stop (not an error: then this process fails and the group's
            # supervisor takes the others down) ends the other ranks too
            self.dist.command(Stop())
        return self.counters

    def _follow(self) -> None:
        """A rank > 0: restore with rank 0, then train every batch it hands over, until
        it says stop (or dies: the group's supervisor then takes this process down, and
        the control channel fails at once). Rank 0's commands come over the control
        channel (``Group.command``): between batches, however long, only it waits."""
        self.dist.wait_for_all()  # rank 0 has fenced its predecessor (init_transactions)
        self._open()
        try:
            self._restore()
            while True:
                command: RankCommand = self.dist.command(None)
                match command:
                    case TrainStep():
                        self._step(command, cp=None)
                    case Flush():
                        self.flush(None)
                    case Stop():
                        break
                    case _:
                        raise RuntimeError(f"trainer rank {self.rank}: rank 0 sent "
                                           f"{command!r}, not a RankCommand")
        finally:
            self.close()

    def start(self, loop: TransactionalLoop) -> None:
        """Restore (or publish version 0) once the producer has fenced a predecessor."""
        self.dist.wait_for_all()  # the other ranks waited for that on the channel
        self._open()
        self._restore()
        self._dead_letter_refused()
        log.info("%s: blobs in %s", self.component_id, self.store.uri)
        self._loop_start = time.monotonic()

    def handle(self, msgs: list[Message], cp: Checkpoint) -> None:
        for m in msgs:
            step = self._decode(m, cp)
            if step is None and self._pending is not None:
                # dead-lettered: its letter commits with the offsets past it, so the
                # version held back before it commits in this transaction too (else a
                # crash would read the batch, and dead-letter it, again)
                self._flush_all(cp)
            if step is not None:
                # the last step of a stopping trainer whose states are DCP's records its
                # own state (written synchronously): a clean stop resumes without
                # recomputing, on any number of processes
                final = self.checkpoint_dir is not None and (
                    self.loop.stopping or (self.spec.max_steps is not None
                                           and self._steps + 1 >= self.spec.max_steps))
                step = replace(step, final=final)
                self.dist.command(step)
                self._step(step, cp=cp)
                self._steps += 1
        if self.spec.max_steps is not None and self._steps >= self.spec.max_steps:
            self.loop.stop()
        if self._pending is not None and (not msgs or self.loop.stopping):
            self._flush_all(cp)  # idle, or stopping: commit the version written meanwhile

    def _flush_all(self, cp: Checkpoint) -> None:
        """Rank 0: ``flush`` on every rank of the group (their parts are gathered)."""
        self.dist.command(Flush())
        self.flush(cp)

    def held_offsets(self) -> dict[tuple[str, int], int]:
        """The batch of a version still being written is not committed before it."""
        p = self._pending
        if p is None:
            return {}
        topic, part, off = p.where
        return {(topic, part): off}

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        """Never called: the trainer keeps its position (``keeps_position``)."""

    def close(self) -> None:
        log.info("%s: leaving at version %s", self.component_id, self.version)
        self._finish_state_write()
        if getattr(self, "publishing", None) is not None:
            self.publishing.close()
        if getattr(self, "store", None) is not None:
            self.store.close()

    def _crash_hook(self, cp: Checkpoint) -> None:
        if self._crash_at is not None and self._committing == self._crash_at:
            self.loop.producer.flush()
            log.warning("%s: %s=%d: SIGKILL before committing", self.component_id, CRASH_ENV,
                        self._crash_at)
            os.kill(os.getpid(), signal.SIGKILL)

    def _decode(self, m: Message, cp: Checkpoint) -> TrainStep | None:
        topic, part, off = m.topic(), m.partition(), m.offset()
        try:
            rec = self.codec.decode(m.value(), topic, part, off, expect=Batch)
            check_record(rec)
            self._check_versions(rec)
        except (RecordDecodeError, InvalidRecord) as e:
            reason = f"{type(e).__name__}: {e}"
            log.warning(
                "%s: dead-lettering %s[%d]@%d: %s", self.component_id, topic, part, off, reason
            )
            cp.dead_letter(dead_letter(m, self.component_id, reason))
            return None
        return TrainStep(rec, topic, part, off)

    def _check_versions(self, batch: Batch) -> None:
        """A token of this policy generated by a version not yet published cannot be."""
        newest = max((v for g in batch.groups for s in g.sequences if s.policy == self.policy
                      for v in s.versions), default=-1)
        if self.version is not None and newest > self.version:
            raise InvalidRecord(f"Batch: a token of policy {self.policy} generated by version "
                                f"{newest}, newer than the newest published ({self.version})")

    def _step(self, step: TrainStep, *, cp: Checkpoint | None) -> None:
        """Train on ``step.batch``; its version's manifests go into ``cp`` (rank 0; the
        other ranks of a group train and publish their parts in step, with ``cp`` None),
        or, with ``publish_overlap``, into the next step's. ``step.final``: the last step
        before a clean stop records its own state and is committed at once."""
        batch, final = step.batch, step.final
        topic, part, off = step.topic, step.partition, step.offset
        assert self.version is not None
        metrics = self.trainer.train_step(batch, current_version=self.version)
        self.flush(cp)  # the previous version, written while this batch trained
        if self.loop is not None:
            self.positions = dict(self.loop.positions)
        self.stale_dropped += int(metrics["trainer/stale_dropped_groups"])
        if metrics["trainer/loss_tokens"] == 0:
            self._skip(batch, (topic, part, off), metrics)
            return
        version = self.version + 1
        written = self._state_step(version, metrics, final)
        meta: dict[str, str] = {}
        offsets: list[PartitionOffset] = []
        if cp is not None:
            meta = dict(written.meta) if written is not None else {}
            meta["batch_id"] = batch.batch_id
            meta["batch_partition"] = str(part)
            meta["batch_offset"] = str(off)
            meta["loss"] = f"{metrics['trainer/loss']:.6g}"
            meta["reward_mean"] = f"{metrics['trainer/reward_mean']:.6g}"
            meta["lr"] = repr(metrics["trainer/lr"])  # the schedule's rate, exactly
            offsets = [PartitionOffset(t, p, o) for (t, p), o in sorted(self.positions.items())]
        t0 = time.perf_counter()
        future = self.publishing.start(version, offsets, meta)
        metrics["trainer/publish_start_seconds"] = time.perf_counter() - t0
        self._pending = _Pending(version, batch, (topic, part, off), metrics, written, future)
        self.version = version
        self.counters.steps += 1
        if final or not self.overlap:
            self.flush(cp)

    def flush(self, cp: Checkpoint | None) -> None:
        """Commit the version whose blobs are being written, if any: wait for them and put
        its manifests into ``cp`` (a rank > 0: hand its part to rank 0)."""
        p, self._pending = self._pending, None
        if p is None:
            return
        t0 = time.perf_counter()
        manifests = self.publishing.finish(p.future)
        if cp is None:
            return
        assert manifests is not None
        version, metrics, written = p.version, p.metrics, p.written
        self.publishing.add_model_files(manifests)
        # on the training thread: the device comparison and the wait for the write
        metrics["trainer/publish_seconds"] = (metrics.pop("trainer/publish_start_seconds")
                                              + time.perf_counter() - t0)
        delta = next((m for m in manifests if m.kind == "delta"), manifests[0])
        metrics["trainer/publish_write_seconds"] = float(delta.meta.get("encode_s", 0.0))
        metrics["trainer/version"] = float(version)
        metrics["trainer/wait_fraction"] = self.wait_fraction()
        # of the published version (in its dtype): the delta, or the full checkpoint
        metrics["trainer/weights_sparsity"] = float(delta.sparsity)
        metrics["trainer/weights_bytes"] = float(delta.encoded_bytes)
        newest = written.version if written is not None else self.state_version
        metrics["trainer/state_version"] = float(newest if newest is not None else -1)
        self.last_metrics = metrics
        for m in self.publishing.signed(manifests):
            cp.add(self.weights_topic, m, key=self.policy)
        self._committing = version

        def committed() -> None:
            self._committing = None
            self.publishing.committed(
                manifests, [ref for _, refs in self._state_refs for ref in refs])
            if written is not None:  # recorded by a committed manifest: older ones can go
                self.state_version = written.version
                self._state_refs.append((written.version, written.refs))
                self._drop_old_states()
            self._log_version(version, p.batch, p.where, metrics, manifests, written)

        cp.after_commit.append(committed)

    def _skip(self, batch: Batch, where: tuple[str, int, int], metrics: dict[str, float]
              ) -> None:
        """Nothing trained (every group was stale): the batch is consumed without a version,
        or empty versions would make yet more data stale. Weights and optimizer are
        unchanged, so re-reading it after a restart decides the same way."""
        dropped = int(metrics["trainer/stale_dropped_groups"])
        self.stale_skipped_batches += int(dropped > 0)
        self.last_metrics = {**self.last_metrics, **metrics}
        log.info("%s: batch %s @%s[%d]:%d skipped at v%d: %d stale groups dropped",
                 self.component_id, batch.batch_id, *where, self.version, dropped)

    def _log_version(self, version: int, batch: Batch, where: tuple[str, int, int],
                     metrics: dict[str, float], manifests: list[WeightManifest],
                     written: WrittenState | None) -> None:
        delta = next((m for m in manifests if m.kind == "delta"), manifests[0])
        state = ""
        if written is not None:
            state = (f" | state v{written.version} recorded ({written.bytes} bytes, "
                     f"written in {written.write_seconds:.2f}s)")
        if self.writer.in_flight is not None:
            state += f" | writing state v{self.writer.in_flight}"
        log.info(
            "%s: v%d batch %s @%s[%d]:%d loss %.5f reward %.3f clip %.3f kl %.2e grad %.3f "
            "wait %.2f step %.2fs | %s %s sparsity %.4f %d bytes%s%s",
            self.component_id,
            version,
            batch.batch_id,
            *where,
            metrics["trainer/loss"],
            metrics["trainer/reward_mean"],
            metrics["trainer/clip_frac"],
            metrics["trainer/approx_kl"],
            metrics["trainer/grad_norm"],
            metrics["trainer/wait_fraction"],
            metrics["trainer/step_seconds"],
            delta.dtype,
            delta.kind,
            delta.sparsity,
            delta.encoded_bytes,
            " (+full)" if len(manifests) > 1 else "",
            state,
        )

    def _state_step(self, version: int, metrics: dict[str, float], final: bool = False
                    ) -> WrittenState | None:
        """Collect a finished state write (to be recorded in ``version``'s manifest),
        waiting for it when the lag bound or the next state is due, and start the write
        of ``version``'s state when it is due. ``final``: write ``version``'s state now and
        record it (an older write still in flight is superseded, deleted)."""
        t0 = time.perf_counter()
        if final:
            older = self.writer.wait()
            if older is not None:
                self._discard_state(older)
            self.writer.start(version)
            written = self.writer.wait()
            metrics["trainer/state_wait_seconds"] = time.perf_counter() - t0
            self.dist.wait_for_all()  # as below
            return written
        written = self.writer.poll()
        due = version % self.spec.state_interval == 0
        pending = self.writer.in_flight
        if written is None and pending is not None and (due or version - pending
                                                          >= state_lag(self.spec)):
            written = self.writer.wait()
        metrics["trainer/state_wait_seconds"] = time.perf_counter() - t0
        if due:  # the snapshot (or DCP's copy) now, written in the background
            metrics["trainer/state_snapshot_seconds"] = self.writer.start(version)
        if written is not None:
            metrics["trainer/state_write_seconds"] = written.write_seconds
            metrics["trainer/state_bytes"] = float(written.bytes)
            metrics["trainer/state_version"] = float(written.version)
        # rank 0 alone may have waited for its upload of a state into the blob store
        # (minutes for a large model): the others wait for it on the control channel,
        # not in the publish's gather, whose timeout is training's
        self.dist.wait_for_all()
        return written

    def _finish_state_write(self) -> None:
        """On the way out: wait for a write in flight; no manifest will record it, so its
        blobs are deleted (a restart resumes from the newest recorded state)."""
        if getattr(self, "writer", None) is None:  # failed before it was made
            return
        try:
            written = self.writer.wait()
        except RuntimeError as e:
            log.warning("%s: %s", self.component_id, e)
            return
        if written is None:
            return
        self._discard_state(written)
        log.info(
            "%s: the state of version %d was written after the last committed version; no "
            "manifest records it, deleted (a restart resumes from the state of version %s "
            "and recomputes the versions after it)",
            self.component_id,
            written.version,
            self.state_version if self.state_version is not None else 0,
        )

    def _drop_old_states(self) -> None:
        """Delete the optimizer and master weight blobs of all but the newest
        ``keep_optimizer`` recorded states."""
        keep = self.spec.keep_optimizer
        while len(self._state_refs) > keep:
            version, refs = self._state_refs.pop(0)
            for ref in refs:
                self._delete_blob(ref)
            self.writer.remove(version)

    def _discard_state(self, written: WrittenState) -> None:
        """Delete a state no manifest records (or one superseded): its blobs, and what
        the writer keeps of it elsewhere (a DCP directory)."""
        for ref in written.refs:
            self._delete_blob(ref)
        self.writer.remove(written.version)

    def _delete_blob(self, ref: BlobRef) -> bool:
        return delete_blob(self.store, ref)


@dataclass
class _Pending:
    """A trained version whose blobs are being written (``future``: its manifests)."""

    version: int
    batch: Batch
    where: tuple[str, int, int]  # the batch's topic, partition, offset
    metrics: dict[str, float]
    written: WrittenState | None  # the trainer state its manifest records
    future: Future


def _fmt_positions(positions: dict[tuple[str, int], int]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(positions.items()))


__all__ = ["CRASH_ENV", "ServiceCounters", "ServiceOptions", "TrainerService", "default_state_dir",
           "state_lag"]
