"""Collects a policy's trajectory groups into ``Batch`` records of a fixed size.

With ``replay_ratio > 0`` the batcher also serves replayed groups: every group it has put
in a batch goes into a bounded replay buffer, and each later batch takes up to
``floor(replay_ratio * batch_size)`` of its groups from that buffer (chosen by
``replay_selection``) and the rest fresh. Replayed groups obey the same staleness bound as
fresh ones: before each batch is cut, every buffered group whose oldest generated token is
more than ``max_staleness`` versions behind the policy's latest published version is
evicted for good (versions only grow, so it could never become fresh again).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import random
import statistics
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from confluent_kafka import KafkaError, KafkaException

from astraflow.config.processors import BatcherOptions, ReplaySelection
from astraflow.dataflow.base import Incoming, Outgoing, Processor, ProcessorContext, SideAccess
from astraflow.dataflow.staleness import staleness
from astraflow.dataflow.versions import LatestVersions, VersionSource, known_versions
from astraflow.kafka.config import TABLE_GROUP
from astraflow.kafka.table import TopicReader
from astraflow.wire.records import Batch, OffsetRange, TrajectoryGroup, now_ms

log = logging.getLogger("astraflow.batcher")


@dataclass
class ReplayEntry:
    """A buffered group: ``order`` is when it entered the buffer, ``uses`` its replays."""

    group: TrajectoryGroup
    order: int
    uses: int = 0


def _rewards(group: TrajectoryGroup) -> list[float]:
    return list(group.rewards) or [s.reward for s in group.sequences]


class ReplayBuffer:
    """A bounded buffer of already-batched groups and the rule that picks replays from it.

    Plain logic, no Kafka: ``add`` groups after they were served fresh (the oldest are
    dropped beyond ``capacity``), ``evict_stale`` before choosing, ``select`` to choose.
    """

    def __init__(self, capacity: int, selection: ReplaySelection = "uniform",
                 max_uses: int | None = None, seed: int | None = None):
        if capacity < 1:
            raise ValueError("replay capacity must be at least 1")
        self.capacity = capacity
        self.selection: ReplaySelection = selection
        self.max_uses = max_uses
        self.rng = random.Random(seed)
        self.entries: list[ReplayEntry] = []
        self._order = 0
        self.evicted_full = 0
        self.evicted_stale = 0

    def __len__(self) -> int:
        return len(self.entries)

    def add(self, groups: Iterable[TrajectoryGroup]) -> None:
        """Buffer groups that were just served fresh; drop the oldest beyond capacity."""
        for g in groups:
            self.entries.append(ReplayEntry(g, self._order))
            self._order += 1
        excess = len(self.entries) - self.capacity
        if excess > 0:
            self.entries.sort(key=lambda e: e.order)
            del self.entries[:excess]
            self.evicted_full += excess

    def evict_stale(self, versions: VersionSource, max_staleness: int) -> int:
        """Drop every group more than ``max_staleness`` versions behind; returns how many."""
        kept = [e for e in self.entries if staleness(e.group, versions) <= max_staleness]
        gone = len(self.entries) - len(kept)
        self.entries = kept
        self.evicted_stale += gone
        return gone

    def select(self, n: int) -> list[TrajectoryGroup]:
        """Up to ``n`` distinct groups by the selection rule; counts a use of each."""
        n = min(n, len(self.entries))
        if n <= 0:
            return []
        if self.selection == "uniform":
            chosen = self.rng.sample(self.entries, n)
        elif self.selection == "recent":
            chosen = sorted(self.entries, key=lambda e: -e.order)[:n]
        elif self.selection == "high_reward":
            chosen = sorted(self.entries,
                            key=lambda e: (-statistics.fmean(_rewards(e.group) or [0.0]),
                                           -e.order))[:n]
        elif self.selection == "max_variance":
            chosen = sorted(self.entries,
                            key=lambda e: (-statistics.pvariance(_rewards(e.group) or [0.0]),
                                           -e.order))[:n]
        else:  # pragma: no cover - the options model forbids other values
            raise ValueError(f"unknown replay selection {self.selection!r}")
        out = []
        for e in chosen:
            e.uses += 1
            meta = {**e.group.meta, "replay_uses": str(e.uses)}
            out.append(dataclasses.replace(e.group, meta=meta))
        if self.max_uses is not None:
            self.entries = [e for e in self.entries if e.uses < self.max_uses]
        return out


class Batcher(Processor):
    """Emits a ``Batch`` on ``batches.<policy>`` whenever ``batch_size`` groups are held.

    Held groups are not yet committed: ``held_offsets`` keeps the runtime from committing
    past them, so a crash redelivers them instead of losing them. With replay on, a batch
    holds ``batch_size - r`` fresh groups followed by ``r`` replayed ones (``Batch.replayed
    = r``); only the fresh ones appear in ``source_offsets``, the replayed ones were
    committed when they were first served.
    """

    kind = "batcher"
    Options = BatcherOptions

    def __init__(self, name, inputs, outputs, options=None, versions: VersionSource | None = None):
        super().__init__(name, inputs, outputs, options)
        self.versions = versions
        self.held: list[Incoming] = []
        self.batches = 0
        self.dropped_stale = 0
        self.replayed = 0
        o = self.options
        self.replay: ReplayBuffer | None = (
            ReplayBuffer(o.replay_capacity, o.replay_selection, o.replay_max_uses,
                         o.replay_seed)
            if o.replay_ratio > 0 else None)

    @property
    def replay_quota(self) -> int:
        """Most replayed groups one batch may hold: ``floor(replay_ratio * batch_size)``."""
        return math.floor(self.options.replay_ratio * self.options.batch_size + 1e-9)

    def weight_versions(self) -> dict[str, int]:
        return known_versions(self.versions, [self.options.policy])

    def side_access(self, topology) -> SideAccess:
        """It follows ``weights.<policy>`` (with a staleness bound) and reads back its own
        last batches to refill the replay buffer (``replay_rebuild``)."""
        reads = []
        if self.options.max_staleness is not None:
            reads.append(f"weights.{self.options.policy}")
        if self.replay is not None and self.options.replay_rebuild:
            reads.append(f"batches.{self.options.policy}")
        return SideAccess(reads=tuple(reads), reader_groups=(TABLE_GROUP,) if reads else ())

    def open(self, context: ProcessorContext) -> None:
        if self.versions is None and self.options.max_staleness is not None:
            topic = context.topology.full_name(f"weights.{self.options.policy}")
            self.versions = LatestVersions(context.config, context.codec,
                                           {self.options.policy: topic})
        if self.replay is not None and self.options.replay_rebuild:
            self._rebuild(context)

    def close(self) -> None:
        if isinstance(self.versions, LatestVersions):
            self.versions.close()

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.held.append(msg)
        return ()

    def flush(self, now: int) -> Iterable[Outgoing]:
        out = []
        if self.options.max_staleness is not None and (self.held or self.replay):
            self.versions.refresh()
            fresh = [m for m in self.held
                     if staleness(m.record, self.versions) <= self.options.max_staleness]
            self.dropped_stale += len(self.held) - len(fresh)
            self.held = fresh
            if self.replay:
                self.replay.evict_stale(self.versions, self.options.max_staleness)
        size = self.options.batch_size
        while True:
            n_replay = min(self.replay_quota, len(self.replay)) if self.replay else 0
            n_fresh = size - n_replay  # >= 1: replay_ratio < 1
            if len(self.held) < n_fresh:
                break
            taken, self.held = self.held[:n_fresh], self.held[n_fresh:]
            replayed = self.replay.select(n_replay) if self.replay else []
            out.append(Outgoing(f"batches.{self.options.policy}", self._batch(taken, replayed),
                                key=self.options.policy))
            if self.replay is not None:
                self.replay.add(m.record for m in taken)
        return out

    def _batch(self, taken: list[Incoming], replayed: list[TrajectoryGroup] | None = None
               ) -> Batch:
        ranges: dict[tuple[str, int], list[int]] = {}
        for m in taken:
            r = ranges.setdefault((m.topic, m.partition), [m.offset, m.offset + 1])
            r[0], r[1] = min(r[0], m.offset), max(r[1], m.offset + 1)
        replayed = replayed or []
        self.batches += 1
        self.replayed += len(replayed)
        return Batch(
            policy=self.options.policy, batch_id=uuid.uuid4().hex,
            groups=[m.record for m in taken] + replayed,
            replayed=len(replayed),
            source_offsets=[OffsetRange(t, p, a, b) for (t, p), (a, b) in sorted(ranges.items())],
            created_at_ms=now_ms(),
        )

    def _rebuild(self, context: ProcessorContext, timeout_s: float = 30.0) -> None:
        """Refill the replay buffer with the fresh groups of the last batches produced.

        Each batch has at least one fresh group, so ``replay_capacity`` batches suffice;
        offsets also count one transaction marker per batch, hence twice as many.
        """
        topic = context.topology.full_name(f"batches.{self.options.policy}")
        batches = _read_tail(context.config, context.codec, topic,
                             2 * self.options.replay_capacity, timeout_s)
        for b in batches:
            self.replay.add(b.groups[: len(b.groups) - b.replayed])
        if batches:
            log.info("%s: replay buffer rebuilt from %d batches of %s: %d groups",
                     context.component_id, len(batches), topic, len(self.replay))

    def held_offsets(self) -> dict[tuple[str, int], int]:
        oldest: dict[tuple[str, int], int] = {}
        for m in self.held:
            key = (m.topic, m.partition)
            oldest[key] = min(oldest.get(key, m.offset), m.offset)
        return oldest

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        gone = set(partitions)
        self.held = [m for m in self.held if (m.topic, m.partition) not in gone]

    def metrics(self) -> dict[str, float]:
        out = {"batcher/batches": float(self.batches), "batcher/held": float(len(self.held)),
               "batcher/dropped_stale": float(self.dropped_stale)}
        if self.replay is not None:
            out.update({
                "batcher/replayed": float(self.replayed),
                "batcher/replay_buffer": float(len(self.replay)),
                "batcher/replay_evicted_stale": float(self.replay.evicted_stale),
                "batcher/replay_evicted_full": float(self.replay.evicted_full),
            })
        return out


def _read_tail(config, codec, topic: str, max_offsets: int, timeout_s: float) -> list[Batch]:
    """The committed batches among the last ``max_offsets`` offsets of each partition."""
    try:
        reader: TopicReader[Batch] = TopicReader(config, topic, Batch, codec=codec,
                                                 start=-max_offsets, client_id="replay-rebuild")
    except KafkaException as e:
        err = e.args[0] if e.args else None
        if isinstance(err, KafkaError) and err.code() == KafkaError.UNKNOWN_TOPIC_OR_PART:
            return []
        raise
    try:
        out = [e.value for e in reader.catch_up(timeout_s) if e.value is not None]
    finally:
        reader.close()
    out.sort(key=lambda b: b.created_at_ms)
    return out
