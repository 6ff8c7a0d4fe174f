"""Autoscaling advice: size each RaaS pool so that its trainers are just kept busy.

The ``autoscaler`` processor reads ``status`` (every component's ``ComponentStatus``) and
writes ``ScalingAdvice`` records to ``scaling``, one per decision, keyed by pool. It acts on
nothing itself: an actuator (an operator's own, or one in ``astraflow up``) starts and stops
RaaS nodes to follow the advice.

The signal is the trainers' waiting fraction: the share of wall time a trainer spent
waiting for a batch over the last ``window_s`` (``waiting_s`` and ``at_ms`` differences
between its statuses). With a dead band between ``lower`` and ``upper``:

- above ``upper`` (10 %) the trainer is starved for data: one node more, up to ``max_size``;
- below ``lower`` (5 %) batches queue up and rollouts only grow stale: one node less, down
  to ``min_size``;
- whatever the trainers do, when the pool's nodes wait for tasks more than ``idle_above``
  (90 %) of the time there is nothing to roll out: one node less (branch ``idle``);
- in between: no advice, unless the pool has fewer nodes than ``min_size`` or more than
  ``max_size`` (then the advice brings it back within, branch ``clamp``).

A pool driven by several trainers follows the one that waits the most. A pool's size is
its RaaS components whose last status is at most ``stale_after_s`` old and not
``stopping``. After an advice the pool gets none for ``cooldown_s``, so a new node can
start and show its effect first. No trainer alive (a run starting, or the autoscaler still
catching up on ``status``): no advice. ``ScalingPolicy`` is the decision logic and takes
every time as an argument; ``Autoscaler`` is the processor around it.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from astraflow.config.processors import AutoscalerOptions, PoolBounds
from astraflow.dataflow.base import Incoming, Outgoing, Processor, ProcessorContext
from astraflow.wire.records import ComponentStatus, ScalingAdvice

log = logging.getLogger("astraflow.autoscaler")

RAAS, TRAINER = "raas", "trainer"  # ComponentStatus.kind of RaaS nodes and trainers
UP, DOWN, CLAMP, IDLE = "up", "down", "clamp", "idle"


# --- decision logic, no Kafka -----------------------------------------------------------
@dataclass(frozen=True, slots=True)
class Sample:
    """The counters of one status, at the time the component read them."""

    at_ms: int
    waiting_s: float
    produced: int
    consumed: int


@dataclass
class Seen:
    """One component: its latest status and its samples over the window (the oldest one
    at or before the window's start, as the baseline of differences)."""

    status: ComponentStatus
    samples: deque[Sample] = field(default_factory=deque)

    @property
    def at_ms(self) -> int:
        """When the latest status was read (its ``at_ms``, else its Kafka timestamp)."""
        return self.samples[-1].at_ms if self.samples else self.status.at_ms

    def restarted_by(self, status: ComponentStatus) -> bool:
        """Whether ``status`` comes from a new life of the component (counters restart)."""
        last = self.status
        return (status.started_at_ms != last.started_at_ms
                or status.waiting_s < last.waiting_s or status.produced < last.produced
                or status.consumed < last.consumed)

    def span(self) -> tuple[Sample, Sample, float] | None:
        """First and last sample and the seconds between them; None with fewer than two."""
        if len(self.samples) < 2:
            return None
        first, last = self.samples[0], self.samples[-1]
        seconds = (last.at_ms - first.at_ms) / 1000
        return (first, last, seconds) if seconds > 0 else None


def idle_fraction(nodes: list[Seen]) -> float | None:
    """The share of wall time the pool's nodes waited for tasks over the window (their
    mean); None when no node has two statuses yet."""
    shares = []
    for seen in nodes:
        span = seen.span()
        if span is not None:
            first, last, seconds = span
            shares.append(min(1.0, max(0.0, (last.waiting_s - first.waiting_s) / seconds)))
    return sum(shares) / len(shares) if shares else None


def wait_fraction(seen: Seen) -> float | None:
    """The share of wall time a trainer waited for input over the window; with a single
    status, the fraction it reports itself (since it started); None when neither is known."""
    span = seen.span()
    if span is not None:
        first, last, seconds = span
        return min(1.0, max(0.0, (last.waiting_s - first.waiting_s) / seconds))
    reported = seen.status.metrics.get("trainer/wait_fraction")
    return None if reported is None else min(1.0, max(0.0, float(reported)))


def rate(seen: Seen, counter: str) -> float:
    """Records per second of ``counter`` (``produced`` or ``consumed``) over the window;
    0 with fewer than two statuses."""
    span = seen.span()
    if span is None:
        return 0.0
    first, last, seconds = span
    return max(0.0, getattr(last, counter) - getattr(first, counter)) / seconds


def _percent(x: float) -> str:
    return f"{x * 100:.0f}%" if abs(x * 100 - round(x * 100)) < 1e-9 else f"{x * 100:.1f}%"


@dataclass(frozen=True)
class Reading:
    """What one pool looks like now: its live nodes and its driving trainer."""

    nodes: list[Seen]
    trainer: str  # policy of the trainer that waits the most
    wait: float  # its waiting fraction


class ScalingPolicy:
    """Keeps the latest statuses and decides the advice; every time is an argument.

    ``observe`` takes each status; ``decide(now_ms)`` returns the advice due at
    ``now_ms``. No advice comes before statuses spanning ``stale_after_s`` have been
    observed, so a restarted autoscaler first learns every live node.
    """

    def __init__(self, options: AutoscalerOptions):
        self.options = options
        self.seen: dict[str, Seen] = {}
        self.last_advice_ms: dict[str, int] = {}
        self.readings: dict[str, Reading] = {}  # pool -> at the last decide
        self._first_ms: int | None = None

    @property
    def window_ms(self) -> int:
        return int(self.options.window_s * 1000)

    @property
    def stale_ms(self) -> int:
        return int(self.options.stale_after_s * 1000)

    def observe(self, status: ComponentStatus, at_ms: int | None = None) -> None:
        """Take one status; ``at_ms`` (its Kafka timestamp) stands in for a missing
        ``status.at_ms``. Other kinds than RaaS nodes and trainers, statuses with no time
        and statuses older than one already seen from the same component are ignored."""
        t = status.at_ms or at_ms or 0
        if status.kind not in (RAAS, TRAINER) or t <= 0:  # untimed: cannot be judged
            return
        self._first_ms = t if self._first_ms is None else min(self._first_ms, t)
        seen = self.seen.get(status.component_id)
        if seen is not None and t < seen.at_ms:
            return
        if seen is None or seen.restarted_by(status):
            seen = self.seen[status.component_id] = Seen(status)
        seen.status = status
        seen.samples.append(Sample(t, status.waiting_s, status.produced, status.consumed))
        # keep one sample at or before the window's start: the baseline of the differences
        while len(seen.samples) > 2 and seen.samples[1].at_ms <= t - self.window_ms:
            seen.samples.popleft()

    def alive(self, seen: Seen, now_ms: int) -> bool:
        """Whether a component counts: heard from within ``stale_after_s``, not stopping."""
        return now_ms - seen.at_ms <= self.stale_ms and seen.status.state != "stopping"

    def read(self, pool: str, bounds: PoolBounds, now_ms: int) -> Reading | None:
        """The pool's live nodes and the waitiest of its live trainers; None when no
        trainer of the pool is alive with a known waiting fraction."""
        policies = bounds.policies if bounds.policies is not None else self.options.policies
        live = [s for s in self.seen.values() if self.alive(s, now_ms)]
        waits = []
        for s in live:
            if s.status.kind == TRAINER and (policies is None or s.status.policy in policies):
                w = wait_fraction(s)
                if w is not None:
                    waits.append((w, s.status.policy))
        if not waits:
            return None
        wait, trainer = max(waits)
        nodes = [s for s in live if s.status.kind == RAAS and s.status.pool == pool]
        return Reading(nodes, trainer, wait)

    def decide(self, now_ms: int) -> list[ScalingAdvice]:
        """The advice due at ``now_ms``, at most one per pool (see the module doc)."""
        for cid in [c for c, s in self.seen.items() if now_ms - s.at_ms > self.stale_ms]:
            del self.seen[cid]  # gone (or not heard from yet, while catching up)
        if self._first_ms is None or now_ms - self._first_ms < self.stale_ms:
            return []
        out = []
        for pool, bounds in self.options.pools.items():
            reading = self.read(pool, bounds, now_ms)
            if reading is None:
                self.readings.pop(pool, None)
                continue
            self.readings[pool] = reading
            last = self.last_advice_ms.get(pool)
            if last is not None and now_ms - last < self.options.cooldown_s * 1000:
                continue
            advice = self.advise(pool, bounds, reading, now_ms)
            if advice is not None:
                self.last_advice_ms[pool] = now_ms
                out.append(advice)
        return out

    def advise(self, pool: str, bounds: PoolBounds, reading: Reading,
               now_ms: int) -> ScalingAdvice | None:
        """The advice for one pool from its reading, cooldown aside; None to hold."""
        o = self.options
        current, wait = len(reading.nodes), reading.wait
        waits = f"trainer {reading.trainer} waits {_percent(wait)} of the time"
        idle = idle_fraction(reading.nodes)
        if current < bounds.min_size or current > bounds.max_size:
            target = min(max(current, bounds.min_size), bounds.max_size)
            edge = (f"below min_size {bounds.min_size}" if current < bounds.min_size
                    else f"above max_size {bounds.max_size}")
            branch, why = CLAMP, f"{current} nodes, {edge}"
        elif idle is not None and idle > o.idle_above:
            # nothing to roll out: more nodes would not feed a waiting trainer either
            target, branch = max(current - 1, bounds.min_size), IDLE
            why = f"its nodes wait for tasks {_percent(idle)} of the time (> " \
                  f"{_percent(o.idle_above)})"
        elif wait > o.upper:
            target, branch = min(current + 1, bounds.max_size), UP
            why = f"{waits} (> {_percent(o.upper)})"
        elif wait < o.lower:
            target, branch = max(current - 1, bounds.min_size), DOWN
            why = f"{waits} (< {_percent(o.lower)})"
        else:
            return None
        if target == current:
            return None
        return ScalingAdvice(
            pool=pool, current_size=current, target_size=target, branch=branch,
            wait_fraction=wait, upper=o.upper, lower=o.lower,
            produced_rate=sum(rate(s, "produced") for s in reading.nodes),
            consumed_rate=sum(rate(s, "consumed") for s in reading.nodes),
            reason=f"pool {pool}: {why}: {current} -> {target} nodes", at_ms=now_ms)


# --- the processor ----------------------------------------------------------------------
class Autoscaler(Processor):
    """Advises RaaS pool sizes on ``scaling`` from the trainers' waiting on ``status``."""

    kind = "autoscaler"
    Options = AutoscalerOptions

    def __init__(self, name: str, inputs: list[str], outputs: list[str],
                 options: AutoscalerOptions | None = None):
        super().__init__(name, inputs, outputs, options)
        if len(outputs) != 1:
            raise ValueError(f"processor {name}: an autoscaler writes exactly one topic "
                             f"(scaling), not {outputs}")
        self.policy = ScalingPolicy(self.options)
        self.advised = {UP: 0, DOWN: 0, CLAMP: 0, IDLE: 0}

    def open(self, context: ProcessorContext) -> None:
        known = getattr(context.topology, "pools", {})
        unknown = sorted(p for p in self.options.pools if p not in known)
        if unknown:  # nodes may run outside `up`; say so rather than refuse
            log.warning("%s: pools %s are not in the topology's pools", self.name, unknown)

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        if isinstance(msg.record, ComponentStatus):
            self.policy.observe(msg.record, msg.timestamp_ms)
        return ()

    def flush(self, now_ms: int) -> Iterable[Outgoing]:
        out = []
        for advice in self.policy.decide(now_ms):
            self.advised[advice.branch] += 1
            log.info("%s: advising %s", self.name, advice.reason)
            out.append(Outgoing(self.outputs[0], advice, key=advice.pool))
        return out

    def metrics(self) -> dict[str, float]:
        out = {f"autoscaler/advice_{b}": float(n) for b, n in self.advised.items()}
        readings = self.policy.readings
        if readings:
            out["autoscaler/wait_fraction"] = max(r.wait for r in readings.values())
        for pool in self.options.pools:
            if pool in readings:
                out[f"autoscaler/nodes/{pool}"] = float(len(readings[pool].nodes))
                out[f"autoscaler/wait_fraction/{pool}"] = readings[pool].wait
        return out


__all__ = ["Autoscaler", "AutoscalerOptions", "PoolBounds", "ScalingPolicy"]
