"""Admission / backpressure: feed tasks only as fast as the pool and the trainers absorb them.

The ``admission`` processor sits on the way to ``tasks`` (usually ``tasks.source -> tasks``,
or after the pre-rollout processors). It holds the tasks it consumes in memory (their
offsets are not committed while held, so nothing is lost on a crash) and lets them through
only while two consumer-group lags stay within their bounds:

- **pool** -- tasks in flight for a RaaS group: the records on ``tasks`` past the committed
  offsets of the group (``<run>.raas``, shared by the pools, or ``<run>.raas.<pool>`` of a
  pool with ``share_tasks: false``): queued or being rolled out, since a node commits a
  task together with its trajectories. Bound: a target from the group's measured
  throughput and the staleness bound (``lag_target.LagTargets``): at least one task
  running and one waiting per rollout slot, at most what the group rolls out in half the
  staleness bound; ``queue_factor x capacity`` (capacity = nodes x tasks per transaction)
  until throughput is measured;
- **trainer** -- batches queued for a trainer: records on ``batches.<policy>`` past the
  committed offset of ``<run>.trainer.<policy>`` (the batch being trained among them).
  Every queued batch becomes one weight version before anything rolled out now is
  trained, so a task admitted while ``L`` batches wait is at least ``L`` versions stale
  when trained; beyond ``max_staleness`` its group would be dropped. Bound:
  ``max_staleness`` batches. With the trainer's batch size ``B`` known (its batcher's
  ``batch_size``, less the replayed groups a batch may hold; ``staleness_budget:
  pipeline``, the default) the groups ahead of a new task's count too: the ``P`` tasks in
  flight, and the ``T`` groups rolled out but not yet in a batch (records past the
  committed offsets of the processors between ``trajectories.raw`` and
  ``batches.<policy>``, the batcher's held groups among them). They fill
  ``floor((P + T) / B)`` batches ahead of the new task's, so it is admitted only while
  ``P + T + 1 <= (max_staleness - L + 1) x B``: nothing admitted is trained from a
  version more than ``max_staleness`` past the newest one published when it was
  admitted, which is the oldest its node samples from (a node brings its engine to the
  newest version before each rollout). ``queue`` bounds ``L`` alone: more tasks in
  flight, and the stale drops that come with them.

Lags are counted in records, not offsets: every committed Kafka transaction leaves a
control marker in each partition it wrote, which offset lag counts as one more record.
Side readers (``RecordCounter``) follow ``tasks``, the topics on the way to the batchers
and ``batches.*`` without a group and remember where the data records are. The decision
itself (``AdmissionPolicy``) is plain logic; ``LagObserver`` reads Kafka; ``Admission``
is the processor joining them. Lags are read every ``poll_interval_s`` (0.5 s), and
tasks are admitted only right after a read, so each decision sees everything admitted
before it. Each admitted task goes to the partition of ``tasks`` whose queue clears first
at its node's measured rate, once every partition has a task running and one waiting
(``lag_target.route_by_wait``), so pools sharing the group get tasks in proportion to
their throughput and a slow pool holds few.

When more than ``max_held`` tasks wait, the processor asks the runtime to pause its input
and resumes it below half of that.

Run one instance per topology: copies would decide independently and each fill the same
headroom.
"""

from __future__ import annotations

import bisect
import dataclasses
import logging
import math
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.config.processors import AdmissionOptions
from astraflow.dataflow.base import (
    Incoming,
    Outgoing,
    Processor,
    ProcessorContext,
    SideAccess,
)
from astraflow.dataflow.lag_target import LagTargets, route_by_wait
from astraflow.dataflow.versions import LatestVersions
from astraflow.kafka.config import ADMISSION_GROUP, TABLE_GROUP
from astraflow.kafka.lag import LagReader, PartitionLag

log = logging.getLogger("astraflow.admission")

DEFAULT_MAX_STALENESS = 4


# --- decision logic, no Kafka -----------------------------------------------------------
@dataclass(frozen=True)
class AdmissionDecision:
    """How many waiting tasks to let through now, and to which partitions of ``tasks``."""

    admit: int
    partitions: list[int | None]  # one per admitted task; None: by key
    state: str  # "admitting" | "holding"
    reason: str  # why holding: "pool <name>: 12/12 in flight", "trainer <policy>: ..."
    headroom: int  # tasks the tightest pool could still take


