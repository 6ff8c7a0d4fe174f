"""A synchronous, trainer-centric RL loop built from a topology: the baseline of
``bench/async_vs_sync.py``.

It is what a colocated synchronous system (verl's default mode) does, in one process and
with AstraFlow's own components: each iteration takes the next B tasks of the topology's
task stream (the feeder's dataset, order and task ids), rolls all of them out with the
RaaS node's code (``RaaSNode.rollout_batch``: the same workflows, options and engines) on
as many rollout slots as the pool has nodes (a thread each, each with its own engines,
like one node each), waits for the whole batch, builds each policy's GRPO batch the way
the post-rollout processors do (``split_by_policy``, ``split_by_role`` when the router
splits roles, ``class_balance`` where the topology balances a policy), takes one
optimizer step per policy with the trainer the topology configures (``Trainer`` with the
policy's ``TrainerSpec`` that ``astraflow trainer run`` reads from the same file), loads the
new published weights into every slot's engines, and repeats. Nothing goes through Kafka.

B is the batch size of the first policy's batcher (the groups a version of it trains on
in the asynchronous run). Every other policy trains, each iteration, on its groups of
that iteration's tasks (after its processors), however many they are.

Timings per iteration: rollout (of which the pool waited on stragglers: from the moment
the first slot ran out of work to the end of the batch; and the slots' busy fraction),
training, weight loading. The clock starts at the first iteration (version 0: the
initial weights). Every ``eval_every``-th version's published weights are kept (copies)
so that they can be scored after the run, off the clock.
"""

from __future__ import annotations

import itertools
import queue
import statistics
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from astraflow.config.topology import Topology
from astraflow.wire.records import Batch, Task, TrajectoryGroup


@dataclass
class Iteration:
    """One synchronous iteration: its timings (seconds) and what it trained."""

    version: int
    end_s: float  # since the loop started, once the new weights were loaded
    rollout_s: float
    straggler_s: float  # of rollout_s: after the first slot ran out of work
    busy: float  # the slots' busy fraction during the rollout
    train_s: float
    load_s: float
    groups: dict[str, int] = field(default_factory=dict)
    reward: dict[str, float] = field(default_factory=dict)
    failed: int = 0

    @property
    def total_s(self) -> float:
        """Rollout, training and weight loading: the iteration's seconds."""
        return self.rollout_s + self.train_s + self.load_s


def launched(topo: Topology, path: str, name: str) -> Any:
    """The configuration of process ``name`` of ``astraflow up PATH`` (``trainer-<policy>``,
    ``raas-<pool>-<i>``, ``eval-<policy>``, ``feeder``), as its command in up's plan builds
    it (``astraflow.launch.components.component_configuration``)."""
    from astraflow.launch.components import component_configuration

    return component_configuration(topo, name)


def feeder_tasks(topo: Topology, path: str) -> Iterator[Task]:
    """The tasks ``topo``'s feeder would write, in its order and with its task ids (what
    ``astraflow.dataflow.feeder.feed`` writes for up's feeder, without the topic)."""
    from astraflow.dataflow.feeder import TASK_FAMILIES, iter_tasks, load_payloads

    assert topo.feeder is not None, "the topology has no feeder"
    spec = launched(topo, path, "feeder")  # FeederSpec
    d = spec.dataset
    payloads = load_payloads(dataset=d.path if d else None, levels=spec.levels,
                             split=spec.split, size=spec.size, seed=spec.seed,
                             prompt_field=d.prompt_field if d else None,
                             answer_field=d.answer_field if d else None,
                             family=spec.task_family,
                             messages_field=d.messages_field if d else None)
    workflow, policies = TASK_FAMILIES[spec.task_family]
    tasks = iter_tasks(payloads, epochs=spec.epochs or None, seed=spec.seed,
                       policies=spec.policies or list(policies),
                       workflow=spec.workflow or workflow, run=topo.run)
    return (task for _, task in tasks)


