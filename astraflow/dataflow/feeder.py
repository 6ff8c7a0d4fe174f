"""The task feeder: writes ``Task`` records to ``<run>.tasks.source``.

It walks a list of task payloads (synthetic arithmetic, synthetic code tasks, or a local
dataset file) for a number of epochs, each epoch in a fresh seeded order, keyed by prompt
id, at an optional rate (tasks per second) and up to an optional total count.
``should_pause()``, when given, is polled before each task; while it says so the feeder
waits (admission control plugs in here later). ``stop`` (a ``threading.Event``) ends it
early; what was produced is flushed.

A restarted feeder (``feed``, what ``feeder run`` runs) resumes: the ids of the tasks
already on the topic (ids are stable across restarts) are skipped and the count counts
them, so a run killed half-way and started again with the same settings feeds each task
once (``from_start`` feeds them all again). ``astraflow.cli.feeder`` is its command.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astraflow.config.topology import FeederSpec
from astraflow.tasks.base import make_task
from astraflow.wire.records import Task

SOURCE_TOPIC = "tasks.source"
# synthetic task family -> (default workflow, default policies)
TASK_FAMILIES: dict[str, tuple[str, list[str]]] = {
    "arithmetic": ("single_turn", ["actor"]),
    "code": ("code_tests", ["solver", "generator"]),
}


@dataclass
class FeederStats:
    produced: int = 0
    epochs_done: int = 0
    paused_s: float = 0.0
    started_at: float = field(default_factory=time.time)

    def as_dict(self) -> dict[str, float]:
        return {
            "produced": self.produced,
            "epochs_done": self.epochs_done,
            "paused_s": round(self.paused_s, 3),
            "seconds": round(time.time() - self.started_at, 3),
        }


def iter_tasks(
    payloads: Sequence[Mapping[str, Any]],
    *,
    epochs: int | None = 1,
    seed: int = 0,
    shuffle: bool = True,
    policy: str = "actor",
    policies: list[str] | None = None,
    workflow: str = "single_turn",
    run: str = "",
) -> Iterator[tuple[int, Task]]:
    """``(epoch, Task)`` for every payload, ``epochs`` times (None: forever).

    Each epoch has its own seeded order; task ids are ``<prompt_id>-e<epoch>-<index>`` (with
    ``run`` as prefix when given), unique within a run and stable across restarts.
    """
    if not payloads:
        return
    epoch = 0
    while epochs is None or epoch < epochs:
        order = list(range(len(payloads)))
        if shuffle:
            random.Random(f"feeder:{seed}:{epoch}").shuffle(order)
        for i in order:
            p = payloads[i]
            task = make_task(
                p, policy=policy, policies=policies, workflow=workflow, meta={"epoch": str(epoch)}
            )
            prefix = f"{run}." if run else ""
            task.task_id = f"{prefix}{task.prompt_id}-e{epoch}-{i}"
            yield epoch, task
        epoch += 1


class TaskFeeder:
    """Produces ``Task`` records to one topic; see the module docstring."""

    def __init__(
        self,
        producer: Any,
        topic: str,
        tasks: Iterator[tuple[int, Task]] | Sequence[Task],
        *,
        rate: float | None = None,
        count: int | None = None,
        should_pause: Callable[[], bool] | None = None,
        pause_poll_s: float = 0.2,
        flush_every: int = 1000,
        log: Callable[[str], None] | None = None,
        log_every_s: float = 10.0,
    ):
        if rate is not None and rate <= 0:
            raise ValueError("rate must be > 0 tasks/s (or None for as fast as possible)")
        if count is not None and count < 0:
            raise ValueError("count must be >= 0")
        self.producer = producer
        self.topic = topic
        self.tasks = tasks
        self.rate = rate
        self.count = count
        self.should_pause = should_pause
        self.pause_poll_s = pause_poll_s
        self.flush_every = max(1, flush_every)
        self.log = log
        self.log_every_s = log_every_s
        self.stats = FeederStats()

    def _items(self) -> Iterator[tuple[int, Task]]:
        if isinstance(self.tasks, Sequence):
            return ((0, t) for t in self.tasks)
        return iter(self.tasks)

    def _wait(self, seconds: float, stop: threading.Event | None) -> bool:
        """Sleep; True if stopped meanwhile."""
        if seconds <= 0:
            return bool(stop and stop.is_set())
        if stop is not None:
            return stop.wait(seconds)
        time.sleep(seconds)
        return False

    def run(self, stop: threading.Event | None = None) -> FeederStats:
        """Feed until the tasks, the count or ``stop`` run out; flush; return the stats."""
        st = self.stats = FeederStats()
        next_at = time.monotonic()
        last_log = time.monotonic()
        last_epoch = None
        try:
            for epoch, task in self._items():
                if self.count is not None and st.produced >= self.count:
                    break
                if stop is not None and stop.is_set():
                    break
                while self.should_pause is not None and self.should_pause():
                    t0 = time.monotonic()
                    if self._wait(self.pause_poll_s, stop):
                        return st
                    st.paused_s += time.monotonic() - t0
                    next_at = time.monotonic()  # no burst to catch up after a pause
                if self.rate is not None:
                    delay = next_at - time.monotonic()
                    if self._wait(delay, stop):
                        break
                    next_at = max(next_at, time.monotonic() - 1.0) + 1.0 / self.rate
                if last_epoch is not None and epoch != last_epoch:
                    st.epochs_done += 1
                last_epoch = epoch
                self.producer.produce(self.topic, task, key=task.prompt_id)
                st.produced += 1
                if st.produced % self.flush_every == 0:
                    self.producer.flush()
                if self.log and time.monotonic() - last_log >= self.log_every_s:
                    last_log = time.monotonic()
                    self.log(f"fed {st.produced} tasks (epoch {epoch}) to {self.topic}")
            else:
                if last_epoch is not None:
                    st.epochs_done += 1
        finally:
            self.producer.flush()
        return st


def load_payloads(
    *,
    dataset: str | None = None,
    levels: str | Sequence[int] = "1,2",
    split: str = "train",
    size: int = 20000,
    seed: int = 0,
    prompt_field: str | None = None,
    answer_field: str | None = None,
    family: str = "arithmetic",
    messages_field: str | None = None,
) -> list[dict[str, Any]]:
    """Payloads from a local dataset file, or ``size`` distinct synthetic problems of
    ``family``: ``arithmetic`` (``astraflow.tasks.arithmetic``) or ``code``
    (``astraflow.tasks.code``, for the ``code_tests`` workflow)."""
    if family not in TASK_FAMILIES:
        raise ValueError(f"unknown task family {family!r} (known: {', '.join(TASK_FAMILIES)})")
    if dataset:
        from astraflow.tasks.datasets import load_dataset_file

        return load_dataset_file(
            dataset,
            prompt_field=prompt_field,
            answer_field=answer_field,
            messages_field=messages_field,
            limit=size if size > 0 else None,
            seed=seed,
        )
    if family == "code":
        from astraflow.tasks.code import code_payloads

        return code_payloads(levels, split, size, seed)
    from astraflow.tasks.arithmetic import arithmetic_problems

    return [p.payload() for p in arithmetic_problems(levels, split, size, seed)]


def resume_tasks(
    tasks: Iterator[tuple[int, Task]], fed: set[str], count: int | None
) -> Iterator[tuple[int, Task]]:
    """``tasks`` up to ``count`` of them (None: all), without those whose id is in ``fed``."""
    for n, item in enumerate(tasks):
        if count is not None and n >= count:
            return
        if item[1].task_id not in fed:
            yield item


def fed_task_ids(config: Any, topic: str) -> set[str]:
    """The ids of the tasks on ``topic`` (read once, to its end)."""
    from astraflow.kafka.clients import read_all

    return {r.record.task_id for r in read_all(config, topic, idle_s=1.0, expect=Task)}


def feed(topo: Any, spec: FeederSpec, config: Any,
         stop: threading.Event | None = None) -> dict[str, Any]:
    """Feed the tasks ``spec`` (the topology's ``feeder:``, flags applied) names to
    ``topo``'s tasks.source with the client settings ``config``, until they, its count or
    ``stop`` run out; the topic and the stats. ``ValueError`` (a ``DatasetError`` among
    them) when there is nothing to feed."""
    from astraflow.kafka.clients import RecordProducer

    d = spec.dataset
    payloads = load_payloads(
        dataset=d.path if d else None,
        levels=spec.levels,
        split=spec.split,
        size=spec.size,
        seed=spec.seed,
        prompt_field=d.prompt_field if d else None,
        answer_field=d.answer_field if d else None,
        family=spec.task_family,
        messages_field=d.messages_field if d else None,
    )
    if not payloads:
        raise ValueError("no tasks to feed")
    topic = topo.full_name(SOURCE_TOPIC)
    default_workflow, default_policies = TASK_FAMILIES[spec.task_family]
    producer = RecordProducer(config)
    tasks = iter_tasks(
        payloads,
        epochs=spec.epochs or None,
        seed=spec.seed,
        policies=spec.policies or list(default_policies),
        workflow=spec.workflow or default_workflow,
        run=topo.run,
    )
    fed = set() if spec.from_start else fed_task_ids(config, topic)
    if fed:
        print(f"resuming: {len(fed)} tasks already on {topic} are skipped", flush=True)
    feeder = TaskFeeder(producer, topic, resume_tasks(tasks, fed, spec.count), rate=spec.rate,
                        log=lambda m: print(m, flush=True))
    print(f"feeding {len(payloads)} distinct tasks to {topic}", flush=True)
    st = feeder.run(stop)
    return {"topic": topic, **st.as_dict()}