class AdmissionPolicy:
    """Given lags and bounds, decide how many waiting tasks to admit.

    ``pool_bounds``: pool -> most tasks in flight; ``trainer_bounds``: policy -> most
    batches queued at which tasks are still admitted (its ``max_staleness``);
    ``trainer_batches``: policy -> groups per batch, for the policies whose staleness
    budget also counts the tasks in flight (the module doc). A task is admitted only if
    afterwards every pool stays within its bound and no trainer is beyond its bound.
    """

    def __init__(self, pool_bounds: dict[str, int], trainer_bounds: dict[str, int] | None = None,
                 route: str = "least_lag", trainer_batches: dict[str, int] | None = None):
        if not pool_bounds:
            raise ValueError("admission needs at least one pool bound")
        self.pool_bounds = dict(pool_bounds)
        self.trainer_bounds = dict(trainer_bounds or {})
        self.trainer_batches = {p: b for p, b in (trainer_batches or {}).items()
                                if p in self.trainer_bounds}
        self.route = route

    def decide(self, pool_in_flight: dict[str, dict[int, int]], trainer_lag: dict[str, int],
               waiting: int, rates: dict[int, float] | None = None,
               caps: dict[int, int] | None = None,
               transit: dict[str, int] | None = None) -> AdmissionDecision:
        """``pool_in_flight``: group -> partition -> tasks in flight; ``trainer_lag``:
        policy -> batches queued; ``waiting``: tasks held here; ``rates``: partition ->
        measured service rate, and ``caps``: partition -> most tasks it may hold, for
        routing (one group only); ``transit``: policy -> groups rolled out but not yet in
        one of its batches (None, or a policy missing: not known)."""
        for policy, bound in sorted(self.trainer_bounds.items()):
            lag = trainer_lag.get(policy, 0)
            if lag > bound:
                return AdmissionDecision(0, [], "holding",
                                         f"trainer {policy}: {lag} batches queued > {bound}",
                                         self._headroom(pool_in_flight)[0])
        headroom, tightest = self._headroom(pool_in_flight)
        if headroom <= 0:
            pool = tightest
            total = sum(pool_in_flight.get(pool, {}).values())
            return AdmissionDecision(0, [], "holding",
                                     f"pool {pool}: {total}/{self.pool_bounds[pool]} in flight",
                                     headroom)
        budget, why = self._staleness_room(pool_in_flight, trainer_lag, transit)
        if budget <= 0:
            return AdmissionDecision(0, [], "holding", why, headroom)
        n = min(waiting, headroom, budget)
        partitions = self._route(pool_in_flight, n, rates, caps)
        if n and not partitions:
            return AdmissionDecision(0, [], "holding",
                                     f"pool {tightest}: every partition at its cap", headroom)
        return AdmissionDecision(len(partitions), partitions, "admitting", "", headroom)

    def _staleness_room(self, pool_in_flight: dict[str, dict[int, int]],
                        trainer_lag: dict[str, int],
                        transit: dict[str, int] | None) -> tuple[int, str]:
        """Tasks that may still be admitted before one of them could be trained staler than
        its trainer's bound, for the tightest trainer, and why it holds when that is 0 or
        less (``P``: tasks in flight in every pool; the module doc): with the groups on
        their way to its batcher known (``transit``), ``(max_staleness - L + 1) x B - P -
        T``, else ``(max_staleness - L) x B - P``."""
        in_flight = sum(sum(parts.values()) for parts in pool_in_flight.values())
        room, why = math.inf, ""
        for policy, batch in sorted(self.trainer_batches.items()):
            bound, lag = self.trainer_bounds[policy], trainer_lag.get(policy, 0)
            if transit is not None and policy in transit:
                moving = transit[policy]
                r = (bound - lag + 1) * batch - in_flight - moving
                said = f"{in_flight} tasks in flight and {moving} groups on their way"
            else:
                r = (bound - lag) * batch - in_flight
                said = f"{in_flight} tasks in flight"
            if r < room:
                room = r
                why = (f"trainer {policy}: {lag} batches queued and {said} fill its {bound} "
                       f"versions of {batch} groups")
        return (room if room != math.inf else 1 << 30), why

    def _headroom(self, pool_in_flight: dict[str, dict[int, int]]) -> tuple[int, str]:
        room = {p: b - sum(pool_in_flight.get(p, {}).values())
                for p, b in self.pool_bounds.items()}
        tightest = min(sorted(room), key=lambda p: room[p])
        return room[tightest], tightest

    def _route(self, pool_in_flight: dict[str, dict[int, int]], n: int,
               rates: dict[int, float] | None = None,
               caps: dict[int, int] | None = None) -> list[int | None]:
        if self.route == "key" or n == 0:
            return [None] * n
        load: dict[int, int] = {}
        for parts in pool_in_flight.values():
            for p, c in parts.items():
                load[p] = load.get(p, 0) + c
        if not load:
            return [None] * n
        if len(pool_in_flight) == 1:  # one group: the partition whose queue clears first
            return list(route_by_wait(load, rates or {}, n, caps=caps))
        out: list[int | None] = []
        for _ in range(n):
            p = min(sorted(load), key=lambda q: load[q])
            load[p] += len(pool_in_flight) or 1
            out.append(p)
        return out