def build_slots(topo: Topology, path: str, pool: str, slots: int) -> list[Any]:
    """``slots`` RaaS nodes of ``pool`` (engines loaded as ``raas run`` loads them, weights
    not followed): the rollout slots."""
    from astraflow.kafka.config import KafkaConfig
    from astraflow.models.chat import ChatFormat
    from astraflow.raas.engines import load_engine
    from astraflow.raas.node import RaaSNode

    node = launched(topo, path, f"raas-{pool}-0")  # NodeConfiguration
    nodes = []
    for i in range(slots):
        engines = {}
        for policy, model in node.settings.models.items():
            engines[policy] = load_engine(node.settings, policy, model)
            if policy in node.settings.chats:
                engines[policy].chat = ChatFormat.from_options(
                    node.settings.chats[policy].model_dump())
        options = replace(node.options, instance=f"sync-{i}", follow_weights=False)
        nodes.append(RaaSNode(topo, engines, options, config=KafkaConfig()))
    return nodes


def build_trainers(topo: Topology, path: str) -> dict[str, Any]:
    """Policy -> the ``Trainer`` that ``astraflow trainer run`` would build for it."""
    from astraflow.trainer.trainer import Trainer

    out = {}
    for policy in topo.policies:
        opts = launched(topo, path, f"trainer-{policy}")  # ServiceOptions
        if policy == next(iter(topo.policies)):
            # what `trainer run` seeds torch with: its policy's trainer seed
            torch.manual_seed(opts.spec.trainer.seed)
        out[policy] = Trainer.for_policy(opts.spec, policy)
    return out


def policy_groups(topo: Topology) -> Callable[[TrajectoryGroup], dict[str, list[TrajectoryGroup]]]:
    """``split(group) -> {policy: [groups it trains on]}`` as the topology's router and
    ``class_balance`` processors would pass them (staleness filters keep everything here:
    every rollout is on-policy)."""
    from astraflow.dataflow.class_balance import balance
    from astraflow.dataflow.router import split_by_policy, split_by_role

    split_roles = any(p.kind == "router" and (p.options or {}).get("split_roles")
                      for p in topo.processors.values())
    balancers = [(name, p.options) for name, p in topo.processors.items()
                 if p.kind == "class_balance"]

    def split(group: TrajectoryGroup) -> dict[str, list[TrajectoryGroup]]:
        out: dict[str, list[TrajectoryGroup]] = {}
        for policy, part in split_by_policy(group).items():
            parts = split_by_role(part) if split_roles else [part]
            for name, o in balancers:
                if o.get("policy") == policy:
                    parts = [b for g in parts if (b := balance(
                        g, policy, o.get("key", "truth"), o.get("single_class", "drop"),
                        salt=name)) is not None]
            out.setdefault(policy, []).extend(parts)
        return out

    return split


def first_batch_size(topo: Topology) -> int:
    """The batch size of the first policy's batcher: tasks per synchronous iteration."""
    first = next(iter(topo.policies))
    for p in topo.processors.values():
        if p.kind == "batcher" and (p.options or {}).get("policy") == first:
            return int(p.options.get("batch_size", 8))
    raise ValueError(f"no batcher for policy {first}")


