"""The RaaS node: tasks in, trajectory groups out, exactly once.

The node consumes ``<run>.tasks`` in its pool's consumer group (``<run>.raas``, shared by
the pools so that each task is rolled out once, or ``<run>.raas.<pool>`` for a pool with
``share_tasks: false``),
runs each task's workflow against its engines, and then, in ONE Kafka transaction,
produces the ``TrajectoryGroup``s to ``trajectories.raw``, any dead letters to ``dlq``, an
optional ``ComponentStatus`` to ``status``, and commits the tasks' offsets
(``send_offsets_to_transaction``). The rollout itself runs outside the transaction, so a
transaction lives only as long as the produce. A node killed mid-rollout has committed
nothing for its task: the group hands the task to another member (or to the restarted
node), and ``read_committed`` readers see each group once. The transactional id is
``<run>.raas.<pool>.<instance>``: a restarted instance fences its predecessor.

SIGTERM (``stop()``): finish the current task(s), commit, leave the group.
"""

from __future__ import annotations

import logging
import socket
import statistics
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from confluent_kafka import KafkaException, Message

from astraflow.config.components import NodeSettings
from astraflow.config.topology import PoolSpec, Topology
from astraflow.dataflow.runtime import loop_spec
from astraflow.kafka.clients import dead_letter, make_admin, make_codec_for
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.instance import default_instance
from astraflow.kafka.loop import Checkpoint, RecordTooLarge, RuntimeCounters, TransactionalLoop
from astraflow.kafka.topics import missing_topics
from astraflow.raas.agent.journal import EpisodeJournal
from astraflow.raas.engine import Engine
from astraflow.raas.weights_follow import FollowingEngine, WeightWatcher
from astraflow.raas.workflows import Workflow, make_workflow
from astraflow.weights.signing import verifier_from
from astraflow.wire.codec import RecordDecodeError
from astraflow.wire.records import ComponentStatus, DeadLetter, Task, TrajectoryGroup
from astraflow.wire.validate import InvalidRecord, check_record

log = logging.getLogger("astraflow.raas")


_POOL = PoolSpec()  # the one declaration of a pool's defaults


