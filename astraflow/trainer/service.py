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
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import signal
import socket
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Message, TopicPartition

from astraflow.config.topology import PolicySpec, Topology, TrainerSpec
from astraflow.dataflow.runtime import loop_spec
from astraflow.kafka.clients import (
    dead_letter,
    make_codec_for,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.loop import Checkpoint, RuntimeCounters, TransactionalLoop
from astraflow.models.lora import META_KEY as LORA_META
from astraflow.models.lora import LoraSettings
from astraflow.models.lora import settings_of as lora_settings_of
from astraflow.trainer.checkpoint_writer import CheckpointWriter, fetch_state_files
from astraflow.trainer.commands import Flush, RankCommand, Stop, TrainStep
from astraflow.trainer.parallel import Group
from astraflow.trainer.resume import (
    REBASE_KEY,
    REBASE_REASON_KEY,
    BatchReader,
    newest_state,
    recompute,
    recorded_states,
    trained_batches,
)
from astraflow.trainer.state import (
    STATE_DIR_KEY,
    STATE_FILES_KEY,
    StateWriter,
    TrainerStateWriter,
    WrittenState,
)
from astraflow.trainer.trainer import Trainer
from astraflow.weights.errors import BlobError
from astraflow.weights.signing import refusal_letter, signer_from, split_trusted, verifier_from
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


_SPEC = TrainerSpec()  # the one declaration of the trainer's defaults
_POLICY = PolicySpec(model="")  # and of the policy's sampling


@dataclass
class ServiceOptions:
    """What the trainer process runs with; ``from_spec`` builds it from the policy's typed
    section of the topology, whose defaults these are."""

    policy: str
    model_path: str
    blob_store: str | None = _SPEC.blob_store  # default: file://<state_dir>/blobs
    state_dir: str | None = _SPEC.state_dir
    instance: str | None = None
    anchor_interval: int = _SPEC.anchor_interval
    # "on": a version's blobs are encoded and written while the next batch trains
    publish_overlap: str = _SPEC.publish_overlap
    # trainer state (optimizer, master weights) written every N versions, in the background
    state_interval: int = _SPEC.state_interval
    # a state write is recorded at the latest in the manifest of version k + lag (the step
    # waits for it there); None: the interval (the next state waits for it)
    state_max_lag: int | None = _SPEC.state_max_lag
    keep_optimizer: int = _SPEC.keep_optimizer  # the newest K written trainer states are kept
    # weight blobs of versions older than the newest full checkpoint at or below the
    # newest version - keep_versions are removed (Kafka: DeleteRecords); 0 keeps all
    keep_versions: int = _SPEC.keep_versions
    max_steps: int | None = _SPEC.max_steps  # stop (cleanly) after this many steps
    # trainer states through torch.distributed.checkpoint in this directory (None: the
    # blob format in the blob store; a group of processes then uses <state dir>/checkpoints)
    checkpoint_dir: str | None = _SPEC.checkpoint_dir
    poll_timeout_s: float = 0.5
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 3_600_000  # a step may take long on a big model
    commit_retries: int = 3
    # the policy's trainer: section, validated where it was built
    trainer: TrainerSpec = field(default_factory=TrainerSpec)
    # the policy's own settings the step reads (Trainer's keywords): its sampling, whose
    # log-probs the trainer takes, its staleness bound (None: none) and its LoRA adapters
    temperature: float = _POLICY.temperature
    top_p: float = _POLICY.top_p
    max_staleness: int | None = None
    lora: LoraSettings | None = None

    @classmethod
    def from_spec(cls, policy: str, spec: PolicySpec,
                  instance: str | None = None) -> ServiceOptions:
        """The trainer of ``policy`` as its typed section ``spec`` (flags applied:
        ``astraflow.config.components.trainer_spec``) declares it."""
        t = spec.trainer
        return cls(policy=policy, model_path=spec.model, blob_store=t.blob_store,
                   state_dir=t.state_dir, instance=instance,
                   anchor_interval=t.anchor_interval, publish_overlap=t.publish_overlap,
                   state_interval=t.state_interval,
                   state_max_lag=t.state_max_lag, keep_optimizer=t.keep_optimizer,
                   keep_versions=t.keep_versions, max_steps=t.max_steps,
                   checkpoint_dir=t.checkpoint_dir, trainer=t, temperature=spec.temperature,
                   top_p=spec.top_p, max_staleness=spec.max_staleness,
                   lora=(LoraSettings.from_mapping(spec.lora.model_dump())
                         if spec.lora is not None else None))

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option (and its CLI flag) of a bad setting."""
        checks = [
            ("state_interval", "--state-interval", self.state_interval >= 1),
            ("state_max_lag", "--state-max-lag",
             self.state_max_lag is None or self.state_max_lag >= 1),
            ("keep_optimizer", "--keep-optimizer", self.keep_optimizer >= 1),
            ("anchor_interval", "--anchor-interval", self.anchor_interval >= 0),
            ("keep_versions", "--keep-versions", self.keep_versions >= 0),
        ]
        for name, flag, ok in checks:
            if not ok:
                minimum = 0 if name in ("anchor_interval", "keep_versions") else 1
                raise ValueError(
                    f"{name} ({flag}) must be at least {minimum}, got {getattr(self, name)!r}"
                )

    def make_trainer(self, group: Group | None = None) -> Trainer:
        """The step these options declare: the policy's ``trainer:`` section with its
        sampling, staleness bound and LoRA adapters (``group``: sharded over it)."""
        return Trainer(self.model_path, self.trainer, self.policy, group=group,
                       temperature=self.temperature, top_p=self.top_p,
                       max_staleness=self.max_staleness, lora=self.lora)

    @property
    def state_lag(self) -> int:
        """Versions after which a state write must be recorded (waited for)."""
        lag = self.state_max_lag or self.state_interval
        return min(lag, self.state_interval)


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
        rank 0 runs the transactional loop and hands every batch to the others."""
        self.topology = topology
        self.dist = group  # the trainer's processes (None: this one alone)
        self.rank = group.rank if group is not None else 0
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
            Path(options.state_dir).expanduser()
            if options.state_dir
            else (default_state_dir(topology.run, self.policy))
        )
        self.blob_uri = options.blob_store or default_blob_store(topology, self.state_dir)
        self.codec = make_codec_for(self.config)
        # signed weights: every manifest published is signed when a key is configured
        self.signer = signer_from(topology.weight_signing)
        # ... and with a public key, a resume uses only manifests signed by its key
        self.verifier = verifier_from(topology.weight_signing)
        self._refused: list[tuple[WeightManifest, str]] = []  # dead-lettered at start
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
        self._history: list[WeightManifest] = []  # the manifests whose blobs may be kept
        options.validate()
        crash = os.environ.get(CRASH_ENV)
        self._crash_at = int(crash) if crash else None
        self._committing: int | None = None  # the version in the open transaction
        self._stopping = False  # a rank > 0 was told to stop
        # publish_overlap: the version whose blobs are being written while the next batch
        # trains; its batch's offset is held back from commits until it is committed
        self._pending: _Pending | None = None
        self._writer_pool = ThreadPoolExecutor(1, thread_name_prefix="publish")
        dev = options.trainer.device
        self.overlap = (options.publish_overlap == "on"
                        or (options.publish_overlap == "auto" and dev.startswith("cuda")))
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
        if self.options.checkpoint_dir:
            return Path(self.options.checkpoint_dir).expanduser()
        if self.dist is None:
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
            self.trainer = self.options.make_trainer(self.dist)
        self.writer: TrainerStateWriter
        if self.checkpoint_dir is None:
            self.writer = StateWriter(self.store, self.policy, self.trainer)
        else:  # DCP; in the blob store after all when no checkpoint_dir was given
            into_store = self.store if (self.rank == 0 and not self.options.checkpoint_dir
                                        ) else None
            self.writer = CheckpointWriter(self.trainer, self.checkpoint_dir, self.policy,
                                           store=into_store, owner=self.rank == 0)

    def _read_manifests(self) -> list[WeightManifest]:
        """Rank 0: the trusted manifests of the policy on ``weights.<policy>``, handed to
        every other rank (they restore from the same list)."""
        from astraflow.weights.stores.kafka import read_manifests

        manifests = None
        if self.rank == 0:
            manifests = self._trusted([
                m for m in read_manifests(self.config, self.weights_topic)
                if m.policy == self.policy])
        if self.dist is not None:
            manifests = self.dist.command(manifests)
        return manifests

    def _restore(self) -> None:
        from astraflow.weights.follower import WeightFollower

        manifests = self._read_manifests()
        self._history = list(manifests)
        if not manifests:
            self._publish_initial()
            return
        self._check_lora(manifests)
        t0 = time.perf_counter()
        latest = max(m.version for m in manifests)
        start, meta = newest_state(manifests)
        follower = WeightFollower(
            policy=self.policy, stores=[self.store], kafka_config=self.config, inplace=False
        )
        follower.observe(manifests)
        res = follower.update(start)
        opt, master = self._load_state(follower, start, meta, manifests)
        # the schedule's count: the batches version start has trained (not its number: a
        # rebase version trained none of its own)
        self.trainer.steps = trained_batches(manifests, start)
        reader = BatchReader(self.config, self.batches_topic, self.codec)
        try:
            replayed = recompute(self.trainer, follower, manifests, start, latest, reader,
                                 self.weights_topic)
        finally:
            reader.close()
        replay_s = replayed.seconds
        if replayed.differs is None:
            assert follower.state is not None
            self.publisher = self._publisher(version=latest, state=follower.state)
        last = [m for m in manifests if m.version == latest][0]
        self.positions = {(p.topic, p.partition): p.offset for p in last.consumed_offsets}
        self.version = self.resumed_from = latest
        self.state_version = start if meta else None
        self._state_refs = recorded_states(manifests)
        self._drop_old_states()
        if replayed.differs is not None:
            self._rebase(last, replayed.differs)
        if self.loop is not None:  # rank 0 alone, after the group's last collective here
            self.loop.positions.update(self._resume_positions(latest))
        log.info(
            "%s: resumed at version %d from the state of version %d (%d manifests applied, "
            "%d bytes); optimizer state %s; master weights %s; recomputed versions %s in "
            "%.2fs%s; %.2fs in all; consuming from %s",
            self.component_id,
            latest,
            start,
            len(res.applied),
            res.bytes_fetched,
            opt,
            master,
            f"{start + 1}..{latest}" if latest > start else "none",
            replay_s,
            "" if replayed.differs is None else f", published as rebase version {self.version}",
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
        self.publisher = self._publisher()
        written = self._state_step(version, {}, final=True)
        meta = dict(written.meta) if written is not None else {}
        meta[REBASE_KEY] = str(latest)
        meta[REBASE_REASON_KEY] = why
        ms = self._publish(version, list(last.consumed_offsets), meta)
        self.version = version
        if ms is not None:  # rank 0
            self._add_model_files(ms)
            cp = self.loop.checkpoint()
            for m in self._signed(ms):
                cp.add(self.weights_topic, m, key=self.policy)
            self.loop.commit(cp, offsets=False)
            self._history += ms
        if written is not None:
            self.state_version = written.version
            self._state_refs.append((written.version, written.refs))
            self._drop_old_states()
        log.warning("%s: %s: published the recomputed weights as version %d, a rebase of "
                    "version %d (full checkpoint; the same batches trained)",
                    self.component_id, why, version, latest)

    def _trusted(self, manifests: list[WeightManifest]) -> list[WeightManifest]:
        """The manifests a resume may use: with a public key configured, those signed by
        its key. Each refused one is logged (and dead-lettered at start), never loaded; the
        resume goes on from the trusted ones. When every manifest is refused there is
        nothing to resume from, and publishing version 0 over them would restart the run:
        ``RuntimeError``."""
        kept, refused = split_trusted(manifests, self.verifier)
        for m, why in refused:
            log.warning("%s: not resuming from %s v%d (%s): refused: %s", self.component_id,
                        self.weights_topic, m.version, m.kind, why)
        self._refused = refused
        if refused and not kept:
            raise RuntimeError(
                f"{self.weights_topic}: every manifest of {self.policy} is refused "
                f"({refused[-1][1]}); not resuming from any, nor publishing version 0 over "
                "them: check weight_signing.public_key, or train into a new run")
        return kept

    def _dead_letter_refused(self) -> None:
        """Dead-letter the manifests the resume refused, with the reason, in a transaction
        of their own."""
        if not self._refused:
            return
        cp = self.loop.checkpoint()
        for m, why in self._refused:
            cp.dead_letter(refusal_letter(m, why, self.weights_topic, self.component_id,
                                          self.codec))
        self.loop.commit(cp, offsets=False)  # counted by the loop
        self._refused = []

    def _signed(self, manifests: list[WeightManifest]) -> list[WeightManifest]:
        """``manifests``, signed (in place) when this trainer has a signing key."""
        if self.signer is not None:
            for m in manifests:
                self.signer.sign(m)
        return manifests

    def _publisher(self, version: int | None = None, state: dict | None = None):
        """This process's ``WeightPublisher``: of the whole state, or in a group of this
        rank's rows of it (``state``, the published weights of ``version``, is cut to
        them)."""
        from astraflow.weights.publisher import WeightPublisher

        rows = None
        if self.dist is not None:
            part, rows = self.trainer.published_part()
            if state is not None:
                state = {k: _rows_of(state[k], rows.get(k)) for k in part}
        lora = self._lora()
        # an adapter is small and a step may change most of it: each version goes whole
        # when that is smaller than its delta, and every manifest names the adapter's shape
        return WeightPublisher(self.store, self.policy,
                               anchor_interval=self.options.anchor_interval, rows=rows,
                               version=version, state=state,
                               whole_when_smaller=lora is not None,
                               meta={LORA_META: lora.to_json()} if lora is not None else None)

    def _lora(self) -> LoraSettings | None:
        return self.options.lora

    def _check_lora(self, manifests: list[WeightManifest]) -> None:
        """Refuse, in one line, to resume a policy whose published versions are another
        kind of weights (full against adapter) or an adapter of another shape."""
        newest = max(manifests, key=lambda m: m.version)
        published, mine = lora_settings_of(newest.meta), self._lora()
        if published == mine:
            return

        def said(x: LoraSettings | None) -> str:
            return "the whole model" if x is None else f"a LoRA adapter {x.to_json()}"

        raise RuntimeError(
            f"{self.weights_topic} holds {said(published)} (version {newest.version}), this "
            f"trainer trains {said(mine)}: set the policy's lora: as the run was started, or "
            "start a new run")

    def _publish(self, version: int, offsets: list[PartitionOffset] | None = None,
                 meta: dict[str, str] | None = None) -> list[WeightManifest] | None:
        """Write this process's blob(s) of ``version``; its manifests (rank 0 of a group:
        every rank's parts merged; the other ranks: None)."""
        return self._finish_publish(self._start_publish(version, offsets, meta))

    def _start_publish(self, version: int, offsets: list[PartitionOffset] | None = None,
                       meta: dict[str, str] | None = None) -> Future:
        """Find what changed in this process's published weights (on their device) and
        start encoding and writing it on the publishing thread."""
        state = (self.trainer.published_state() if self.dist is None
                 else self.trainer.published_part()[0])
        # trainer_step: the batches these weights have trained (the schedule's count)
        prepared = self.publisher.prepare(state, version=version,
                                          trainer_step=self.trainer.steps,
                                          consumed_offsets=offsets or [], meta=meta)
        return self._writer_pool.submit(prepared.write)

    def _finish_publish(self, written: Future) -> list[WeightManifest] | None:
        """The manifests of a started publish once written (rank 0 of a group: every
        rank's parts merged; the other ranks: None)."""
        from astraflow.weights.merge import merge_parts

        mine = written.result()
        if self.dist is None:
            return mine
        every = self.dist.gather(mine)
        if every is None:
            return None
        merged = merge_parts(every)
        for m in merged:  # rank 0's offsets and meta: the other ranks know none
            m.consumed_offsets = list(mine[0].consumed_offsets)
            m.meta.update(mine[0].meta)
        return merged

    def _publish_initial(self) -> None:
        """Version 0: the model as it is, a full checkpoint with the model's files."""
        self.publisher = self._publisher()
        ms = self._publish(0)
        self.version = 0
        if ms is None:  # a rank > 0: rank 0 publishes
            return
        self._add_model_files(ms)
        self._history = list(ms)
        cp = self.loop.checkpoint()
        for m in self._signed(ms):
            cp.add(self.weights_topic, m, key=self.policy)
        self.loop.commit(cp, offsets=False)
        log.info("%s: published initial weights as version 0 (%s, %d bytes) on %s",
                 self.component_id, ms[-1].dtype, ms[-1].encoded_bytes, self.weights_topic)

    def _resume_positions(self, version: int) -> dict[tuple[str, int], int]:
        """Where to consume from: the group's committed offsets, checked against version
        ``version``'s manifest (they may only be past it, by skipped or dead-lettered
        batches)."""
        consumer = Consumer(self.config.consumer_conf(self.group))  # reads, never joins
        try:
            tps = [TopicPartition(t, p) for t, p in self.positions]
            committed = consumer.committed(tps, timeout=30) if tps else []
        finally:
            consumer.close()
        out = {}
        for tp in committed:
            mine = self.positions[(tp.topic, tp.partition)]
            group = tp.offset if tp.offset >= 0 else None
            where = f"{self.component_id}: {tp.topic}[{tp.partition}]: committed offset {group}"
            if group == mine:
                log.info("%s matches version %d's manifest", where, version)
            elif group is not None and group > mine:
                log.info("%s is past version %d's manifest (%d): the batches between were "
                         "skipped or dead-lettered", where, version, mine)
            else:
                log.warning("%s is before version %d's manifest (%d); resuming from the "
                            "manifest's offset", where, version, mine)
            out[(tp.topic, tp.partition)] = max(mine, group if group is not None else -1)
        return out

    def _load_state(
        self, follower, version: int, meta: dict[str, str], manifests: list[WeightManifest]
    ) -> tuple[str, str]:
        """Load the trainer state of ``version`` (recorded in ``meta``; the follower holds
        its published weights); how the optimizer and the master weights were obtained."""
        published = follower.state
        assert follower.version == version and published is not None
        dtype = [m for m in manifests if m.version == version][0].dtype
        self._check_published_dtypes(published, version, dtype)
        if STATE_DIR_KEY in meta:
            return self._load_checkpoint(meta[STATE_DIR_KEY], published, version)
        if STATE_FILES_KEY in meta:
            into = self.state_dir / "checkpoints" / f"{self.policy}.restore-{self.rank}"
            shutil.rmtree(into, ignore_errors=True)
            try:
                fetch_state_files(meta, into, follower.resolver.open)
                return self._load_checkpoint(str(into), published, version,
                                             source=f"the blob store ({self.store.uri})")
            except BlobError as e:
                raise RuntimeError(f"{self.weights_topic}: the state of version {version} "
                                   f"is unusable ({e}); cannot resume exactly") from e
            finally:
                shutil.rmtree(into, ignore_errors=True)
        if self.dist is not None and "optimizer_uri" in meta:
            raise RuntimeError(
                f"{self.weights_topic}: the state of version {version} was written by one "
                "process in the blob format; a group of processes resumes only states "
                "written through torch.distributed.checkpoint: resume with --processes 1 "
                "and --checkpoint-dir DIR (its next states are then in that format)")
        opt = "fresh"
        if "optimizer_uri" in meta:
            data, _ = self._read_state_blob(follower, meta, "optimizer", version)
            self.trainer.load_optimizer_bytes(data)
            opt = "loaded"
        if not self.trainer.keeps_master:
            self.trainer.load_weights(published)
            master = "the published weights"
        else:
            if "master_uri" in meta:
                data, _ = self._read_state_blob(follower, meta, "master", version)
                self.trainer.load_master_bytes(data)
                master = "loaded"
            elif version == 0:
                master = "the model directory"  # what version 0 was published from
            else:
                raise RuntimeError(
                    f"{self.weights_topic}: version {version} was published as {dtype} but "
                    "its state names no master weights (meta master_uri), and they cannot be "
                    "rebuilt from the rounded ones; cannot resume exactly (restart with the "
                    "--publish-dtype the run was started with)"
                )
            if self.trainer.published_difference(published) is not None:
                raise RuntimeError(
                    f"{self.weights_topic}: the master weights of version {version} (from "
                    f"{master}) do not round to its published weights; cannot resume exactly"
                )
        return opt, master

    def _load_checkpoint(self, where: str, published, version: int,
                         source: str | None = None) -> tuple[str, str]:
        """Load the state of ``version`` written through ``torch.distributed.checkpoint``
        (by any number of processes) into this process's share of the trainer."""
        from astraflow.trainer import checkpoint

        try:
            checkpoint.load(self.trainer, where)
        except (OSError, RuntimeError, ValueError) as e:
            raise RuntimeError(f"{self.weights_topic}: the state of version {version} in "
                               f"{where} is unusable ({e}); cannot resume exactly") from e
        if self.trainer.published_difference(published) is not None:
            raise RuntimeError(
                f"{self.weights_topic}: the master weights of version {version} (from "
                f"{where}) do not round to its published weights; cannot resume exactly")
        return f"loaded from {source or where}", "loaded"

    def _check_published_dtypes(self, published, version: int, dtype: str) -> None:
        """The newest version must have been published in the dtype this trainer publishes
        (a delta needs both sides in one dtype)."""
        mine = self.trainer.published_dtypes()
        bad = [k for k, v in published.items() if k in mine and mine[k] != v.dtype]
        if bad:
            raise RuntimeError(
                f"{self.weights_topic}: version {version} was published as {dtype} "
                f"({bad[0]}: {published[bad[0]].dtype}), this trainer publishes "
                f"{mine[bad[0]]}: restart with the --dtype/--publish-dtype the run was "
                "started with"
            )

    def _read_state_blob(
        self, follower, meta: dict[str, str], kind: str, version: int
    ) -> tuple[bytes, BlobRef]:
        """The bytes of the ``kind`` (optimizer/master) blob named in ``meta``, verified."""
        ref = BlobRef(
            uri=meta[f"{kind}_uri"],
            bytes=int(meta[f"{kind}_bytes"]),
            sha256=meta[f"{kind}_sha256"],
        )
        try:
            with follower.resolver.open(ref) as f:  # checks size and sha256
                return f.read(), ref
        except BlobError as e:
            raise RuntimeError(
                f"{self.weights_topic}: the {kind} state of version {version} is unusable "
                f"({e}); cannot resume exactly"
            ) from e

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
            if self.dist is not None:
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
        if self.dist is not None:
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
                    self.loop.stopping or (self.options.max_steps is not None
                                           and self._steps + 1 >= self.options.max_steps))
                step = replace(step, final=final)
                if self.dist is not None:
                    self.dist.command(step)
                self._step(step, cp=cp)
                self._steps += 1
        if self.options.max_steps is not None and self._steps >= self.options.max_steps:
            self.loop.stop()
        if self._pending is not None and (not msgs or self.loop.stopping):
            self._flush_all(cp)  # idle, or stopping: commit the version written meanwhile

    def _flush_all(self, cp: Checkpoint) -> None:
        """Rank 0: ``flush`` on every rank of the group (their parts are gathered)."""
        if self.dist is not None:
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
        self._writer_pool.shutdown(wait=True)
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
        future = self._start_publish(version, offsets, meta)
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
        manifests = self._finish_publish(p.future)
        if cp is None:
            return
        assert manifests is not None
        version, metrics, written = p.version, p.metrics, p.written
        self._add_model_files(manifests)
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
        for m in self._signed(manifests):
            cp.add(self.weights_topic, m, key=self.policy)
        self._committing = version

        def committed() -> None:
            self._committing = None
            self._history += manifests
            if any(m.kind == "full" for m in manifests):
                self._prune()
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
        o = self.options
        t0 = time.perf_counter()
        if final:
            older = self.writer.wait()
            if older is not None:
                self._discard_state(older)
            self.writer.start(version)
            written = self.writer.wait()
            metrics["trainer/state_wait_seconds"] = time.perf_counter() - t0
            if self.dist is not None:
                self.dist.wait_for_all()  # as below
            return written
        written = self.writer.poll()
        due = version % o.state_interval == 0
        pending = self.writer.in_flight
        if written is None and pending is not None and (due or version - pending >= o.state_lag):
            written = self.writer.wait()
        metrics["trainer/state_wait_seconds"] = time.perf_counter() - t0
        if due:  # the snapshot (or DCP's copy) now, written in the background
            metrics["trainer/state_snapshot_seconds"] = self.writer.start(version)
        if written is not None:
            metrics["trainer/state_write_seconds"] = written.write_seconds
            metrics["trainer/state_bytes"] = float(written.bytes)
            metrics["trainer/state_version"] = float(written.version)
        if self.dist is not None:
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

    def _add_model_files(self, manifests: list[WeightManifest]) -> None:
        """Name the model's other files (config, tokenizer) in a full checkpoint's meta, so
        that a reader needs nothing but Kafka (``astraflow.models.share``)."""
        from astraflow.models.share import model_files_meta

        for m in manifests:
            if m.kind == "full":
                m.meta.update(model_files_meta(self.store, self.policy, m.version,
                                               self.options.model_path))

    def _prune(self) -> None:
        """Remove the weight blobs no reader needs: those of versions before the newest full
        checkpoint at or below ``newest - keep_versions`` (recorded trainer states stay)."""
        from astraflow.models.share import files_ref
        from astraflow.weights.retention import retained_manifests

        if not self.options.keep_versions:
            return
        kept = retained_manifests(self._history, keep_last=self.options.keep_versions)
        if len(kept) == len(self._history):
            return
        start = min(m.version for m in kept)
        dropped = [m for m in self._history if m.version < start]
        truncate = getattr(self.store, "truncate_to", None)
        if truncate is not None:
            states = [ref for _, refs in self._state_refs for ref in refs]
            moved = truncate([ref for m in kept for ref in m.blobs] + states)
            how = f"records deleted up to offsets {moved}" if moved else "nothing to delete yet"
        else:
            refs = [ref for m in dropped for ref in [*m.blobs, files_ref(m)] if ref is not None]
            gone = sum(self._delete_blob(ref) for ref in refs)
            how = f"{gone} blobs deleted"
        self._history = kept
        log.info("%s: pruned the weight blobs of versions before %d (%s); versions %d.. stay "
                 "reachable", self.component_id, start, how, start)

    def _drop_old_states(self) -> None:
        """Delete the optimizer and master weight blobs of all but the newest
        ``keep_optimizer`` recorded states."""
        keep = max(1, self.options.keep_optimizer)
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
        try:
            return bool(self.store.delete(ref))
        except Exception as e:  # a store that cannot delete keeps it: harmless
            log.debug("could not delete %s: %s", ref.uri, e)
            return False


@dataclass
class _Pending:
    """A trained version whose blobs are being written (``future``: its manifests)."""

    version: int
    batch: Batch
    where: tuple[str, int, int]  # the batch's topic, partition, offset
    metrics: dict[str, float]
    written: WrittenState | None  # the trainer state its manifest records
    future: Future


def _rows_of(t, rows) -> Any:
    """Rows ``rows.start..rows.stop`` of dim 0 of ``t`` (all of it when ``rows`` is None)."""
    return t if rows is None else t[rows.start:rows.stop]


def _fmt_positions(positions: dict[tuple[str, int], int]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(positions.items()))


__all__ = ["CRASH_ENV", "ServiceCounters", "ServiceOptions", "TrainerService", "default_state_dir"]