class SyncLoop:
    """The synchronous loop of ``topo`` (module docstring); ``run`` until a duration or a
    number of iterations."""

    def __init__(self, topo: Topology, path: str, *, pool: str | None = None,
                 slots: int | None = None, eval_every: dict[str, int] | None = None,
                 threads: int = 1):
        torch.set_num_threads(threads)  # as every process of `astraflow up` (OMP 1)
        self.topo = topo
        self.pool = pool or next(iter(topo.pools))
        spec = topo.pools[self.pool]
        self.per_slot = spec.tasks_per_transaction
        self.nodes = build_slots(topo, path, self.pool, slots or spec.nodes)
        self.trainers = build_trainers(topo, path)
        self.split = policy_groups(topo)
        self.batch_tasks = first_batch_size(topo)
        self.tasks = feeder_tasks(topo, path)
        self.eval_every = eval_every or {}
        self.version = 0
        self.snapshots: dict[str, dict[int, dict[str, torch.Tensor]]] = {
            p: {0: self._published(p)} for p in self.eval_every}
        self.history: list[Iteration] = []
        self._pool = ThreadPoolExecutor(len(self.nodes), thread_name_prefix="slot")

    def close(self) -> None:
        """Stop the slots' threads."""
        self._pool.shutdown(wait=True)

    def _published(self, policy: str) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.trainers[policy].published_state().items()}

    def _slot(self, node: Any, work: queue.SimpleQueue, t0: float,
              out: list) -> tuple[float, float]:
        """Roll out chunks of tasks from ``work`` until it is empty; ``(busy seconds, when
        it ran out of work)``, the groups (or exceptions) appended to ``out``."""
        busy = 0.0
        while True:
            try:
                chunk = work.get_nowait()
            except queue.Empty:
                return busy, time.perf_counter() - t0
            s = time.perf_counter()
            out.extend(node.rollout_batch(chunk))
            busy += time.perf_counter() - s

    def roll_out(self, tasks: list[Task]) -> tuple[list[TrajectoryGroup], int, float, float]:
        """All ``tasks`` rolled out on the slots: ``(groups, failed tasks, seconds the pool
        waited on stragglers, busy fraction)``."""
        work: queue.SimpleQueue = queue.SimpleQueue()
        for i in range(0, len(tasks), self.per_slot):
            work.put(tasks[i:i + self.per_slot])
        out: list = []
        t0 = time.perf_counter()
        futures = [self._pool.submit(self._slot, node, work, t0, out) for node in self.nodes]
        done = [f.result() for f in futures]
        span = time.perf_counter() - t0
        straggler = span - min(idle for _, idle in done)
        busy = sum(b for b, _ in done) / (span * len(done)) if span > 0 else 1.0
        groups = [g for g in out if isinstance(g, TrajectoryGroup)]
        return groups, len(out) - len(groups), straggler, busy

    def train(self, groups: list[TrajectoryGroup]) -> tuple[dict[str, int], dict[str, float]]:
        """One step per policy on its groups of ``groups``; the groups and mean reward."""
        by_policy: dict[str, list[TrajectoryGroup]] = {p: [] for p in self.trainers}
        for g in groups:
            for policy, parts in self.split(g).items():
                by_policy.setdefault(policy, []).extend(parts)
        rewards = {}
        for policy, trainer in self.trainers.items():
            batch = Batch(policy=policy, batch_id=uuid.uuid4().hex, groups=by_policy[policy])
            metrics = trainer.train_step(batch, current_version=self.version)
            rewards[policy] = metrics["trainer/reward_mean"]
        return {p: len(v) for p, v in by_policy.items()}, rewards

    def load_weights(self) -> None:
        """Every slot's engines take the newly published weights (version ``version``)."""
        for policy, trainer in self.trainers.items():
            state = trainer.published_state()
            for node in self.nodes:
                node.engines[policy].load_state_dict(state, self.version)

    def iteration(self, started: float) -> Iteration:
        """Roll out the next B tasks, train every policy once, load the new weights."""
        tasks = list(itertools.islice(self.tasks, self.batch_tasks))
        t0 = time.perf_counter()
        groups, failed, straggler, busy = self.roll_out(tasks)
        t1 = time.perf_counter()
        sizes, rewards = self.train(groups)
        t2 = time.perf_counter()
        self.version += 1
        self.load_weights()
        t3 = time.perf_counter()
        for policy, every in self.eval_every.items():
            if self.version % every == 0:
                self.snapshots[policy][self.version] = self._published(policy)
        it = Iteration(self.version, t3 - started, t1 - t0, straggler, busy, t2 - t1, t3 - t2,
                       sizes, rewards, failed)
        self.history.append(it)
        return it

    def run(self, duration_s: float | None = None, iterations: int | None = None,
            log: Callable[[Iteration], None] | None = None) -> list[Iteration]:
        """Iterate until ``duration_s`` seconds have passed (an iteration started before
        then finishes) or ``iterations`` are done; the iterations."""
        started = time.perf_counter()
        while (iterations is None or len(self.history) < iterations) and (
                duration_s is None or time.perf_counter() - started < duration_s):
            it = self.iteration(started)
            if log is not None:
                log(it)
        return self.history


def breakdown(history: list[Iteration]) -> dict[str, float]:
    """Means per iteration of the synchronous loop's phases (seconds), and the busy
    fraction of the rollout slots."""
    if not history:
        return {}
    mean = statistics.fmean
    return {"rollout_s": mean(i.rollout_s for i in history),
            "straggler_s": mean(i.straggler_s for i in history),
            "train_s": mean(i.train_s for i in history),
            "load_s": mean(i.load_s for i in history),
            "iteration_s": mean(i.total_s for i in history),
            "slots_busy": mean(i.busy for i in history),
            "failed_tasks": float(sum(i.failed for i in history))}


__all__ = ["Iteration", "SyncLoop", "breakdown", "build_slots", "build_trainers",
           "feeder_tasks", "first_batch_size", "launched", "policy_groups"]