@dataclass(frozen=True)
class TaskGroup:
    """A RaaS consumer group on ``tasks``: ``label`` (its pool, or its pools joined by
    ``+``), the group id, and its capacity (tasks its nodes roll out at once)."""

    label: str
    group: str
    capacity: int


def task_groups(topology: Any, options: AdmissionOptions) -> list[TaskGroup]:
    """The RaaS groups the admission watches: those of ``options.pools`` (default: every
    pool of the topology, else the nodes' default pool)."""
    wanted = set(options.pools or list(topology.pools) or ["default"])
    out = []
    for group, pools in topology.raas_groups().items():
        mine = [p for p in pools if p in wanted]
        if not mine:
            continue
        capacity = options.pool_capacity
        if capacity is None:
            specs = [topology.pools[p] for p in pools if p in topology.pools]
            capacity = max(1, sum(s.nodes * s.tasks_per_transaction for s in specs))
        out.append(TaskGroup("+".join(pools), group, capacity))
    for pool in sorted(wanted - {p for ps in topology.raas_groups().values() for p in ps}):
        out.append(TaskGroup(pool, topology.raas_group(pool), options.pool_capacity or 1))
    return out


def pool_bounds(topology: Any, options: AdmissionOptions) -> dict[str, int]:
    """Group label -> most tasks in flight before anything is measured: ``max_pool_lag``,
    else ceil(queue_factor x capacity)."""
    out = {}
    for g in task_groups(topology, options):
        if options.max_pool_lag is not None:
            out[g.label] = options.max_pool_lag
        else:
            out[g.label] = max(1, math.ceil(options.queue_factor * g.capacity))
    return out


def max_staleness_of(topology: Any, policy: str) -> int | None:
    """The ``max_staleness`` of ``policy``: its own where the topology declares it, else
    what the topology's batcher (or staleness filter) uses for it."""
    if policy in getattr(topology, "policies", {}):
        return topology.policies[policy].max_staleness
    found = None
    for spec in topology.processors.values():
        if spec.kind == "batcher":
            batcher = spec.typed_options()
            if batcher.policy == policy and batcher.max_staleness is not None:
                return batcher.max_staleness
        elif spec.kind == "staleness_filter":
            # a filter's bound counts where the file (or the policy) sets it: the filter's
            # own default bounds the filter, not the policy's admission
            filt = spec.typed_options()
            if "max_staleness" in filt.model_fields_set and policy in filt.policies:
                found = filt.max_staleness
    return found


def trainer_batches(topology: Any, options: AdmissionOptions) -> dict[str, int]:
    """Policy -> fresh groups per batch (its batcher's ``batch_size``, less the replayed
    groups a batch may hold) for the staleness budget that counts tasks in flight; empty
    with ``staleness_budget: queue``. A policy whose batcher is not in the topology keeps
    the queue bound alone."""
    if options.staleness_budget == "queue":
        return {}
    out = {}
    for spec in topology.processors.values():
        if spec.kind != "batcher":
            continue
        batcher = spec.typed_options()
        # a batcher whose batch_size the file leaves unset keeps its policy on the queue
        # bound alone
        if "batch_size" in batcher.model_fields_set:
            replayed = math.floor(batcher.replay_ratio * batcher.batch_size + 1e-9)
            out[batcher.policy] = max(1, batcher.batch_size - replayed)
    return out


def _closure(start: str, edges: list[tuple[str, str]]) -> set[str]:
    """``start`` and every topic reachable from it along ``edges`` (from, to)."""
    seen, todo = {start}, [start]
    while todo:
        here = todo.pop()
        for a, b in edges:
            if a == here and b not in seen:
                seen.add(b)
                todo.append(b)
    return seen


def transit_inputs(topology: Any, policy: str) -> list[tuple[str, str]]:
    """``(input topic, consumer group)`` of every processor between the RaaS nodes'
    ``trajectories.raw`` and ``batches.<policy>`` (logical topic names): the records
    past those groups' committed offsets are the groups rolled out for ``policy`` and not
    yet in one of its batches (a record that is another policy's, or that a filter will
    drop, counts too: the count errs towards admitting less)."""
    procs = topology.processors
    edges = [(t, o) for spec in procs.values() for t in spec.inputs for o in spec.outputs]
    reached = _closure("trajectories.raw", edges)  # the topics the nodes' groups reach
    feeds = _closure(f"batches.{policy}", [(o, t) for t, o in edges])  # reaching batches
    return [(t, topology.group_of(name)) for name, spec in procs.items()
            if any(o in feeds for o in spec.outputs)
            for t in spec.inputs if t in reached and t in feeds]


def trainer_bounds(topology: Any, options: AdmissionOptions) -> dict[str, int]:
    """Policy -> most queued batches at which tasks are admitted (see the module doc)."""
    policies = options.policies if options.policies is not None else list(topology.policies)
    out = {}
    for policy in policies:
        if f"batches.{policy}" not in topology.topics:
            log.warning("admission: no topic batches.%s; its trainer is not watched", policy)
            continue
        if options.max_trainer_lag is not None:
            out[policy] = options.max_trainer_lag
        elif options.max_staleness is not None:
            out[policy] = options.max_staleness
        else:
            found = max_staleness_of(topology, policy)
            out[policy] = DEFAULT_MAX_STALENESS if found is None else found
    return out


