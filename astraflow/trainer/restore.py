"""Restoring a trainer where its published versions left it, apart from its Kafka loop.

``Restorer`` does steps 2 and 3 of a restart (``astraflow.trainer.service``'s docstring):
it reads the policy's manifests (rank 0; the other ranks of a group get rank 0's list),
keeps the trusted ones, loads the newest recorded trainer state (the blob format, or
``torch.distributed.checkpoint``'s in a directory or in the blob store) and checks that
its master weights round to that version's published weights, then recomputes the
versions after it from their batches (``astraflow.trainer.resume``). What it arrived at is
a ``Restored``; publishing a rebase, committing and consuming are the service's work.
``resume_positions`` checks where the consumer group would resume against a manifest.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from confluent_kafka import Consumer, TopicPartition

from astraflow.kafka.config import KafkaConfig
from astraflow.models.lora import settings_of as lora_settings_of
from astraflow.trainer.checkpoint_writer import fetch_state_files
from astraflow.trainer.regroup import RegroupedFollower
from astraflow.trainer.resume import BatchReader, newest_state, recompute, trained_batches
from astraflow.trainer.state import STATE_DIR_KEY, STATE_FILES_KEY
from astraflow.weights.errors import BlobError, NoPlanError
from astraflow.weights.follower import WeightFollower, parts_count
from astraflow.weights.signing import split_trusted
from astraflow.weights.stores import StoreResolver
from astraflow.wire.records import BlobRef, WeightManifest

if TYPE_CHECKING:
    from astraflow.config.lora import LoraSpec
    from astraflow.trainer.parallel import Group
    from astraflow.trainer.trainer import Trainer

log = logging.getLogger("astraflow.trainer")


@dataclass
class Restored:
    """What a restore arrived at: the trainer holds the weights (and state) that have
    trained every batch up to version ``latest``."""

    manifests: list[WeightManifest]  # the trusted manifests of the policy
    latest: int  # the newest published version (L)
    start: int  # the version of the newest recorded state (k; 0: the model directory)
    recorded: bool  # whether a state was recorded (else version 0 from the model)
    # version L's published weights (None when the recompute differs from them): this
    # rank's part alone when ``part`` (a rank of a group that followed its own rows)
    published: dict[str, Any] | None
    differs: str | None  # why the recompute differs from version L (then: a rebase)
    optimizer: str  # how the optimizer state was obtained, for the log
    master: str  # how the master weights were obtained, for the log
    applied: int  # manifests the follower applied to reach version k
    bytes_fetched: int
    replay_seconds: float
    part: bool = False

    @property
    def last(self) -> WeightManifest:
        """Version L's manifest."""
        return [m for m in self.manifests if m.version == self.latest][0]


