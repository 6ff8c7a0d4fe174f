"""GRESO-style prompt selection: skip prompts that keep producing zero-variance groups.

A group whose rewards are all equal gives GRPO no learning signal. A prompt that produced
such a group ``k`` times in a row (its *streak*, "easy" when all samples were correct,
"hard" when all were wrong) is likely to do it again, so before rollout the task is
forwarded only with probability::

    submit(prompt) = max(min_submit_prob, base ** k)        base = p_easy or p_hard

and skipped otherwise (not forwarded; its offset commits like any other). A group with
reward variance resets the prompt's streak.

``p_easy`` and ``p_hard`` adapt so that the zero-variance ratios observed over a recent
window approach their targets: every ``adapt_every`` observations, a base whose ratio is
above its target steps down (skip more), one below steps up (explore more), by ``step``
(added, or multiplied with ``step_mode: multiplicative``), within ``[min_base, max_base]``.

Where observations come from: the groups on the retained ``trajectories`` topic, read by
a side reader from offset 0 when the processor opens, so the state after a restart equals
the state before it. To make that hold whatever order the topic's partitions are read in,
the state is a pure function of each partition's log: streaks are per prompt (the key of
``trajectories`` is the prompt id, so all groups of a prompt are in one partition), and
each partition has its own window and controller; the effective ``p_easy``/``p_hard`` are
the mean over the partitions seen so far (an exactly rounded sum: order-free too).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from astraflow.config.processors import GresoOptions
from astraflow.dataflow.base import Incoming, Outgoing
from astraflow.dataflow.follower import Observed, ObservingProcessor
from astraflow.dataflow.groups import EASY, HARD, MIXED, classify, rewards_of, unit_hash
from astraflow.wire.records import Task, TrajectoryGroup


@dataclass
class _Controller:
    """Window and bases of one partition of the observed topic."""

    p_easy: float
    p_hard: float
    window: deque[str]
    since_adapt: int = 0

    def ratio(self, kind: str) -> float:
        return self.window.count(kind) / len(self.window) if self.window else 0.0


@dataclass
class GresoSelector:
    """GRESO decision logic, free of Kafka: ``observe`` groups, ``decide`` on tasks."""

    options: GresoOptions = field(default_factory=GresoOptions)
    streaks: dict[str, tuple[str, int]] = field(default_factory=dict)  # prompt -> (kind, k)
    controllers: dict[int, _Controller] = field(default_factory=dict)  # per partition
    observed: int = 0

    def observe(self, group: TrajectoryGroup, partition: int = 0) -> str | None:
        """Learn from one produced group; returns its class (None: not classified)."""
        o = self.options
        kind = classify(rewards_of(group, o.policy), o.easy_threshold, o.tol, o.min_group_size)
        if kind is None:
            return None
        self.observed += 1
        if kind == MIXED:
            self.streaks.pop(group.prompt_id, None)
        else:
            prev, k = self.streaks.get(group.prompt_id, (kind, 0))
            self.streaks[group.prompt_id] = (kind, k + 1 if prev == kind else 1)
        c = self.controllers.get(partition)
        if c is None:
            c = self.controllers[partition] = _Controller(o.p_easy, o.p_hard,
                                                          deque(maxlen=o.window))
        c.window.append(kind)
        c.since_adapt += 1
        if c.since_adapt >= o.adapt_every:
            c.since_adapt = 0
            c.p_easy = self._step(c.p_easy, c.ratio(EASY), o.target_easy_ratio)
            c.p_hard = self._step(c.p_hard, c.ratio(HARD), o.target_hard_ratio)
        return kind

    def _step(self, p: float, ratio: float, target: float) -> float:
        o = self.options
        if ratio == target:
            return p
        up = ratio < target  # too few zero-variance groups of this kind: explore them more
        if o.step_mode == "additive":
            p = p + o.step if up else p - o.step
        else:
            p = p * (1 + o.step) if up else p / (1 + o.step)
        return min(o.max_base, max(o.min_base, p))

    @property
    def p_easy(self) -> float:
        """Effective base for easy streaks (mean over partitions)."""
        if not self.controllers:
            return self.options.p_easy
        return math.fsum(c.p_easy for c in self.controllers.values()) / len(self.controllers)

    @property
    def p_hard(self) -> float:
        """Effective base for hard streaks (mean over partitions)."""
        if not self.controllers:
            return self.options.p_hard
        return math.fsum(c.p_hard for c in self.controllers.values()) / len(self.controllers)

    def ratios(self) -> tuple[float, float]:
        """(easy, hard) zero-variance ratios over the windows of every partition."""
        total = sum(len(c.window) for c in self.controllers.values())
        if not total:
            return 0.0, 0.0
        easy = sum(c.window.count(EASY) for c in self.controllers.values())
        hard = sum(c.window.count(HARD) for c in self.controllers.values())
        return easy / total, hard / total

    def submit_probability(self, prompt_id: str) -> float:
        """Probability of forwarding a task of ``prompt_id`` now."""
        kind, k = self.streaks.get(prompt_id, (MIXED, 0))
        if k == 0:
            return 1.0
        base = self.p_easy if kind == EASY else self.p_hard
        return max(self.options.min_submit_prob, base**k)

    def streak(self, prompt_id: str) -> tuple[str, int]:
        """(kind, length) of the prompt's current zero-variance streak; (mixed, 0) if none."""
        return self.streaks.get(prompt_id, (MIXED, 0))

    def decide(self, task: Task) -> bool:
        """True to forward ``task``. Deterministic per (seed, task id, attempt)."""
        p = self.submit_probability(task.prompt_id)
        return p >= 1.0 or unit_hash(self.options.seed, task.task_id, task.attempt) < p

    def state(self) -> dict[str, Any]:
        """A comparable snapshot of everything learnt (equal after a rebuild)."""
        return {
            "observed": self.observed,
            "streaks": dict(sorted(self.streaks.items())),
            "controllers": {
                p: {"p_easy": round(c.p_easy, 12), "p_hard": round(c.p_hard, 12),
                    "window": list(c.window), "since_adapt": c.since_adapt}
                for p, c in sorted(self.controllers.items())
            },
        }