@dataclass
class NodeOptions:
    """What a node runs with; ``from_settings`` builds it from its pool's typed section of
    the topology, whose defaults these are."""

    pool: str = "default"
    instance: str | None = None  # default: astraflow.kafka.instance.default_instance()
    n_samples: int = _POOL.n_samples
    tasks_per_transaction: int = _POOL.tasks_per_transaction
    poll_timeout_s: float = 0.5
    session_timeout_ms: int = _POOL.session_timeout_ms
    max_poll_interval_ms: int = 600_000  # longest rollout batch before the group evicts us
    follow_weights: bool = _POOL.follow_weights
    # > 0: a newer version is applied inside a generation, between chunks of this many
    # tokens (engines with follow_inflight; fetched by a prefetch thread)
    update_every_tokens: int = _POOL.update_every_tokens
    speed: float = _POOL.speed  # < 1: pause (1/speed - 1) x each rollout batch's duration
    weights_catchup_s: float = 10.0
    workflow_options: dict[str, dict[str, Any]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not 0 < self.speed <= 1:
            raise ValueError(f"speed {self.speed}: must be above 0 and at most 1")
        if self.update_every_tokens < 0:
            raise ValueError(f"update_every_tokens {self.update_every_tokens}: must be >= 0 "
                             "(0: off)")

    @classmethod
    def from_settings(cls, settings: NodeSettings, instance: str | None = None) -> NodeOptions:
        """A node of ``settings.pool`` as its typed configuration (its pool's section,
        flags applied: ``astraflow.config.components.node_settings``) declares it."""
        spec = settings.spec
        return cls(pool=settings.pool, instance=instance, n_samples=spec.n_samples,
                   tasks_per_transaction=spec.tasks_per_transaction,
                   session_timeout_ms=spec.session_timeout_ms,
                   follow_weights=spec.follow_weights, speed=spec.speed,
                   update_every_tokens=spec.update_every_tokens,
                   workflow_options={k: dict(v) for k, v in settings.workflow_options.items()})


@dataclass
class NodeCounters(RuntimeCounters):
    gen_tokens: int = 0


class RaaSNode:
    """One rollout node of a pool. ``engines``: policy name -> engine. ``config``: the
    node's client settings, default the pool's (``Topology.pool_kafka``), whose rack sets
    ``client.rack`` on every consumer of the node: tasks, weight manifests, blobs."""

    def __init__(
        self,
        topology: Topology,
        engines: dict[str, Engine],
        options: NodeOptions | None = None,
        config: KafkaConfig | None = None,
    ):
        if not engines:
            raise ValueError("a RaaS node needs at least one engine")
        self.topology = topology
        self.options = options or NodeOptions()
        # default: the pool's client settings (its `kafka:` and rack) over the topology's
        self.config = (config or topology.pool_kafka(self.options.pool)).effective(
        ).for_component(f"pool.{self.options.pool}", topology.run)
        self.engines: dict[str, Engine] = dict(engines)
        self.instance = self.options.instance or default_instance()
        self.pool = self.options.pool
        self.component_id = f"raas.{self.pool}/{self.instance}"
        self.group = topology.raas_group(self.pool)
        # per pool and instance: pools sharing the group may run instances of one name
        self.transactional_id = f"{topology.run}.raas.{self.pool}.{self.instance}"
        self.codec = make_codec_for(self.config)
        # signed weights: manifests not signed by the trusted key are refused (None: all taken)
        self.verifier = verifier_from(topology.weight_signing)
        self.counters = NodeCounters()
        self._out = topology.full_name("trajectories.raw")
        self._workflows: dict[str, Workflow] = {}
        self._journal: EpisodeJournal | None = None  # of agent episodes, made on first use
        self._watchers: dict[str, WeightWatcher] = {}
        self.current_task: str | None = None
        self._last_metrics: dict[str, float] = {}
        self._window: dict[str, list[float]] = {}  # workflow metrics since the last status
        self._window_means: dict[str, float] = {}
        o = self.options
        self.loop = TransactionalLoop(
            loop_spec(topology, self.component_id, self.group, self.transactional_id,
                      ["tasks"], ["trajectories.raw"], max_batch=o.tasks_per_transaction,
                      poll_timeout_s=o.poll_timeout_s,
                      consumer_options={"session.timeout.ms": o.session_timeout_ms,
                                        "max.poll.interval.ms": o.max_poll_interval_ms}),
            self, self.config, self.codec)
        self.running = self.loop.running

    def stop(self) -> None:
        """Finish the current task(s), commit, leave the group, return from ``run``."""
        self.loop.stop()

    # --- setup -------------------------------------------------------------------------
    def _workflow(self, name: str) -> Workflow:
        wf = self._workflows.get(name)
        if wf is None:
            wf = self._workflows[name] = make_workflow(
                name, **self.options.workflow_options.get(name, {})
            )
            attach = getattr(wf, "attach", None)  # a workflow that logs its agents' calls
            if callable(attach):
                attach(self._episode_journal(), self.component_id)
        return wf

    def _episode_journal(self) -> EpisodeJournal | None:
        """The node's journal on the topology's ``episodes`` topic (None: it has none)."""
        if self._journal is None and "episodes" in self.topology.topics:
            self._journal = EpisodeJournal(self.config, self.topology.full_name("episodes"),
                                           self.component_id)
        return self._journal

    def _start_watchers(self, admin) -> None:
        if not self.options.follow_weights:
            return
        for policy, engine in list(self.engines.items()):
            logical = f"weights.{policy}"
            topic = self.topology.full_name(logical)
            if logical not in self.topology.topics or missing_topics(admin, [topic]):
                log.warning(
                    "%s: no topic %s; policy %s keeps its initial weights",
                    self.component_id,
                    topic,
                    policy,
                )
                continue
            watcher = WeightWatcher(self.config, topic, engine, self.codec,
                                    verifier=self.verifier)
            watcher.catch_up(self.options.weights_catchup_s)
            self._watchers[policy] = watcher
            self._follow_inflight(policy, engine, watcher)
            self.engines[policy] = FollowingEngine(engine, watcher)  # type: ignore[assignment]

    def _follow_inflight(self, policy: str, engine: Engine, watcher: WeightWatcher) -> None:
        """With ``update_every_tokens``: the engine takes newer versions between chunks of
        a generation, which the watcher fetches in the background; an engine that cannot
        (no ``follow_inflight``) keeps updating between generate calls, and says so."""
        every = self.options.update_every_tokens
        if not every:
            return
        follow = getattr(engine, "follow_inflight", None)
        if not callable(follow):
            log.warning("%s: policy %s: the %s applies new weights between generate calls "
                        "only; update_every_tokens %d has no effect on it", self.component_id,
                        policy, type(engine).__name__, every)
            return
        try:
            follow(watcher, every)
        except ValueError as e:  # this engine cannot here (e.g. vLLM with native LoRA)
            log.warning("%s: %s; it takes new weights between generate calls only",
                        self.component_id, e)
            return
        watcher.start_prefetch()
        log.info("%s: policy %s takes new weights every %d tokens inside a generation",
                 self.component_id, policy, every)

    def refresh_weights(self, cp: Checkpoint | None = None) -> None:
        """Bring every engine to its newest trusted version; manifests refused since the
        last call (signed weights) are dead-lettered in ``cp``."""
        for w in self._watchers.values():
            w.refresh()
            for letter in w.dead_letters(self.component_id) if cp is not None else ():
                cp.dead_letter(letter)

    # --- the Work the transactional loop runs -----------------------------------------
    def run(self) -> NodeCounters:
        self.loop.run()
        return self.counters

    def start(self, loop: TransactionalLoop) -> None:
        self._start_watchers(make_admin(self.config))
        log.info("%s: policies %s", self.component_id,
                 ", ".join(f"{p}@v{e.version}" for p, e in self.engines.items()))

    def handle(self, msgs: list[Message], cp: Checkpoint) -> None:
        self.refresh_weights(cp)
        if not msgs:
            return
        t0 = time.monotonic()
        groups, dead = self._rollouts(msgs)
        self._slow_down(time.monotonic() - t0)
        for letter in dead:
            cp.dead_letter(letter)
        for m, g in groups:
            try:
                cp.add(self._out, g, g.prompt_id)
            except RecordTooLarge as e:
                cp.dead_letter(self._dead_task(m, e))

    def _slow_down(self, seconds: float) -> None:
        """At ``speed`` < 1, pause as long as a node that much slower would still work (the
        pause counts as busy time, as the work would)."""
        speed = self.options.speed
        if speed >= 1:
            return
        end = time.monotonic() + seconds * (1 / speed - 1)
        while not self.loop.stopping and (left := end - time.monotonic()) > 0:
            time.sleep(min(0.1, left))

    def held_offsets(self) -> dict[tuple[str, int], int]:
        return {}

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        """Nothing is held between transactions."""

    def close(self) -> None:
        for w in self._watchers.values():
            w.close()
        if self._journal is not None:
            self._journal.close()

    def _rollouts(self, msgs) -> tuple[list[tuple[Any, TrajectoryGroup]], list[DeadLetter]]:
        """The groups of ``msgs``' tasks (with their message), in order, and dead letters
        for the bad ones.

        Tasks of one workflow that has ``run_batch`` are rolled out together (one
        ``generate`` call per phase for all of them); a batch that fails as a whole is run
        again task by task, so one bad task cannot take the others down with it.
        """
        dead: list[DeadLetter] = []
        tasks: list[tuple[Any, Task]] = []
        for m in msgs:
            topic, part, off = m.topic(), m.partition(), m.offset()
            try:
                task = self.codec.decode(m.value(), topic, part, off, expect=Task)
                check_record(task)
                tasks.append((m, task))
            except Exception as e:  # noqa: BLE001 - any bad task goes to dlq, the node goes on
                dead.append(self._dead_task(m, e))
        by_workflow: dict[str, list[int]] = {}
        for i, (_, task) in enumerate(tasks):
            by_workflow.setdefault(task.workflow, []).append(i)
        made: dict[int, TrajectoryGroup] = {}  # index in tasks -> its group
        for name, batch in by_workflow.items():
            try:
                wf = self._workflow(name)
            except Exception as e:  # noqa: BLE001 - an unknown workflow: its tasks to dlq
                dead.extend(self._dead_task(tasks[i][0], e) for i in batch)
                continue
            results = self._run_batch(wf, [tasks[i][1] for i in batch])
            for i, (result, seconds) in zip(batch, results):
                if isinstance(result, Exception):
                    dead.append(self._dead_task(tasks[i][0], result))
                else:
                    made[i] = self._group(tasks[i][1], wf, result, seconds)
        self.current_task = None
        return [(tasks[i][0], made[i]) for i in sorted(made)], dead

    def _run_batch(self, wf: Workflow, tasks: list[Task]) -> list[tuple[Any, float]]:
        """Per task: its sequences or exception, and the seconds its rollout took."""
        run_batch = getattr(wf, "run_batch", None)
        if len(tasks) > 1 and callable(run_batch):
            self.current_task = ",".join(t.task_id for t in tasks)
            log.info("%s: rollout of %d %s tasks started", self.component_id, len(tasks),
                     wf.name)
            t0 = time.perf_counter()
            try:
                results = run_batch(tasks, self.engines, self.options.n_samples)
                seconds = time.perf_counter() - t0
                return [(r, seconds) for r in results]
            except KafkaException:
                raise
            except Exception as e:  # noqa: BLE001 - retried one task at a time below
                log.warning("%s: batch of %d tasks failed (%s: %s); running them one by one",
                            self.component_id, len(tasks), type(e).__name__, e)
        out: list[tuple[Any, float]] = []
        for task in tasks:
            self.current_task = task.task_id
            log.info("%s: rollout of task %s (%s) started", self.component_id, task.task_id,
                     task.workflow)
            t0 = time.perf_counter()
            try:
                result: Any = wf.run(task, self.engines, self.options.n_samples)
            except KafkaException:
                raise
            except Exception as e:  # noqa: BLE001 - this task goes to dlq
                result = e
            out.append((result, time.perf_counter() - t0))
        return out

    def _dead_task(self, m, e: Exception) -> DeadLetter:
        reason = f"{type(e).__name__}: {e}"
        expected = isinstance(e, RecordDecodeError | ValueError | InvalidRecord | RecordTooLarge)
        level = logging.WARNING if expected else logging.ERROR
        log.log(level, "%s: dead-lettering %s[%d]@%d: %s", self.component_id, m.topic(),
                m.partition(), m.offset(), reason, exc_info=(e if not expected else None))
        return dead_letter(m, self.component_id, reason)

    def rollout(self, task: Task) -> TrajectoryGroup:
        """Run one task's workflow; the group it produces (no Kafka involved)."""
        (result,) = self.rollout_batch([task])
        if isinstance(result, Exception):
            raise result
        return result

    def rollout_batch(self, tasks: list[Task]) -> list[TrajectoryGroup | Exception]:
        """Run ``tasks`` as one transaction's batch of them runs (those of a workflow with
        ``run_batch`` together), with no Kafka involved: per task, in order, its group or
        the exception it raised (an unknown workflow included)."""
        by_workflow: dict[str, list[int]] = {}
        for i, task in enumerate(tasks):
            by_workflow.setdefault(task.workflow, []).append(i)
        made: dict[int, TrajectoryGroup | Exception] = {}
        for name, batch in by_workflow.items():
            try:
                wf = self._workflow(name)
            except Exception as e:  # noqa: BLE001 - an unknown workflow fails its tasks
                made.update((i, e) for i in batch)
                continue
            results = self._run_batch(wf, [tasks[i] for i in batch])
            for i, (result, seconds) in zip(batch, results):
                made[i] = (result if isinstance(result, Exception)
                           else self._group(tasks[i], wf, result, seconds))
        self.current_task = None
        return [made[i] for i in range(len(tasks))]

    def _group(self, task: Task, wf: Workflow, seqs: list, seconds: float) -> TrajectoryGroup:
        """The ``TrajectoryGroup`` of one task's sequences, with its metrics."""
        rewards = [s.reward for s in seqs]
        gen_tokens = sum(sum(s.loss_mask) for s in seqs)
        self.counters.gen_tokens += gen_tokens
        gen_versions = [v for s in seqs for v in s.versions if v >= 0]
        metrics = {
            "rollout/reward_mean": statistics.fmean(rewards) if rewards else 0.0,
            "rollout/reward_std": statistics.pstdev(rewards) if len(rewards) > 1 else 0.0,
            "rollout/gen_tokens": float(gen_tokens),
            "rollout/seq_tokens_mean": (
                statistics.fmean(len(s.token_ids) for s in seqs) if seqs else 0.0
            ),
            "rollout/seconds": seconds,
            "rollout/tokens_per_s": gen_tokens / seconds if seconds > 0 else 0.0,
            "rollout/min_version": float(min(gen_versions, default=-1)),
            "rollout/max_version": float(max(gen_versions, default=-1)),
            # the most versions one sequence's tokens span (> 0: updated inside a generation
            # or between an episode's calls)
            "rollout/version_span_max": float(max(
                (s.max_version - s.min_version for s in seqs if s.min_version >= 0),
                default=0)),
        }
        # per-policy rewards of a multi-policy group, and the workflow's own figures
        # (e.g. verify/*): in the group, and averaged since the last status on `status`
        extra: dict[str, float] = {}
        policies = sorted({s.policy for s in seqs})
        if len(policies) > 1:
            for p in policies:
                extra[f"rollout/reward_mean/{p}"] = statistics.fmean(
                    s.reward for s in seqs if s.policy == p)
        group_metrics = getattr(wf, "group_metrics", None)
        if callable(group_metrics):
            extra.update(group_metrics(seqs))
        metrics.update(extra)
        for k, v in extra.items():
            self._window.setdefault(k, []).append(v)
        self._last_metrics = metrics
        log.info(
            "%s: rollout of task %s done: %d sequences, %d tokens, %.2fs",
            self.component_id,
            task.task_id,
            len(seqs),
            gen_tokens,
            seconds,
        )
        return TrajectoryGroup(
            group_id=uuid.uuid4().hex,
            prompt_id=task.prompt_id,
            task_id=task.task_id,
            workflow=task.workflow,
            source=task.source,
            raas_id=self.component_id,
            pool=self.pool,
            sequences=seqs,
            rewards=rewards,
            metrics=metrics,
            meta={"attempt": str(task.attempt)},
        )

    def _take_window(self) -> dict[str, float]:
        """Means of the workflow metrics of the groups since the last call (the previous
        means when no group came in between)."""
        if self._window:
            self._window_means = {k: statistics.fmean(v) for k, v in self._window.items()}
            self._window = {}
        return dict(self._window_means)

    def status(self) -> ComponentStatus:
        c = self.counters
        state = "stopping" if self.loop.stopping else "running"
        gen_s = sum(getattr(e, "seconds_generating", 0.0) for e in self.engines.values())
        metrics = {
            "raas/transactions": float(c.transactions),
            "raas/aborted": float(c.aborted),
            "raas/gen_tokens": float(c.gen_tokens),
            "raas/gen_tokens_per_s": c.gen_tokens / gen_s if gen_s > 0 else 0.0,
            "raas/weight_updates": float(sum(w.updates for w in self._watchers.values())),
            # of those, the versions taken between two chunks of a generation
            "raas/weight_updates_inflight": float(
                sum(w.inflight_updates for w in self._watchers.values())),
            # seconds spent bringing the engines to new versions (blobs fetched over Kafka,
            # deltas applied, engine reloaded), in all and the latest update's
            "raas/weight_sync_s": sum(w.update_s for w in self._watchers.values()),
            "raas/weight_sync_last_s": max(
                (w.last_update_s for w in self._watchers.values()), default=0.0),
            **self._last_metrics,
            **self._take_window(),
        }
        return ComponentStatus(
            component_id=self.component_id,
            kind="raas",
            host=socket.gethostname(),
            policy=",".join(self.engines),
            pool=self.pool,
            state=state,
            produced=c.produced,
            consumed=c.consumed,
            in_flight=1 if self.current_task else 0,
            dead_lettered=c.dead_lettered,
            waiting_s=c.waiting_s,
            busy_s=c.busy_s,
            weight_versions={p: int(e.version) for p, e in self.engines.items()},
            capacity=float(self.options.n_samples),
            started_at_ms=c.started_at_ms,
            metrics=metrics,
        )


__all__ = ["NodeCounters", "NodeOptions", "RaaSNode"]