def _policy(topology: Any, options: AdmissionOptions) -> AdmissionPolicy:
    return AdmissionPolicy(pool_bounds(topology, options), trainer_bounds(topology, options),
                           options.route, trainer_batches(topology, options))


# --- reading lags from Kafka ------------------------------------------------------------
class RecordCounter:
    """Follows partitions without a consumer group and counts data records past an offset.

    Offset lag counts transaction markers as records; this side reader (``read_committed``)
    remembers the offsets of the data records from a floor (the lowest committed offset of
    the watched groups) on, so ``count`` is exact once it has caught up, and an upper
    bound (the unread range counts in full) until then.
    """

    def __init__(self, config: Any, client_id: str):
        self.consumer = Consumer(config.consumer_conf(
            ADMISSION_GROUP, **{"enable.auto.commit": False, "client.id": client_id,
                                      "enable.partition.eof": False}))
        self._floor: dict[tuple[str, int], int] = {}
        self._seen: dict[tuple[str, int], list[int]] = {}
        self._pos: dict[tuple[str, int], int] = {}

    def follow(self, floors: dict[tuple[str, int], int]) -> None:
        """Read each partition from its floor on; a floor that moved back restarts it."""
        if any(tp not in self._floor or f < self._floor[tp] for tp, f in floors.items()):
            self._floor = dict(floors)
            self._seen = {tp: [] for tp in floors}
            self._pos = dict(floors)
            self.consumer.assign([TopicPartition(t, p, f) for (t, p), f in floors.items()])
            return
        for tp, f in floors.items():
            if f > self._floor[tp]:
                seen = self._seen[tp]
                del seen[: bisect.bisect_left(seen, f)]
                self._floor[tp] = f

    def drain(self) -> None:
        """Take in what has arrived, without blocking."""
        while True:
            msgs = self.consumer.consume(1000, 0)
            if not msgs:
                break
            for m in msgs:
                if m.error():
                    if m.error().code() == KafkaError._PARTITION_EOF:
                        continue
                    raise KafkaException(m.error())
                tp = (m.topic(), m.partition())
                if tp in self._floor and m.offset() >= self._floor[tp]:
                    seen = self._seen[tp]
                    if not seen or seen[-1] < m.offset():
                        seen.append(m.offset())
                    self._pos[tp] = max(self._pos[tp], m.offset() + 1)
        if self._pos:
            # the position also steps over transaction markers, unlike the last offset read
            for tp in self.consumer.position(
                    [TopicPartition(t, p) for t, p in self._pos]):
                if tp.offset >= 0:
                    key = (tp.topic, tp.partition)
                    self._pos[key] = max(self._pos[key], tp.offset)

    def caught_up(self, ends: dict[tuple[str, int], int]) -> bool:
        """Whether every followed partition has been read up to its offset in ``ends``
        (then ``count`` below those offsets is exact)."""
        return all(self._pos.get(tp, end) >= end for tp, end in ends.items()
                   if tp in self._floor)

    def between(self, topic: str, partition: int, lo: int, hi: int) -> int:
        """Data records at offsets in ``[lo, hi)`` (an unread part counts in full); only
        exact while ``lo`` is at or above the partition's floor."""
        tp = (topic, partition)
        if tp not in self._floor or hi <= lo:
            return max(0, hi - lo)
        seen = self._seen[tp]
        pos = max(self._pos[tp], lo)
        known = bisect.bisect_left(seen, min(hi, pos)) - bisect.bisect_left(seen, lo)
        return known + max(0, hi - pos)

    def count(self, topic: str, partition: int, committed: int, end: int) -> int:
        """Data records at offsets >= ``committed`` below ``end`` (the log-end offset)."""
        tp = (topic, partition)
        if tp not in self._floor or committed < self._floor[tp]:
            return max(0, end - committed)
        seen = self._seen[tp]
        pos = self._pos[tp]
        known = len(seen) - bisect.bisect_left(seen, committed)
        return known + max(0, end - max(pos, committed))

    def close(self) -> None:
        self.consumer.close()


@dataclass
class Observation:
    """Lags at one moment: records in flight per pool and partition, batches per trainer."""

    pool_in_flight: dict[str, dict[int, int]]
    trainer_lag: dict[str, int]
    pool_offset_lag: dict[str, int] = field(default_factory=dict)  # what `astraflow lag` shows
    trainer_offset_lag: dict[str, int] = field(default_factory=dict)
    # batches each trainer consumed since the observer (re)started following its topic
    trainer_consumed: dict[str, int] = field(default_factory=dict)
    # tasks each group committed (rolled out) per partition since the observer started
    pool_done: dict[str, dict[int, int]] = field(default_factory=dict)
    # log-end offset of each partition of ``tasks`` (empty: not known)
    tasks_end: dict[int, int] = field(default_factory=dict)
    # policy -> groups rolled out and not yet in one of its batches (absent: not counted)
    trainer_transit: dict[str, int] = field(default_factory=dict)