class Greso(ObservingProcessor):
    """GRESO prompt selection: skips tasks of prompts with zero-variance streaks."""

    kind = "greso"
    Options = GresoOptions

    def __init__(self, name, inputs, outputs, options=None, observations=None):
        super().__init__(name, inputs, outputs, options, observations)
        self.selector = GresoSelector(self.options)
        self.passed = 0
        self.skipped = {EASY: 0, HARD: 0}

    def observe(self, obs: Observed) -> None:
        if isinstance(obs.record, TrajectoryGroup):
            self.selector.observe(obs.record, obs.partition)

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.drain()
        task: Task = msg.record
        if not self.selector.decide(task):
            self.skipped[self.selector.streak(task.prompt_id)[0]] += 1
            return []
        self.passed += 1
        return [Outgoing(t, task, key=msg.key) for t in self.outputs]

    def flush(self, now_ms: int) -> Iterable[Outgoing]:
        self.drain()
        return ()

    def snapshot(self) -> dict[str, Any]:
        """Comparable snapshot of what was learnt (``GresoSelector.state``).

        Equal before and after a restart. Not named ``state``: that is the processor's
        status word (``Processor.state``).
        """
        return self.selector.state()

    def metrics(self) -> dict[str, float]:
        easy, hard = self.selector.ratios()
        return {
            "greso/passed": float(self.passed),
            "greso/skipped": float(sum(self.skipped.values())),
            "greso/skipped_easy": float(self.skipped[EASY]),
            "greso/skipped_hard": float(self.skipped[HARD]),
            "greso/p_easy": self.selector.p_easy,
            "greso/p_hard": self.selector.p_hard,
            "greso/easy_ratio": easy,
            "greso/hard_ratio": hard,
            "greso/observed": float(self.selector.observed),
            "greso/tracked_prompts": float(len(self.selector.streaks)),
        }
