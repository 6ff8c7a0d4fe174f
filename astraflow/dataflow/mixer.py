"""Mixer: interleave several sources at configured ratios, holding records to enforce them.

Records are keyed by their input topic (``by: topic``) or by their ``source`` field
(``by: source``; ``Task.source`` and ``TrajectoryGroup.source`` alike). With ``ratios``
``{a: 3, b: 1}`` three records of ``a`` go out for every one of ``b`` as long as both have
records to give. The order is stride scheduling: each key has a *pass* that grows by
``1 / weight`` with every record it emits, and the key with the smallest pass is due
next. When the due key has nothing held, the mixer waits for it, holding the others.

Holding is bounded: when more than ``max_held`` records are held, or the oldest has been
held ``max_hold_ms``, records are released out of ratio (counted as ``forced``), and a
key that had nothing to give is not owed a burst later: its pass is raised to the one it
would have had. Held records are not committed (``held_offsets``), so a crash redelivers
them; records leave each input partition in offset order, so what a crash redelivers is
exactly what had not been released (mixing by source, where sources share partitions,
may release a record out of turn to unblock the due one: counted as ``unblocked``).
Records whose key is not listed in ``ratios`` pass as soon as their partition lets them
(``unlisted: pass``, counted) or are dropped (``unlisted: drop``, counted).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass
from typing import Generic, TypeVar

from astraflow.config.processors import MixerOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.wire.records import now_ms

T = TypeVar("T")


@dataclass
class _Held(Generic[T]):
    seq: int  # arrival number
    at_ms: int
    key: str | None  # None: not mixed, released as soon as it heads its lane
    lane: Hashable
    item: T


class RatioMixer(Generic[T]):
    """Stride-scheduled mixing of keyed items at fixed ratios, with a bound on holding.

    Items arrive in *lanes* (for the processor: input partitions) and leave each lane in
    arrival order, so that committing a partition up to its oldest held record never
    skips one that was not released. When the key that is due has items but all of them
    sit behind other keys' items in their lanes, those blockers are released first
    (counted in ``unblocked``); with one key per lane (mixing by topic) this never happens.
    """

    def __init__(self, ratios: dict[str, float], max_held: int = 1000,
                 max_hold_ms: int | None = None):
        self.weights = dict(ratios)
        self.max_held = max_held
        self.max_hold_ms = max_hold_ms
        self.lanes: dict[Hashable, deque[_Held[T]]] = {}
        self.counts: dict[str, int] = dict.fromkeys(ratios, 0)
        self.passes: dict[str, float] = dict.fromkeys(ratios, 0.0)
        self.order = {k: i for i, k in enumerate(ratios)}
        self.emitted: dict[str, int] = dict.fromkeys(ratios, 0)
        self.forced = 0
        self.unblocked = 0
        self.free = 0
        self._seq = 0

    def add(self, key: str | None, item: T, now: int, lane: Hashable = None) -> None:
        """Hold ``item`` under ``key`` in ``lane`` (default: the key).

        ``key`` is one of the ratios' keys, or None for an item that is not mixed: it
        leaves as soon as nothing is ahead of it in its lane.
        """
        lane = key if lane is None else lane
        self.lanes.setdefault(lane, deque()).append(_Held(self._seq, now, key, lane, item))
        if key is None:
            self.free += 1
        else:
            self.counts[key] += 1
        self._seq += 1

    @property
    def held(self) -> int:
        """Number of items held (mixed or not)."""
        return sum(self.counts.values()) + self.free

    def items(self) -> Iterable[T]:
        """Every held item."""
        for q in self.lanes.values():
            for h in q:
                yield h.item

    def discard(self, pred: Callable[[T], bool]) -> int:
        """Forget held items for which ``pred`` is true; returns how many."""
        n = 0
        for lane, q in list(self.lanes.items()):
            kept: deque[_Held[T]] = deque()
            for h in q:
                if pred(h.item):
                    if h.key is None:
                        self.free -= 1
                    else:
                        self.counts[h.key] -= 1
                    n += 1
                else:
                    kept.append(h)
            self.lanes[lane] = kept
        return n

    def _rank(self, k: str) -> tuple[float, int]:
        return self.passes[k], self.order[k]

    def take(self, now: int) -> list[tuple[str | None, T]]:
        """Release what the ratios (and the holding bounds) allow, in order."""
        out: list[tuple[str | None, T]] = []
        while True:
            for q in self.lanes.values():
                while q and q[0].key is None:
                    out.append((None, q.popleft().item))
                    self.free -= 1
            held = self.held
            if not held:
                break
            heads = [q[0] for q in self.lanes.values() if q]
            first: dict[str, _Held[T]] = {}  # key -> its earliest lane head
            for h in heads:
                assert h.key is not None
                if h.key not in first or h.seq < first[h.key].seq:
                    first[h.key] = h
            due = min(self.weights, key=self._rank)
            if due in first:
                h = first[due]
            elif self.counts[due]:
                oldest = min((x for q in self.lanes.values() for x in q if x.key == due),
                             key=lambda x: x.seq)
                h = self.lanes[oldest.lane][0]
                self.unblocked += 1
            else:
                if held > self.max_held:
                    h = first[min(first, key=self._rank)]
                elif (self.max_hold_ms is not None
                      and min(x.at_ms for x in heads) + self.max_hold_ms <= now):
                    h = min(heads, key=lambda x: (x.at_ms, x.seq))
                else:
                    break
                self.forced += 1
                for e, n in self.counts.items():  # empty keys are not owed this slot later
                    if not n and self.passes[e] < self.passes[h.key]:
                        self.passes[e] = self.passes[h.key]
            self.lanes[h.lane].popleft()
            self.counts[h.key] -= 1
            self.passes[h.key] += 1.0 / self.weights[h.key]
            self.emitted[h.key] += 1
            out.append((h.key, h.item))
        return out


class Mixer(Processor):
    """Interleaves inputs (by topic or by source) at configured ratios; bounded holding."""

    kind = "mixer"
    Options = MixerOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        o = self.options
        self.mix: RatioMixer[Incoming] = RatioMixer(o.ratios, o.max_held, o.max_hold_ms)
        self.unlisted_passed = 0
        self.unlisted_dropped = 0

    def key_of(self, msg: Incoming) -> str:
        """The mixing key of a record: its input topic or its ``source`` field."""
        if self.options.by == "topic":
            return msg.topic
        return str(getattr(msg.record, "source", ""))

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        key: str | None = self.key_of(msg)
        if key not in self.mix.weights:
            if self.options.unlisted == "drop":
                self.unlisted_dropped += 1
                return ()
            self.unlisted_passed += 1
            key = None  # passes in flush, once nothing is held ahead of it in its partition
        self.mix.add(key, msg, now_ms(), lane=(msg.topic, msg.partition))
        return ()

    def flush(self, now_ms: int) -> Iterable[Outgoing]:
        return [Outgoing(t, m.record, key=m.key)
                for _, m in self.mix.take(now_ms) for t in self.outputs]

    def held_offsets(self) -> dict[tuple[str, int], int]:
        oldest: dict[tuple[str, int], int] = {}
        for m in self.mix.items():
            tp = (m.topic, m.partition)
            oldest[tp] = min(oldest.get(tp, m.offset), m.offset)
        return oldest

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        gone = set(partitions)
        self.mix.discard(lambda m: (m.topic, m.partition) in gone)

    def metrics(self) -> dict[str, float]:
        return {
            "mixer/held": float(self.mix.held),
            "mixer/forced": float(self.mix.forced),
            "mixer/unblocked": float(self.mix.unblocked),
            "mixer/unlisted_passed": float(self.unlisted_passed),
            "mixer/unlisted_dropped": float(self.unlisted_dropped),
            **{f"mixer/emitted/{k}": float(n) for k, n in self.mix.emitted.items()},
        }
