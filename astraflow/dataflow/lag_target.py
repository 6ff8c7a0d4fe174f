"""How many tasks each RaaS group may have in flight: a target from measured throughput.

Plain logic, no Kafka: ``LagTargets`` is fed one observation per lag read (tasks each
group has committed so far and tasks in flight, per partition; batches each trainer has
consumed) and answers, per RaaS consumer group on ``tasks``:

- **target** -- the most tasks in flight (queued or being rolled out)::

      floor  = queue_factor x (capacity + rate x poll_interval)
      target = max(floor, rate x budget), at most max(floor, rate x max_queue_s)

  ``rate`` is the group's measured throughput (tasks/s). ``floor`` keeps every rollout slot
  with a task running and one waiting, and what the group rolls out between two reads
  queued twice over, so the queue does not run dry between reads. ``budget`` is half the staleness
  bound in seconds, ``min over trainers of max_staleness / versions per second / 2``: the
  queued tasks are rolled out within half the versions a group may lag, so work queued
  before a trainer falls behind is not stale when it arrives. Before anything is measured
  the target is the floor without the rate term (``queue_factor x capacity``).
- **partition rates** -- each partition's service rate (tasks/s while it had work), for
  routing new tasks to the partition whose queue clears first (``route_by_wait``), once
  every partition has a task running and one waiting.

Throughput is the growth of the tasks a group has committed (rolled out) over time,
smoothed with an exponential moving average of the given half-life.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field


@dataclass
class Rate:
    """An exponentially smoothed rate of a growing count (per second)."""

    half_life_s: float = 10.0
    min_window_s: float = 1.0
    value: float | None = None
    _last: tuple[float, float] | None = None

    def update(self, now_s: float, count: float, busy: bool = True) -> None:
        """Take the count at ``now_s``. ``busy`` False: the window had no work, so it says
        nothing of the rate (it is skipped, not averaged in)."""
        if self._last is None or count < self._last[1]:
            self._last = (now_s, count)
            return
        t0, c0 = self._last
        dt = now_s - t0
        if dt < self.min_window_s:
            return
        self._last = (now_s, count)
        if not busy:
            return
        r = (count - c0) / dt
        w = 1.0 - 0.5 ** (dt / self.half_life_s)
        self.value = r if self.value is None else self.value + w * (r - self.value)


@dataclass
class GroupLoad:
    """One RaaS group's measured throughput and per-partition service rates."""

    capacity: int
    total: Rate = field(default_factory=Rate)
    partitions: dict[int, Rate] = field(default_factory=dict)
    was_busy: dict[int, bool] = field(default_factory=dict)
    idle_since: dict[int, float] = field(default_factory=dict)


