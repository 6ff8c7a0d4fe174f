"""Collects a policy's trajectory groups into ``Batch`` records of a fixed size."""

from __future__ import annotations

import uuid
from collections.abc import Iterable

from pydantic import BaseModel, ConfigDict, Field

from astraflow.dataflow.base import Incoming, Outgoing, Processor, ProcessorContext
from astraflow.dataflow.staleness import staleness
from astraflow.dataflow.versions import LatestVersions, VersionSource
from astraflow.records import Batch, OffsetRange, now_ms


class BatcherOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str = "actor"
    batch_size: int = Field(default=8, ge=1, description="groups per batch")
    max_staleness: int | None = Field(
        default=None, ge=0, description="re-check staleness when a batch is cut")


class Batcher(Processor):
    """Emits a ``Batch`` on ``batches.<policy>`` whenever ``batch_size`` groups are held.

    Held groups are not yet committed: ``held_offsets`` keeps the runtime from committing
    past them, so a crash redelivers them instead of losing them.
    """

    kind = "batcher"
    Options = BatcherOptions

    def __init__(self, name, inputs, outputs, options=None, versions: VersionSource | None = None):
        super().__init__(name, inputs, outputs, options)
        self.versions = versions
        self.held: list[Incoming] = []
        self.batches = 0
        self.dropped_stale = 0

    def open(self, context: ProcessorContext) -> None:
        if self.versions is None and self.options.max_staleness is not None:
            topic = context.topology.full_name(f"weights.{self.options.policy}")
            self.versions = LatestVersions(context.config, context.codec,
                                           {self.options.policy: topic})

    def close(self) -> None:
        if isinstance(self.versions, LatestVersions):
            self.versions.close()

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.held.append(msg)
        return ()

    def flush(self, now: int) -> Iterable[Outgoing]:
        out = []
        if self.options.max_staleness is not None and self.held:
            self.versions.refresh()
            fresh = [m for m in self.held
                     if staleness(m.record, self.versions) <= self.options.max_staleness]
            self.dropped_stale += len(self.held) - len(fresh)
            self.held = fresh
        while len(self.held) >= self.options.batch_size:
            taken = self.held[: self.options.batch_size]
            self.held = self.held[self.options.batch_size:]
            out.append(Outgoing(f"batches.{self.options.policy}", self._batch(taken),
                                key=self.options.policy))
        return out

    def _batch(self, taken: list[Incoming]) -> Batch:
        ranges: dict[tuple[str, int], list[int]] = {}
        for m in taken:
            r = ranges.setdefault((m.topic, m.partition), [m.offset, m.offset + 1])
            r[0], r[1] = min(r[0], m.offset), max(r[1], m.offset + 1)
        self.batches += 1
        return Batch(
            policy=self.options.policy, batch_id=uuid.uuid4().hex,
            groups=[m.record for m in taken],
            source_offsets=[OffsetRange(t, p, a, b) for (t, p), (a, b) in sorted(ranges.items())],
            created_at_ms=now_ms(),
        )

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
        return {"batcher/batches": float(self.batches), "batcher/held": float(len(self.held)),
                "batcher/dropped_stale": float(self.dropped_stale)}
