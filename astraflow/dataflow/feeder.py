"""The task feeder: writes ``Task`` records to ``<run>.tasks.source``.

It walks a list of task payloads (synthetic arithmetic, synthetic code tasks, or a local
dataset file) for a number of epochs, each epoch in a fresh seeded order, keyed by prompt
id, at an optional rate (tasks per second) and up to an optional total count.
``should_pause()``, when given, is polled before each task; while it says so the feeder
waits (admission control plugs in here later). ``stop`` (a ``threading.Event``) ends it
early; what was produced is flushed.

A restarted ``feeder run`` resumes: the ids of the tasks already on the topic (ids are
stable across restarts) are skipped and ``--count`` counts them, so a run killed half-way
and started again with the same arguments feeds each task once (``--from-start`` feeds
them all again).
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_run_options, add_table
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
        )
    if family == "code":
        from astraflow.tasks.code import code_payloads

        return code_payloads(levels, split, size, seed)
    from astraflow.tasks.arithmetic import arithmetic_problems

    return [p.payload() for p in arithmetic_problems(levels, split, size, seed)]


# --- CLI ----------------------------------------------------------------------------------
_EXAMPLES = [
    "astraflow feeder run -t topology/default.yaml --epochs 0 --rate 60   # forever",
    "astraflow feeder run -t topology/default.yaml --dataset data/addition.train.jsonl",
    "astraflow feeder run -t topology/default.yaml --dataset gsm8k.parquet "
    "--prompt-field question --answer-field answer",
    "astraflow feeder run -t topology/default.yaml --task-family code --levels 1,2,3 --count 500",
]

_FEEDING: list[Option] = [
    (("--count",), dict(type=int, default=None, metavar="N", help="stop after N tasks")),
    (("--rate",), dict(type=float, default=None, metavar="R", help="tasks per second "
                       "(default: as fast as the broker takes them)")),
    (("--epochs",), dict(type=int, default=1, metavar="E", help="passes over the tasks "
                         "(0: forever)")),
    (("--seed",), dict(type=int, default=0, help="the order of the tasks (and the synthetic "
                       "ones)")),
    (("--from-start",), dict(action="store_true", help="feed every task again (default: skip "
                             "the task ids already on the topic)")),
    (("--policy",), dict(action="append", default=None, metavar="NAME", help="policy the "
                         "workflow uses (repeatable; default actor, for code: solver and "
                         "generator)")),
    (("--workflow",), dict(default=None, help="workflow of the tasks (default single_turn, for "
                           "code: code_tests)")),
]

_TASKS: list[Option] = [
    (("--dataset",), dict(default=None, metavar="PATH", help="local .jsonl/.parquet file "
                          "(default: synthetic tasks of --task-family)")),
    (("--prompt-field",), dict(default=None, help="the dataset's prompt field")),
    (("--answer-field",), dict(default=None, help="the dataset's answer field")),
    (("--messages-field",), dict(default=None, help="a field holding chat messages (list of "
                                 "{role, content})")),
    (("--task-family",), dict(default="arithmetic", choices=sorted(TASK_FAMILIES), help="synthetic "
                              "tasks: arithmetic (default) or code (one-expression functions, "
                              "fed to the code_tests workflow with policies solver and "
                              "generator unless --workflow / --policy say otherwise)")),
    (("--levels",), dict(default="1,2", help="levels of the task family (default 1,2)")),
    (("--split",), dict(default="train", choices=["train", "eval"])),
    (("--size",), dict(type=int, default=20000, metavar="N", help="distinct tasks per epoch "
                       "(dataset: first N rows; 0: all)")),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``feeder`` command group (``feeder run``) to ``subparsers``."""
    verbs = add_group(subparsers, "feeder", help="feed tasks from a dataset into tasks.source",
                      dest="feeder_command", examples=_EXAMPLES[:1])
    r = add_command(
        verbs, "run",
        help="write Task records to <run>.tasks.source",
        description=(
            "Write Task records (keyed by prompt id) to the topology's tasks.source topic: "
            "synthetic arithmetic (--levels) or a local JSONL/Parquet file (--dataset), for "
            "--epochs passes in seeded order, at --rate tasks/s, at most --count tasks."
        ),
        examples=_EXAMPLES,
    )
    add_run_options(r)
    add_table(r, None, _FEEDING)
    add_table(r, "tasks", _TASKS)
    r.set_defaults(func=cmd_feeder_run)
    return subparsers.choices["feeder"]


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


def cmd_feeder_run(args: argparse.Namespace) -> int:
    from astraflow.config.topology import TopologyError, load_topology
    from astraflow.kafka.clients import RecordProducer
    from astraflow.tasks.datasets import DatasetError

    try:
        topo = getattr(args, "loaded_topology", None) or load_topology(args.topology)
        payloads = load_payloads(
            dataset=args.dataset,
            levels=args.levels,
            split=args.split,
            size=args.size,
            seed=args.seed,
            prompt_field=args.prompt_field,
            answer_field=args.answer_field,
            family=getattr(args, "task_family", "arithmetic"),
            messages_field=args.messages_field,
        )
    except (TopologyError, DatasetError, ValueError) as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if not payloads:
        print("astraflow: no tasks to feed", file=sys.stderr)
        return 2
    topic = topo.full_name(SOURCE_TOPIC)
    default_workflow, default_policies = TASK_FAMILIES[getattr(args, "task_family", "arithmetic")]
    policies = args.policy or list(default_policies)
    workflow = args.workflow or default_workflow
    stop = threading.Event()
    previous = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGINT):
            previous[sig] = signal.signal(sig, lambda *_: stop.set())
    config = topo.component_kafka("feeder").effective()
    producer = RecordProducer(config)
    tasks = iter_tasks(
        payloads,
        epochs=args.epochs or None,
        seed=args.seed,
        policies=policies,
        workflow=workflow,
        run=topo.run,
    )
    fed = set() if getattr(args, "from_start", False) else fed_task_ids(config, topic)
    if fed:
        print(f"resuming: {len(fed)} tasks already on {topic} are skipped", flush=True)
    feeder = TaskFeeder(producer, topic, resume_tasks(tasks, fed, args.count), rate=args.rate,
                        log=lambda m: print(m, flush=True))
    print(f"feeding {len(payloads)} distinct tasks to {topic}", flush=True)
    try:
        st = feeder.run(stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(json.dumps({"topic": topic, **st.as_dict()}), flush=True)
    return 0