class LagSource(Protocol):
    """Anything that observes the lags (Kafka, or a script in tests)."""

    def observe(self) -> Observation: ...

    def close(self) -> None: ...


class LagObserver:
    """Reads the pools' lag on ``tasks``, the groups on their way to each trainer's batcher
    and the trainers' lag on ``batches.<policy>``.

    ``pool_groups``: pool -> consumer group; ``trainer_topics``: policy -> (topic, group);
    ``transit_topics``: policy -> the (topic, group) of each processor between the nodes
    and its batches (``transit_inputs``); topic names are full (with the run prefix).
    ``published``: the newest manifest per policy; a trainer's batches are then counted
    from the offsets its newest published version had consumed where those are behind
    its committed ones: a trainer that writes a version while it trains the next batch
    (``publish_overlap``) commits that batch before the version is visible, and the batch
    still becomes a version after it. Only that one batch: the others a trainer committed
    past its newest version it skipped (every group stale or without advantage).
    """

    def __init__(self, config: Any, tasks_topic: str, pool_groups: dict[str, str],
                 trainer_topics: dict[str, tuple[str, str]],
                 transit_topics: dict[str, list[tuple[str, str]]] | None = None,
                 published: LatestVersions | None = None):
        self.published = published
        self.tasks_topic = tasks_topic
        self.pool_groups = pool_groups
        self.trainer_topics = trainer_topics
        self.transit_topics = {p: ts for p, ts in (transit_topics or {}).items() if ts}
        self.reader = LagReader(config)
        self.tasks = RecordCounter(config, "admission-tasks")
        self.batches = RecordCounter(config, "admission-batches") if trainer_topics else None
        self.transit = (RecordCounter(config, "admission-transit") if self.transit_topics
                        else None)
        # tasks each pool group, batches each trainer committed so far, per partition; and
        # the committed offsets they were counted up to
        self._pool_done: dict[str, dict[int, int]] = {}
        self._trainer_done: dict[str, dict[int, int]] = {}
        self._committed: dict[tuple[str, str, int], int] = {}  # (kind, name, partition)

    def observe(self) -> Observation:
        # upstream first: a record that moves on between two reads is counted twice (the
        # count errs towards admitting less), never missed
        pool_rows = {pool: self.reader.lag(g, [self.tasks_topic])
                     for pool, g in self.pool_groups.items()}
        transit_rows = {(policy, g, t): self.reader.lag(g, [t])
                        for policy, ts in self.transit_topics.items() for t, g in ts}
        if self.published is not None:  # before the commits: its offsets err low
            self.published.refresh()
        trainer_rows = {policy: self.reader.lag(g, [t])
                        for policy, (t, g) in self.trainer_topics.items()}
        # everything written up to now is read before a floor moves past it: records made
        # and consumed between two reads are counted, not skipped
        self.tasks.drain()
        if self.batches:
            self.batches.drain()
        # before the floors move past what they count
        self._count_done(self.tasks, "pool", pool_rows, self._pool_done)
        if self.batches:
            self._count_done(self.batches, "trainer", trainer_rows, self._trainer_done)
        in_flight = self._count(self.tasks, pool_rows)
        batches = (self._count(self.batches, self._from_published(trainer_rows))
                   if self.batches else {})
        queued = {policy: sum(parts.values()) for policy, parts in batches.items()}
        if self.batches and self.published is not None:
            queued = self._one_unpublished_at_most(queued, trainer_rows)
        transit: dict[str, int] = {}
        if self.transit:
            for (policy, _g, _t), n in self._count(self.transit, transit_rows).items():
                transit[policy] = transit.get(policy, 0) + sum(n.values())
        return Observation(
            pool_in_flight=in_flight,
            trainer_lag=queued,
            pool_offset_lag={p: sum(r.lag for r in rows) for p, rows in pool_rows.items()},
            trainer_offset_lag={p: sum(r.lag for r in rows) for p, rows in trainer_rows.items()},
            trainer_consumed={p: sum(parts.values()) for p, parts in self._trainer_done.items()},
            pool_done={label: dict(parts) for label, parts in self._pool_done.items()},
            tasks_end={r.partition: r.end_offset for rows in pool_rows.values() for r in rows},
            trainer_transit=transit,
        )

    def _from_published(self, rows: dict[str, list[PartitionLag]]
                        ) -> dict[str, list[PartitionLag]]:
        """``rows`` with each committed offset lowered to where the policy's newest
        published version had consumed, where that is lower."""
        if self.published is None:
            return rows
        out = {}
        for policy, rs in rows.items():
            manifest = self.published.manifest(policy)
            done = {(o.topic, o.partition): o.offset
                    for o in (manifest.consumed_offsets if manifest else [])}
            out[policy] = [
                dataclasses.replace(r, committed=done[(r.topic, r.partition)])
                if r.committed is not None and done.get((r.topic, r.partition), r.committed)
                < r.committed else r for r in rs]
        return out

    def _one_unpublished_at_most(self, queued: dict[str, int],
                                 rows: dict[str, list[PartitionLag]]) -> dict[str, int]:
        """``queued`` (policy -> batches counted from its newest version's offsets) with at
        most one batch the trainer committed before that version: the last one, which an
        overlapping trainer is training. The others it skipped (every group stale or without
        advantage) and will never become versions; counted, once more than
        ``max_staleness`` of them followed the newest version, they held every task, so no
        batch and no version ever came to move those offsets on."""
        assert self.batches is not None
        out = dict(queued)
        for policy, n in queued.items():
            past_commit = sum(
                self.batches.count(r.topic, r.partition, r.resumes_at, r.end_offset)
                for r in rows.get(policy, []))
            out[policy] = min(n, past_commit + 1)
        return out

    def _count_done(self, counter: RecordCounter, kind: str,
                    rows: dict[str, list[PartitionLag]], done: dict[str, dict[int, int]]
                    ) -> None:
        """Add to ``done`` the data records each group's committed offsets passed since
        the last read (``kind`` keeps pool and trainer names apart)."""
        for name, rs in rows.items():
            parts = done.setdefault(name, {})
            for r in rs:
                if r.resumes_at != r.committed:  # none committed, or a stale one
                    continue
                key = (kind, name, r.partition)
                before = self._committed.get(key)
                self._committed[key] = r.committed
                parts.setdefault(r.partition, 0)
                if before is not None and r.committed > before:
                    parts[r.partition] += counter.between(r.topic, r.partition, before,
                                                          r.committed)

    @staticmethod
    def _count(counter: RecordCounter, rows: dict[Any, list[PartitionLag]]
               ) -> dict[Any, dict[int, int]]:
        floors: dict[tuple[str, int], int] = {}
        for rs in rows.values():
            for r in rs:
                tp = (r.topic, r.partition)
                floors[tp] = min(floors.get(tp, r.resumes_at), r.resumes_at)
        counter.follow(floors)
        counter.drain()  # after a (re)start, what the new assignment reads
        return {name: {r.partition: counter.count(r.topic, r.partition, r.resumes_at,
                                                  r.end_offset) for r in rs}
                for name, rs in rows.items()}

    def close(self) -> None:
        self.reader.close()
        self.tasks.close()
        if self.published is not None:
            self.published.close()
        for counter in (self.batches, self.transit):
            if counter:
                counter.close()