class LagTargets:
    """Targets for the tasks in flight of each RaaS group (see the module doc).

    ``capacity``: group label -> tasks its nodes roll out at once; ``max_staleness``:
    policy -> its bound in versions; ``fixed``: label -> a target set by the operator
    (``max_pool_lag``), used as it is.
    """

    def __init__(self, capacity: dict[str, int], max_staleness: dict[str, int],
                 queue_factor: float = 2.0, poll_interval_s: float = 0.5,
                 max_queue_s: float = 60.0, fixed: dict[str, int] | None = None,
                 half_life_s: float = 5.0,
                 cap_horizon_s: float | None = None):
        self.groups = {g: GroupLoad(max(1, c), Rate(half_life_s)) for g, c in capacity.items()}
        self.max_staleness = dict(max_staleness)
        self.queue_factor = queue_factor
        self.poll_interval_s = poll_interval_s
        self.max_queue_s = max_queue_s
        self.fixed = dict(fixed or {})
        self.half_life_s = half_life_s
        # a partition queues at most this many seconds of its node's work: beyond a few
        # reads' worth a queue adds no throughput, only waits behind long tasks
        self.cap_horizon_s = 4 * poll_interval_s if cap_horizon_s is None else cap_horizon_s
        self.versions = {p: Rate(half_life_s, min_window_s=2.0) for p in max_staleness}

    def observe(self, now_s: float, done: dict[str, dict[int, int]],
                in_flight: dict[str, dict[int, int]], consumed: dict[str, int]) -> None:
        """``done``: group -> partition -> tasks it has committed so far; ``in_flight``:
        group -> partition -> tasks queued or being rolled out; ``consumed``: policy ->
        batches its trainer has consumed so far (counts only need to grow; one that falls
        is taken as a restart)."""
        for label, load in self.groups.items():
            parts = done.get(label, {})
            load.total.update(now_s, sum(parts.values()))
            busy = in_flight.get(label, {})
            for p, n in parts.items():
                self._observe_partition(load, p, now_s, n, busy.get(p, 0) > 0)
        for policy, count in consumed.items():
            if policy in self.versions:
                self.versions[policy].update(now_s, count)

    def _observe_partition(self, load: GroupLoad, p: int, now_s: float, done: int,
                           busy: bool) -> None:
        """A partition's rate from the windows it had work in; forgotten after two
        half-lives without work (a node judged slow, or not started yet when it was
        judged, is tried again at the best rate instead of starving)."""
        if busy:
            load.idle_since.pop(p, None)
        elif now_s - load.idle_since.setdefault(p, now_s) > 2 * self.half_life_s:
            load.partitions.pop(p, None)
            load.idle_since[p] = now_s
        rate = load.partitions.setdefault(p, Rate(self.half_life_s))
        rate.update(now_s, done, busy=load.was_busy.get(p, False))
        load.was_busy[p] = busy

    def rate(self, label: str) -> float | None:
        """Tasks per second the group has taken off ``tasks`` lately (None: not yet known)."""
        value = self.groups[label].total.value
        return None if value is None else max(0.0, value)

    def budget_s(self) -> float | None:
        """Half the staleness bound in seconds at the measured version rates (the tightest
        trainer); None while no trainer's version rate is known."""
        budgets = [self.max_staleness[p] / v.value / 2 for p, v in self.versions.items()
                   if v.value is not None and v.value > 0]
        return min(budgets) if budgets else None

    def target(self, label: str) -> int:
        """The most tasks the group may have in flight now."""
        if label in self.fixed:
            return self.fixed[label]
        load = self.groups[label]
        base = self.queue_factor * load.capacity
        rate = self.rate(label)
        if rate is None:
            return max(1, math.ceil(base))
        floor = math.ceil(base + self.queue_factor * rate * self.poll_interval_s)
        budget = self.budget_s()
        if budget is None:
            return max(1, floor)
        wanted = math.ceil(rate * min(budget, self.max_queue_s))
        return max(1, floor, wanted)

    def targets(self) -> dict[str, int]:
        return {label: self.target(label) for label in self.groups}

    def partition_caps(self, label: str, keep: int = 2) -> dict[int, int]:
        """Partition -> most tasks it may hold, for the partitions whose service rate is
        measured: what its node rolls out in the seconds of work the target stands for
        (target / the group's throughput: the staleness budget, or the floor's queue), at
        most ``cap_horizon_s`` (four reads), at least ``keep``. A burst sent to a slow
        node would otherwise stay queued there, counted against the target while faster
        nodes idle; and a queue longer than a few reads' worth adds no throughput while
        its tasks wait behind the node's long ones (the target grows when the trainer
        stalls, as the staleness budget in seconds does, and rates measured over a few
        heavy-tailed tasks differ between alike nodes by several times, so routing by
        rate alone sent such a burst to the node measured fastest). Partitions not
        measured (a node that drains its queue between two reads never shows a busy
        window) are not capped; nor is anything before the group's throughput is known,
        nor a group whose target the operator fixed (``max_pool_lag``)."""
        rate = self.rate(label)
        if not rate or label in self.fixed:
            return {}
        horizon = min(self.target(label) / rate, self.max_queue_s, self.cap_horizon_s)
        return {p: max(keep, math.ceil(r * horizon))
                for p, r in self.partition_rates(label).items()}

    def partition_rates(self, label: str) -> dict[int, float]:
        """Partition -> measured service rate of the group's node on it (tasks/s while
        it had work); partitions not measured yet are left out."""
        return {p: max(0.0, r.value) for p, r in self.groups[label].partitions.items()
                if r.value is not None}


def route_by_wait(load: dict[int, int], rates: dict[int, float], n: int,
                  keep: int = 2, caps: dict[int, int] | None = None) -> list[int]:
    """Partitions for ``n`` new tasks. First every partition gets up to ``keep`` tasks in
    flight (one running and one waiting), fewest first: its node would otherwise sit idle
    until the next read, and a rate measured over a few heavy-tailed tasks says little of
    a node. Beyond that, each task goes to the partition whose queue clears first: least
    ``(tasks + 1) / rate``. A partition without a measured rate counts at the best
    measured one (so a node that never had work waiting is tried, not starved), and a
    rate is taken as at least a tenth of the mean.

    ``caps`` (``LagTargets.partition_caps``): the most a partition may hold; fewer than
    ``n`` partitions come back when every partition is at its cap."""
    load = dict(load)
    caps = caps or {}
    known = [r for p, r in rates.items() if p in load and r > 0]
    mean = sum(known) / len(known) if known else 1.0
    best = max(known, default=1.0)
    speed = {p: max(rates[p] if p in rates else best, mean / 10) for p in load}

    def wait(q: int) -> tuple[float, float, float]:
        if load[q] < keep:
            return (0.0, load[q], -speed[q])
        return (1.0, (load[q] + 1) / speed[q], -speed[q])

    out = []
    for _ in range(n):
        room = [q for q in sorted(load) if load[q] < caps.get(q, math.inf)]
        if not room:
            break
        p = min(room, key=wait)
        load[p] += 1
        out.append(p)
    return out