class Restorer:
    """Restores ``trainer`` (one rank's, in a group) from ``policy``'s versions on
    ``weights_topic`` and the blobs in ``store``."""

    def __init__(self, trainer: Trainer, store: Any, kafka_config: KafkaConfig, codec: Any,
                 *, policy: str, weights_topic: str, batches_topic: str, state_dir: Path,
                 lora: LoraSpec | None = None, verifier: Any = None,
                 name: str = "trainer"):
        self.trainer = trainer
        self.store = store
        self.config = kafka_config
        self.codec = codec
        self.policy = policy
        self.weights_topic = weights_topic
        self.batches_topic = batches_topic
        self.state_dir = state_dir
        self.lora = lora
        self.verifier = verifier
        self.name = name  # for the log
        # the manifests refused (not signed by the key), with why: dead-lettered at start
        self.refused: list[tuple[WeightManifest, str]] = []

    @property
    def group(self) -> Group:
        """The trainer's processes: they restore together."""
        return self.trainer.group

    @property
    def rank(self) -> int:
        return self.group.rank

    def read_manifests(self) -> list[WeightManifest]:
        """Rank 0: the trusted manifests of the policy on ``weights.<policy>``, handed to
        every other rank (they restore from the same list)."""
        from astraflow.weights.stores.kafka import read_manifests

        manifests = None
        if self.rank == 0:
            manifests = self.trusted([
                m for m in read_manifests(self.config, self.weights_topic)
                if m.policy == self.policy])
        return self.group.command(manifests)

    def trusted(self, manifests: list[WeightManifest]) -> list[WeightManifest]:
        """The manifests a resume may use: with a public key configured, those signed by
        its key. Each refused one is logged (and dead-lettered at start), never loaded; the
        resume goes on from the trusted ones. When every manifest is refused there is
        nothing to resume from, and publishing version 0 over them would restart the run:
        ``RuntimeError``."""
        kept, refused = split_trusted(manifests, self.verifier)
        for m, why in refused:
            log.warning("%s: not resuming from %s v%d (%s): refused: %s", self.name,
                        self.weights_topic, m.version, m.kind, why)
        self.refused = refused
        if refused and not kept:
            raise RuntimeError(
                f"{self.weights_topic}: every manifest of {self.policy} is refused "
                f"({refused[-1][1]}); not resuming from any, nor publishing version 0 over "
                "them: check weight_signing.public_key, or train into a new run")
        return kept

    def restore(self, manifests: list[WeightManifest]) -> Restored:
        """Load the newest recorded state of ``manifests`` (not empty) and recompute the
        versions after it; every rank of a group calls it."""
        check_lora(manifests, self.lora, self.weights_topic)
        latest = max(m.version for m in manifests)
        start, meta = newest_state(manifests)
        follower, res = self._follow(manifests, start)
        part = follower.part is not None
        opt, master = self.load_state(follower, start, meta, manifests)
        # the schedule's count: the batches version start has trained (not its number: a
        # rebase version trained none of its own)
        self.trainer.steps = trained_batches(manifests, start)
        reader = BatchReader(self.config, self.batches_topic, self.codec)
        try:
            replayed = recompute(self.trainer, follower, manifests, start, latest, reader,
                                 self.weights_topic)
        finally:
            reader.close()
        published = None
        if replayed.differs is None:
            assert follower.state is not None
            published = follower.state
        return Restored(manifests=manifests, latest=latest, start=start, recorded=bool(meta),
                        published=published, differs=replayed.differs, optimizer=opt,
                        master=master, applied=len(res.applied),
                        bytes_fetched=res.bytes_fetched, replay_seconds=replayed.seconds,
                        part=part)

    def _follow(self, manifests: list[WeightManifest], start: int) -> tuple[Any, Any]:
        """A follower of the published weights at version ``start`` (and the result of
        getting there). A rank of a sharded group never holds the whole model when every
        version from ``start`` on is made of one count of processes' parts: of as many
        processes as resume it (the usual restart), it follows its own part alone; of
        another count, the ranks share the publishers' parts and hand each other their
        rows (``RegroupedFollower``). Otherwise (one process's versions, a count changing
        within them) every rank follows whole versions. Every rank sees the same
        manifests, so all take the same way; when one cannot reach ``start`` by parts (a
        blob missing), they agree to fall back together (a collective)."""
        def follower(part: tuple[int, int] | None) -> WeightFollower:
            f = WeightFollower(policy=self.policy, stores=[self.store],
                               kafka_config=self.config, inplace=False, part=part)
            f.observe(manifests)
            return f

        g = self.group
        counts = {parts_count(m) for m in manifests if m.version >= start}
        count = counts.pop() if len(counts) == 1 else None
        if self.trainer.fully_sharded and count is not None and count > 1:
            if count == g.world:
                f: Any = follower((g.rank, g.world))
                how = f"its own rows of each version ({g.rank + 1} of {g.world} parts)"
            else:
                f = RegroupedFollower(g, count, manifests, follower,
                                      StoreResolver([self.store], self.config))
                how = (f"its rows of versions of {count} parts, through parts "
                       f"{[p + 1 for p in f.parts] or 'none'} (regrouped to {g.world})")
            try:
                res = f.update(start)
                failed = False
            except NoPlanError as e:
                log.info("%s: rank %d cannot follow its rows of version %d by parts (%s)",
                         self.name, g.rank, start, e)
                failed = True
            if not g.max_floats({"failed": float(failed)})["failed"]:
                log.info("%s: rank %d follows %s", self.name, g.rank, how)
                return f, res
            f.close()  # every rank falls back together
        f = follower(None)
        return f, f.update(start)

    def load_state(
        self, follower, version: int, meta: dict[str, str], manifests: list[WeightManifest]
    ) -> tuple[str, str]:
        """Load the trainer state of ``version`` (recorded in ``meta``; the follower holds
        its published weights, or this rank's part of them); how the optimizer and the
        master weights were obtained."""
        published = follower.state
        part = follower.part is not None
        assert follower.version == version and published is not None
        dtype = [m for m in manifests if m.version == version][0].dtype
        self._check_published_dtypes(published, version, dtype)
        if STATE_DIR_KEY in meta:
            return self._load_checkpoint(meta[STATE_DIR_KEY], published, version, part)
        if STATE_FILES_KEY in meta:
            into = self.state_dir / "checkpoints" / f"{self.policy}.restore-{self.rank}"
            shutil.rmtree(into, ignore_errors=True)
            try:
                fetch_state_files(meta, into, follower.resolver.open)
                return self._load_checkpoint(str(into), published, version, part,
                                             source=f"the blob store ({self.store.uri})")
            except BlobError as e:
                raise RuntimeError(f"{self.weights_topic}: the state of version {version} "
                                   f"is unusable ({e}); cannot resume exactly") from e
            finally:
                shutil.rmtree(into, ignore_errors=True)
        if self.trainer.sharded and "optimizer_uri" in meta:
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
            self.trainer.load_weights(published, part=part)
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
            if self.trainer.published_difference(published, part=part) is not None:
                raise RuntimeError(
                    f"{self.weights_topic}: the master weights of version {version} (from "
                    f"{master}) do not round to its published weights; cannot resume exactly"
                )
        return opt, master

    def _load_checkpoint(self, where: str, published, version: int, part: bool,
                         source: str | None = None) -> tuple[str, str]:
        """Load the state of ``version`` written through ``torch.distributed.checkpoint``
        (by any number of processes) into this process's share of the trainer."""
        from astraflow.trainer import checkpoint

        try:
            checkpoint.load(self.trainer, where)
        except (OSError, RuntimeError, ValueError) as e:
            raise RuntimeError(f"{self.weights_topic}: the state of version {version} in "
                               f"{where} is unusable ({e}); cannot resume exactly") from e
        if self.trainer.published_difference(published, part=part) is not None:
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