# --- the processor ----------------------------------------------------------------------
class Admission(Processor):
    """Holds tasks back while the RaaS pool or a trainer is behind; lets them through after.

    Output: its single output topic (``tasks``). ``lags`` (a ``LagSource``) and the bounds
    are made in ``open`` from the topology unless given (tests give them).
    """

    kind = "admission"
    Options = AdmissionOptions

    def __init__(self, name, inputs, outputs, options=None, lags: LagSource | None = None,
                 policy: AdmissionPolicy | None = None):
        super().__init__(name, inputs, outputs, options)
        if len(outputs) != 1:
            raise ValueError(f"admission {name}: exactly one output topic (tasks), got {outputs}")
        self.lags = lags
        self.policy = policy
        self.control = None
        self.held: deque[Incoming] = deque()
        self.admitted = 0
        self.hold_events = 0
        self.lag_errors = 0
        self.input_paused = False
        self.last: Observation | None = None
        self.decision: AdmissionDecision | None = None
        self.targets: LagTargets | None = None
        self.peak_bounds: dict[str, int] = {}  # the highest bound each group has had
        # log-end offsets of ``tasks`` (per partition, and summed) once the tasks admitted
        # so far are written (see _with_unseen)
        self._expected_end: dict[int, int] = {}
        self._expected_total = 0
        self._next_read_ms = 0

    def side_access(self, topology: Any) -> SideAccess:
        """It counts the records of its output (``tasks``) and of the watched trainers'
        ``batches.<policy>``, and reads the lag of the pools' and those trainers' groups;
        with the ``pipeline`` budget also the records and lag on the way from the nodes to
        the batchers, and the policies' newest manifests (``weights.<policy>``)."""
        policy = self.policy or _policy(topology, self.options)
        groups = {g.label: g.group for g in task_groups(topology, self.options)}
        trainers = list(policy.trainer_bounds)
        transit = [tg for p in policy.trainer_batches if self._counts_transit()
                   for tg in transit_inputs(topology, p)]
        return SideAccess(
            reads=tuple(dict.fromkeys((
                self.outputs[0], *(f"batches.{p}" for p in trainers), *(t for t, _ in transit),
                *(f"weights.{p}" for p in policy.trainer_batches
                  if f"weights.{p}" in topology.topics and self._counts_transit())))),
            lag_groups=tuple(dict.fromkeys((
                *(groups.get(label, topology.raas_group(label))
                  for label in policy.pool_bounds),
                *(g for _, g in transit),
                *(topology.trainer_group(p) for p in trainers)))),
            reader_groups=(ADMISSION_GROUP,
                           *((TABLE_GROUP,) if self._counts_transit() else ())))

    def open(self, context: ProcessorContext) -> None:
        topo = context.topology
        self.control = context.control
        groups = task_groups(topo, self.options)
        if self.policy is None:
            self.policy = _policy(topo, self.options)
        transit = {p: transit_inputs(topo, p) for p in self.policy.trainer_batches
                   if self._counts_transit()}
        if self.lags is None:
            by_label = {g.label: g.group for g in groups}
            self.lags = LagObserver(
                context.config, topo.full_name(self.outputs[0]),
                {label: by_label.get(label, topo.raas_group(label))
                 for label in self.policy.pool_bounds},
                {p: (topo.full_name(f"batches.{p}"), f"{topo.run}.trainer.{p}")
                 for p in self.policy.trainer_bounds},
                {p: [(topo.full_name(t), g) for t, g in inputs]
                 for p, inputs in transit.items()},
                self._published(context))
        capacity = {g.label: g.capacity for g in groups}
        o = self.options
        self.targets = LagTargets(
            {label: capacity.get(label, 1) for label in self.policy.pool_bounds},
            self.policy.trainer_bounds, o.queue_factor, o.poll_interval_s, o.max_queue_s,
            fixed=dict(self.policy.pool_bounds) if o.max_pool_lag is not None else None)
        log.info("%s: groups %s, initial pool bounds %s, trainer bounds %s, batch sizes %s, "
                 "groups on their way counted on %s", context.component_id,
                 {g.label: g.group for g in groups}, self.policy.pool_bounds,
                 self.policy.trainer_bounds, self.policy.trainer_batches,
                 {p: [t for t, _ in inputs] for p, inputs in transit.items()})

    def _counts_transit(self) -> bool:
        return self.options.staleness_budget == "pipeline"

    def _published(self, context: ProcessorContext) -> LatestVersions | None:
        """The newest manifests of the policies whose staleness budget counts the whole
        pipeline (those whose weights topic the topology has)."""
        topo = context.topology
        topics = {p: topo.full_name(f"weights.{p}") for p in self.policy.trainer_batches
                  if f"weights.{p}" in topo.topics and self._counts_transit()}
        return LatestVersions(context.config, context.codec, topics) if topics else None

    def close(self) -> None:
        if self.lags is not None:
            self.lags.close()

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.held.append(msg)
        return ()

    def flush(self, now: int) -> Iterable[Outgoing]:
        out: list[Outgoing] = []
        if now >= self._next_read_ms:
            self._next_read_ms = now + int(self.options.poll_interval_s * 1000)
            out = self._admit()
        self._pace_input()
        return out

    def _admit(self) -> list[Outgoing]:
        try:
            self.last = self.lags.observe()
        except KafkaException as e:  # hold (safe) and try again at the next read
            self.lag_errors += 1
            log.warning("%s: reading lags failed, holding: %s", self.name, e)
            return []
        was = self.decision.state if self.decision else None
        rates = caps = None
        if self.targets is not None:
            self.targets.observe(time.monotonic(), self.last.pool_done,
                                 self.last.pool_in_flight, self.last.trainer_consumed)
            self.policy.pool_bounds = self.targets.targets()
            if len(self.policy.pool_bounds) == 1:
                label = next(iter(self.policy.pool_bounds))
                rates = self.targets.partition_rates(label)
                caps = self.targets.partition_caps(label)
        for label, bound in self.policy.pool_bounds.items():
            self.peak_bounds[label] = max(bound, self.peak_bounds.get(label, 0))
        in_flight = self._with_unseen(self.last)
        d = self.policy.decide(in_flight, self.last.trainer_lag, len(self.held), rates, caps,
                               self.last.trainer_transit)
        log.debug("%s: in flight %s (read %s), ends %s, bounds %s, trainer %s, transit %s: "
                  "admit %d of %d", self.name, in_flight, self.last.pool_in_flight,
                  self.last.tasks_end, self.policy.pool_bounds, self.last.trainer_lag,
                  self.last.trainer_transit, d.admit, len(self.held))
        self.decision = d
        if d.state != was:
            if d.state == "holding":
                self.hold_events += 1
                log.info("%s: holding (%s), %d tasks waiting", self.name, d.reason,
                         len(self.held))
            elif was is not None:
                log.info("%s: admitting again, %d tasks waiting", self.name, len(self.held))
        out = []
        for partition in d.partitions:
            m = self.held.popleft()
            out.append(Outgoing(self.outputs[0], m.record, key=m.key, partition=partition))
        self.admitted += len(out)
        self._expect(self.last.tasks_end, d.partitions)
        return out

    def _expect(self, ends: dict[int, int], partitions: list[int | None]) -> None:
        """Remember where the log ends once the tasks just admitted are written."""
        if not ends:
            return
        expected = {p: max(e, self._expected_end.get(p, e)) for p, e in ends.items()}
        for p in partitions:
            if p in expected:  # None (by key): only the total knows of it
                expected[p] += 1
        self._expected_end = expected
        self._expected_total = max(sum(ends.values()), self._expected_total) + len(partitions)

    def _with_unseen(self, obs: Observation) -> dict[str, dict[int, int]]:
        """Tasks in flight, counting those admitted earlier but not yet in the log (a
        producer held back past one lag read) as in flight on every group."""
        ends = obs.tasks_end
        if not ends or not self._expected_end:
            return obs.pool_in_flight
        unseen = {p: max(0, self._expected_end.get(p, e) - e) for p, e in ends.items()}
        rest = max(0, self._expected_total - sum(ends.values()) - sum(unseen.values()))
        if not rest and not any(unseen.values()):
            return obs.pool_in_flight
        out = {}
        for group, parts in obs.pool_in_flight.items():
            parts = {p: n + unseen.get(p, 0) for p, n in parts.items()}
            if rest and parts:
                first = min(parts)
                parts[first] += rest
            out[group] = parts
        return out

    def _pace_input(self) -> None:
        if self.control is None:
            return
        if not self.input_paused and len(self.held) >= self.options.max_held:
            for t in self.inputs:
                self.control.pause(t)
            self.input_paused = True
        elif self.input_paused and len(self.held) <= self.options.max_held // 2:
            for t in self.inputs:
                self.control.resume(t)
            self.input_paused = False

    def held_offsets(self) -> dict[tuple[str, int], int]:
        oldest: dict[tuple[str, int], int] = {}
        for m in self.held:
            key = (m.topic, m.partition)
            if key not in oldest or m.offset < oldest[key]:
                oldest[key] = m.offset
        return oldest

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        gone = set(partitions)
        self.held = deque(m for m in self.held if (m.topic, m.partition) not in gone)

    def state(self) -> str | None:
        return self.decision.state if self.decision else "holding"

    def metrics(self) -> dict[str, float]:
        pb = self.policy.pool_bounds if self.policy else {}
        tb = self.policy.trainer_bounds if self.policy else {}
        obs = self.last or Observation({}, {})
        pool_lag = {p: sum(obs.pool_in_flight.get(p, {}).values()) for p in pb}
        out = {
            "admission/held": float(len(self.held)),
            "admission/admitted": float(self.admitted),
            "admission/holding": float(self.state() == "holding"),
            "admission/hold_events": float(self.hold_events),
            "admission/lag_errors": float(self.lag_errors),
            "admission/input_paused": float(self.input_paused),
        }
        if pb:  # the tightest pool, then each pool
            tight = min(sorted(pb), key=lambda p: pb[p] - pool_lag[p])
            out["admission/pool_lag"] = float(pool_lag[tight])
            out["admission/bound_pool"] = float(pb[tight])
            # targets move every lag read, statuses are samples: what bounded in flight
            out["admission/bound_pool_max"] = float(self.peak_bounds.get(tight, pb[tight]))
            out["admission/pool_offset_lag"] = float(obs.pool_offset_lag.get(tight, 0))
            for p in pb:
                out[f"admission/pool_lag/{p}"] = float(pool_lag[p])
                out[f"admission/bound_pool/{p}"] = float(pb[p])
                out[f"admission/bound_pool_max/{p}"] = float(self.peak_bounds.get(p, pb[p]))
                rate = self.targets.rate(p) if self.targets else None
                if rate is not None:
                    out[f"admission/throughput/{p}"] = rate
        budget = self.targets.budget_s() if self.targets else None
        if budget is not None:
            out["admission/staleness_budget_s"] = budget
        if tb:  # the trainer nearest its bound, then each trainer
            lag = {p: obs.trainer_lag.get(p, 0) for p in tb}
            tight = min(sorted(tb), key=lambda p: tb[p] - lag[p])
            out["admission/trainer_lag"] = float(lag[tight])
            out["admission/bound_trainer"] = float(tb[tight])
            for p in tb:
                out[f"admission/trainer_lag/{p}"] = float(lag[p])
                out[f"admission/bound_trainer/{p}"] = float(tb[p])
            for p, n in sorted(obs.trainer_transit.items()):
                out[f"admission/transit/{p}"] = float(n)
        return out
