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
2. every manifest on ``weights.<policy>`` is read. The newest recorded state (version k;
   none: version 0, the model directory) is loaded, sha256-verified, and its master weights
   must round to version k's published weights (rebuilt with a ``WeightFollower``) bit for
   bit. With ``publish_dtype`` ``same`` the published weights are the trained ones;
3. the versions k+1..L after it (L the newest published) are retrained from the batches
   their manifests name, without publishing, and each must equal the published version bit
   for bit (``astraflow.trainer.resume``); a difference is refused;
4. consumption resumes at version L's ``consumed_offsets``, which are the group's committed
   offsets because both were committed in the same transaction (checked and logged).

So no batch is lost and none is trained twice, and a resumed trainer continues bit for bit
as an uninterrupted one would have. Version 0 (the initial weights) is published when
``weights.<policy>`` is empty; version ``k`` is the model after ``k`` batches.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.codec import RecordDecodeError
from astraflow.dataflow.base import InvalidRecord
from astraflow.kafka.clients import (
    RecordProducer,
    dead_letter,
    make_admin,
    make_codec_for,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.runtime import RuntimeCounters
from astraflow.kafka.topics import MissingTopicsError, missing_topics
from astraflow.records import (
    Batch,
    BlobRef,
    ComponentStatus,
    DeadLetter,
    PartitionOffset,
    WeightManifest,
)
from astraflow.topology import Topology
from astraflow.trainer.resume import BatchReader, newest_state, recompute, recorded_states
from astraflow.trainer.state import StateWriter, WrittenState
from astraflow.trainer.trainer import Trainer, TrainerConfig
from astraflow.validate import check_record
from astraflow.weights.delta import state_bytes_equal
from astraflow.weights.errors import BlobError

log = logging.getLogger("astraflow.trainer")

CRASH_ENV = "ASTRAFLOW_TRAINER_CRASH_AT"  # test hook: SIGKILL self before committing version N


def default_state_dir(run: str, policy: str) -> Path:
    return Path("~/.local/state/astraflow/trainer").expanduser() / f"{run}.{policy}"


@dataclass
class ServiceOptions:
    policy: str
    model_path: str
    blob_store: str | None = None  # default: file://<state_dir>/blobs
    state_dir: str | None = None
    instance: str | None = None
    anchor_interval: int = 10
    # trainer state (optimizer, master weights) written every N versions, in the background
    state_interval: int = 10
    # a state write is recorded at the latest in the manifest of version k + lag (the step
    # waits for it there); None: the interval (the next state waits for it)
    state_max_lag: int | None = None
    keep_optimizer: int = 3  # the newest K written trainer states are kept
    max_steps: int | None = None  # stop (cleanly) after this many steps in this process
    poll_timeout_s: float = 0.5
    session_timeout_ms: int = 10_000
    max_poll_interval_ms: int = 3_600_000  # a step may take long on a big model
    commit_retries: int = 3
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option (and its CLI flag) of a bad setting."""
        checks = [
            ("state_interval", "--state-interval", self.state_interval >= 1),
            ("state_max_lag", "--state-max-lag",
             self.state_max_lag is None or self.state_max_lag >= 1),
            ("keep_optimizer", "--keep-optimizer", self.keep_optimizer >= 1),
            ("anchor_interval", "--anchor-interval", self.anchor_interval >= 0),
        ]
        for name, flag, ok in checks:
            if not ok:
                minimum = 0 if name == "anchor_interval" else 1
                raise ValueError(
                    f"{name} ({flag}) must be at least {minimum}, got {getattr(self, name)!r}"
                )
        self.trainer.validate()

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
    ):
        self.topology = topology
        self.options = options
        self.policy = options.policy
        self.config = (config or topology.kafka).effective()
        self.instance = options.instance or os.environ.get("ASTRAFLOW_INSTANCE") or "0"
        self.group = f"{topology.run}.trainer.{self.policy}"
        self.transactional_id = f"{self.group}.{self.instance}"
        self.component_id = f"trainer.{self.policy}/{self.instance}"
        self.batches_topic = topology.full_name(f"batches.{self.policy}")
        self.weights_topic = topology.full_name(f"weights.{self.policy}")
        self.status_topic = topology.full_name("status")
        self.dlq_topic = topology.full_name("dlq")
        self.state_dir = (
            Path(options.state_dir).expanduser()
            if options.state_dir
            else (default_state_dir(topology.run, self.policy))
        )
        self.blob_uri = options.blob_store or (self.state_dir / "blobs").absolute().as_uri()
        self.codec = make_codec_for(self.config)
        self.counters = ServiceCounters()
        self.trainer = trainer
        self.version: int | None = None
        self.resumed_from: int | None = None
        self.last_metrics: dict[str, float] = {}
        self.positions: dict[tuple[str, int], int] = {}
        # recorded trainer states, oldest first: (version, optimizer and master blobs)
        self._state_refs: list[tuple[int, list[BlobRef]]] = []
        self.state_version: int | None = None  # the newest recorded state
        self._dead: list[DeadLetter] = []
        self._check_committed: list[TopicPartition] = []
        self._stop = threading.Event()
        self._last_status = 0.0
        self._loop_start = time.monotonic()
        options.validate()
        crash = os.environ.get(CRASH_ENV)
        self._crash_at = int(crash) if crash else None

    def stop(self) -> None:
        """Finish the current step (its transaction included), then return from ``run``."""
        self._stop.set()

    # --- start-up ------------------------------------------------------------------------
    def _open(self):
        from astraflow.weights.store import open_store

        missing = missing_topics(
            make_admin(self.config),
            [self.batches_topic, self.weights_topic, self.status_topic, self.dlq_topic],
        )
        if missing:
            raise MissingTopicsError(
                f"topics missing on {self.config.bootstrap_servers}: {', '.join(missing)}; "
                f"create them with `astraflow topics apply {self.topology.source}`"
            )
        self.store = open_store(self.blob_uri, self.config)
        # first: fence a dead predecessor and abort its open transaction
        self.producer = RecordProducer(
            self.config,
            self.codec,
            transactional_id=self.transactional_id,
            **{"transaction.timeout.ms": 60_000},
        )
        self.writer = StateWriter(self.store, self.policy)
        if self.trainer is None:
            self.trainer = Trainer(self.options.model_path, self.options.trainer, self.policy)

    def _restore(self) -> None:
        from astraflow.weights.history import WeightFollower, WeightPublisher
        from astraflow.weights.kafka_store import read_manifests

        manifests = [
            m for m in read_manifests(self.config, self.weights_topic) if m.policy == self.policy
        ]
        o = self.options
        if not manifests:
            self.publisher = WeightPublisher(
                self.store, self.policy, anchor_interval=o.anchor_interval
            )
            ms = self.publisher.publish(self.trainer.published_state(), version=0, trainer_step=0)
            self._commit(ms, offsets=False, status=False)
            self.version = 0
            log.info(
                "%s: published initial weights as version 0 (%s, %d bytes) on %s",
                self.component_id,
                ms[-1].dtype,
                ms[-1].encoded_bytes,
                self.weights_topic,
            )
            return
        t0 = time.perf_counter()
        latest = max(m.version for m in manifests)
        start, meta = newest_state(manifests)
        follower = WeightFollower(
            policy=self.policy, stores=[self.store], kafka_config=self.config, inplace=False
        )
        follower.observe(manifests)
        res = follower.update(start)
        opt, master = self._load_state(follower, start, meta, manifests)
        reader = BatchReader(self.config, self.batches_topic, self.codec)
        try:
            replay_s = recompute(self.trainer, follower, manifests, start, latest, reader,
                                 self.weights_topic)
        finally:
            reader.close()
        assert follower.state is not None
        self.publisher = WeightPublisher(
            self.store,
            self.policy,
            anchor_interval=o.anchor_interval,
            version=latest,
            state=follower.state,
        )
        last = [m for m in manifests if m.version == latest][0]
        self.positions = {(p.topic, p.partition): p.offset for p in last.consumed_offsets}
        self.version = self.resumed_from = latest
        self.state_version = start if meta else None
        self._state_refs = recorded_states(manifests)
        self._drop_old_states()
        log.info(
            "%s: resumed at version %d from the state of version %d (%d manifests applied, "
            "%d bytes); optimizer state %s; master weights %s; recomputed versions %s in "
            "%.2fs; %.2fs in all; consuming from %s",
            self.component_id,
            latest,
            start,
            len(res.applied),
            res.bytes_fetched,
            opt,
            master,
            f"{start + 1}..{latest}" if latest > start else "none",
            replay_s,
            time.perf_counter() - t0,
            _fmt_positions(self.positions) or "the group's committed offsets",
        )

    def _load_state(
        self, follower, version: int, meta: dict[str, str], manifests: list[WeightManifest]
    ) -> tuple[str, str]:
        """Load the trainer state of ``version`` (recorded in ``meta``; the follower holds
        its published weights); how the optimizer and the master weights were obtained."""
        published = follower.state
        assert follower.version == version and published is not None
        dtype = [m for m in manifests if m.version == version][0].dtype
        self._check_published_dtypes(published, version, dtype)
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
            if not state_bytes_equal(self.trainer.published_state(), published):
                raise RuntimeError(
                    f"{self.weights_topic}: the master weights of version {version} (from "
                    f"{master}) do not round to its published weights; cannot resume exactly"
                )
        self.trainer.steps = version
        return opt, master

    def _check_published_dtypes(self, published, version: int, dtype: str) -> None:
        """The newest version must have been published in the dtype this trainer publishes
        (a delta needs both sides in one dtype)."""
        mine = {k: v.dtype for k, v in self.trainer.published_state().items()}
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

    # --- consumer ------------------------------------------------------------------------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        for tp in partitions:
            pos = self.positions.get((tp.topic, tp.partition))
            if pos is not None:
                tp.offset = pos
        consumer.assign(partitions)
        self._check_committed = list(partitions)
        log.info(
            "%s: assigned %s",
            self.component_id,
            ", ".join(f"{p.topic}[{p.partition}]@{p.offset}" for p in partitions),
        )

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        log.info(
            "%s: partitions revoked: %s",
            self.component_id,
            ", ".join(f"{p.topic}[{p.partition}]" for p in partitions),
        )

    def _verify_committed(self, consumer: Consumer) -> None:
        parts, self._check_committed = self._check_committed, []
        if not parts:
            return
        committed = consumer.committed(
            [TopicPartition(p.topic, p.partition) for p in parts], timeout=30
        )
        for tp in committed:
            mine = self.positions.get((tp.topic, tp.partition))
            group = tp.offset if tp.offset >= 0 else None
            if mine != group:
                log.warning(
                    "%s: %s[%d]: group %s committed %s but version %s consumed up to %s; "
                    "resuming from the manifest's offset",
                    self.component_id,
                    tp.topic,
                    tp.partition,
                    self.group,
                    group,
                    self.version,
                    mine,
                )
            else:
                log.info(
                    "%s: %s[%d]: committed offset %s matches version %s's manifest",
                    self.component_id,
                    tp.topic,
                    tp.partition,
                    group,
                    self.version,
                )

    # --- transactions --------------------------------------------------------------------
    def _commit(
        self, manifests: list[WeightManifest], offsets: bool = True, status: bool = False
    ) -> None:
        dead = list(self._dead) if offsets else []  # dead letters go with their offsets
        for attempt in range(1, self.options.commit_retries + 1):
            self.producer.begin()
            try:
                for m in manifests:
                    self.producer.produce(self.weights_topic, m, key=self.policy)
                for d in dead:
                    self.producer.produce(self.dlq_topic, d, d.raw_key)
                if status:
                    self.producer.produce(self.status_topic, self.status(), self.component_id)
                if offsets and self.positions:
                    tps = [TopicPartition(t, p, o) for (t, p), o in sorted(self.positions.items())]
                    self.producer.producer.send_offsets_to_transaction(
                        tps, self.consumer.consumer_group_metadata(), 30
                    )
                if (
                    self._crash_at is not None
                    and manifests
                    and manifests[0].version == self._crash_at
                ):
                    self.producer.flush()
                    log.warning(
                        "%s: %s=%d: SIGKILL before committing",
                        self.component_id,
                        CRASH_ENV,
                        self._crash_at,
                    )
                    os.kill(os.getpid(), signal.SIGKILL)
                self.producer.commit()
            except KafkaException as e:
                kerr = e.args[0] if e.args and isinstance(e.args[0], KafkaError) else None
                if (
                    kerr is not None
                    and kerr.txn_requires_abort()
                    and attempt < self.options.commit_retries
                ):
                    log.warning(
                        "%s: aborting transaction (attempt %d): %s",
                        self.component_id,
                        attempt,
                        kerr,
                    )
                    self.producer.abort()
                    continue
                if kerr is not None and kerr.fatal():
                    raise RuntimeError(
                        f"{self.component_id}: fatal producer error ({kerr.str()}); if it "
                        f"says fenced, another trainer runs with transactional id "
                        f"{self.transactional_id}"
                    ) from e
                raise
            self.counters.produced += len(manifests)
            self.counters.dead_lettered += len(dead)
            del self._dead[: len(dead)]
            if status:
                self._last_status = time.monotonic()
            return

    def _status_due(self) -> bool:
        return time.monotonic() - self._last_status >= self.topology.status_interval_s

    def wait_fraction(self) -> float:
        wall = time.monotonic() - self._loop_start
        return self.counters.waiting_s / wall if wall > 0 else 0.0

    def status(self) -> ComponentStatus:
        c = self.counters
        metrics = {k: float(v) for k, v in self.last_metrics.items()}
        metrics["trainer/wait_fraction"] = self.wait_fraction()
        metrics["trainer/version"] = float(self.version if self.version is not None else -1)
        return ComponentStatus(
            component_id=self.component_id,
            kind="trainer",
            host=socket.gethostname(),
            policy=self.policy,
            state="stopping" if self._stop.is_set() else "running",
            produced=c.produced,
            consumed=c.consumed,
            dead_lettered=c.dead_lettered,
            waiting_s=c.waiting_s,
            busy_s=c.busy_s,
            weight_versions={self.policy: self.version if self.version is not None else -1},
            started_at_ms=c.started_at_ms,
            metrics=metrics,
        )

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> ServiceCounters:
        self._open()
        self._restore()
        self.consumer = Consumer(
            self.config.consumer_conf(
                self.group,
                **{
                    "session.timeout.ms": self.options.session_timeout_ms,
                    "max.poll.interval.ms": self.options.max_poll_interval_ms,
                },
            )
        )
        self.consumer.subscribe(
            [self.batches_topic],
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        log.info(
            "%s: consuming %s as group %s, transactional id %s, blobs in %s",
            self.component_id,
            self.batches_topic,
            self.group,
            self.transactional_id,
            self.store.uri,
        )
        self._loop_start = time.monotonic()
        steps = 0
        try:
            while not self._stop.is_set():
                if self.options.max_steps is not None and steps >= self.options.max_steps:
                    break
                t0 = time.monotonic()
                msgs = self.consumer.consume(1, self.options.poll_timeout_s)
                self.counters.waiting_s += time.monotonic() - t0
                if self._check_committed:
                    self._verify_committed(self.consumer)
                batch = None
                for m in msgs:
                    batch = self._decode(m)
                if batch is None:
                    if self._status_due():
                        self._commit([], offsets=False, status=True)
                    continue
                self._step(*batch)
                steps += 1
            self._commit([], offsets=False, status=True)  # a last status: the final state
        finally:
            log.info(
                "%s: leaving group %s at version %s", self.component_id, self.group, self.version
            )
            self._finish_state_write()
            self.consumer.close()
            self.store.close()
        return self.counters

    def _decode(self, m) -> tuple[Batch, str, int, int] | None:
        err = m.error()
        if err is not None:
            if err.code() == KafkaError._PARTITION_EOF:
                return None
            if err.fatal():
                raise KafkaException(err)
            log.warning("%s: consumer error: %s", self.component_id, err)
            return None
        topic, part, off = m.topic(), m.partition(), m.offset()
        self.counters.consumed += 1
        try:
            rec = self.codec.decode(m.value(), topic, part, off, expect=Batch)
            check_record(rec)
        except (RecordDecodeError, InvalidRecord) as e:
            reason = f"{type(e).__name__}: {e}"
            log.warning(
                "%s: dead-lettering %s[%d]@%d: %s", self.component_id, topic, part, off, reason
            )
            # goes out with the next version's transaction, together with this offset
            self._dead.append(dead_letter(m, self.component_id, reason))
            self.positions[(topic, part)] = off + 1
            return None
        return rec, topic, part, off

    def _step(self, batch: Batch, topic: str, part: int, off: int) -> None:
        t0 = time.monotonic()
        assert self.version is not None
        metrics = self.trainer.train_step(batch, current_version=self.version)
        self.positions[(topic, part)] = off + 1
        if metrics["trainer/loss_tokens"] == 0:
            # nothing trained (every group was stale): consume the batch without publishing a
            # version, or empty versions would make yet more data stale. Weights and optimizer
            # are unchanged, so re-reading it after a restart decides the same way.
            self.counters.busy_s += time.monotonic() - t0
            self.last_metrics = {**self.last_metrics, **metrics}
            self._commit([], offsets=True, status=self._status_due())
            log.info("%s: batch %s @%s[%d]:%d skipped at v%d: %d stale groups dropped",
                     self.component_id, batch.batch_id, topic, part, off, self.version,
                     int(metrics["trainer/stale_dropped_groups"]))
            return
        version = self.version + 1
        written = self._state_step(version, metrics)
        meta = dict(written.meta) if written is not None else {}
        meta["batch_id"] = batch.batch_id
        meta["batch_partition"] = str(part)
        meta["batch_offset"] = str(off)
        meta["loss"] = f"{metrics['trainer/loss']:.6g}"
        meta["reward_mean"] = f"{metrics['trainer/reward_mean']:.6g}"
        offsets = [PartitionOffset(t, p, o) for (t, p), o in sorted(self.positions.items())]
        t_pub = time.perf_counter()
        manifests = self.publisher.publish(
            self.trainer.published_state(),
            version=version,
            trainer_step=version,
            consumed_offsets=offsets,
            meta=meta,
        )
        metrics["trainer/publish_seconds"] = time.perf_counter() - t_pub
        self.version = version
        self.counters.steps += 1
        self.counters.busy_s += time.monotonic() - t0
        delta = next((m for m in manifests if m.kind == "delta"), manifests[0])
        metrics["trainer/version"] = float(version)
        metrics["trainer/wait_fraction"] = self.wait_fraction()
        # of the published version (in its dtype): the delta, or the full checkpoint
        metrics["trainer/weights_sparsity"] = float(delta.sparsity)
        metrics["trainer/weights_bytes"] = float(delta.encoded_bytes)
        newest = written.version if written is not None else self.state_version
        metrics["trainer/state_version"] = float(newest if newest is not None else -1)
        self.last_metrics = metrics
        self._commit(manifests, offsets=True, status=self._status_due())
        if written is not None:  # recorded by a committed manifest: older ones can go
            self.state_version = written.version
            self._state_refs.append((written.version, written.refs))
            self._drop_old_states()
        self._log_version(version, batch, (topic, part, off), metrics, manifests, written)

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

    def _state_step(self, version: int, metrics: dict[str, float]) -> WrittenState | None:
        """Collect a finished state write (to be recorded in ``version``'s manifest),
        waiting for it when the lag bound or the next state is due, and start the write
        of ``version``'s state when it is due."""
        o = self.options
        t0 = time.perf_counter()
        written = self.writer.poll()
        due = version % o.state_interval == 0
        pending = self.writer.in_flight
        if written is None and pending is not None and (due or version - pending >= o.state_lag):
            written = self.writer.wait()
        metrics["trainer/state_wait_seconds"] = time.perf_counter() - t0
        if due:
            snap = self.trainer.snapshot(version)
            metrics["trainer/state_snapshot_seconds"] = snap.seconds
            self.writer.start(snap)
        if written is not None:
            metrics["trainer/state_write_seconds"] = written.write_seconds
            metrics["trainer/state_bytes"] = float(written.bytes)
            metrics["trainer/state_version"] = float(written.version)
        return written

    def _finish_state_write(self) -> None:
        """On the way out: wait for a write in flight; no manifest will record it, so its
        blobs are deleted (a restart resumes from the newest recorded state)."""
        try:
            written = self.writer.wait()
        except RuntimeError as e:
            log.warning("%s: %s", self.component_id, e)
            return
        if written is None:
            return
        for ref in written.refs:
            self._delete_blob(ref)
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
        keep = max(1, self.options.keep_optimizer)
        while len(self._state_refs) > keep:
            _, refs = self._state_refs.pop(0)
            for ref in refs:
                self._delete_blob(ref)

    def _delete_blob(self, ref: BlobRef) -> None:
        try:
            self.store.delete(ref)
        except Exception as e:  # a store that cannot delete keeps it: harmless
            log.debug("could not delete %s: %s", ref.uri, e)


def _fmt_positions(positions: dict[tuple[str, int], int]) -> str:
    return ", ".join(f"{t}[{p}]@{o}" for (t, p), o in sorted(positions.items()))


__all__ = ["CRASH_ENV", "ServiceCounters", "ServiceOptions", "TrainerService", "default_state_dir"]