def check_lora(manifests: list[WeightManifest], mine: LoraSpec | None,
               weights_topic: str) -> None:
    """Refuse, in one line, to resume a policy whose published versions are another
    kind of weights (full against adapter) or an adapter of another shape than ``mine``
    (None: the whole model)."""
    newest = max(manifests, key=lambda m: m.version)
    published = lora_settings_of(newest.meta)
    if published == mine:
        return

    def said(x: LoraSpec | None) -> str:
        return "the whole model" if x is None else f"a LoRA adapter {x.to_json()}"

    raise RuntimeError(
        f"{weights_topic} holds {said(published)} (version {newest.version}), this "
        f"trainer trains {said(mine)}: set the policy's lora: as the run was started, or "
        "start a new run")


def resume_positions(kafka_config: KafkaConfig, group_id: str,
                     positions: dict[tuple[str, int], int], version: int,
                     name: str = "trainer") -> dict[tuple[str, int], int]:
    """Where to consume from: the group's committed offsets, checked against version
    ``version``'s manifest (``positions``; they may only be past it, by skipped or
    dead-lettered batches)."""
    consumer = Consumer(kafka_config.consumer_conf(group_id))  # reads, never joins
    try:
        tps = [TopicPartition(t, p) for t, p in positions]
        committed = consumer.committed(tps, timeout=30) if tps else []
    finally:
        consumer.close()
    out = {}
    for tp in committed:
        mine = positions[(tp.topic, tp.partition)]
        group = tp.offset if tp.offset >= 0 else None
        where = f"{name}: {tp.topic}[{tp.partition}]: committed offset {group}"
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


__all__ = ["Restored", "Restorer", "check_lora", "resume_positions"]
