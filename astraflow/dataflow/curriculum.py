"""Curriculum: forward tasks with a probability that depends on how hard they are.

A stream cannot be reordered without holding it, so the curriculum *weights* tasks: each
task is forwarded with an acceptance probability and otherwise skipped (its offset
commits; the feeder's next epoch brings the prompt back). Two modes:

``by: pass_rate`` (the default)
    Each prompt's pass rate is estimated from its last ``history`` groups on the retained
    ``trajectories`` topic (a sample passes when its reward reaches ``success_threshold``).
    Tasks whose estimate lies in the target band ``[low, high]`` are forwarded with
    probability ``in_band_prob``, others with ``out_band_prob``; prompts with fewer than
    ``min_samples`` observed samples with ``unseen_prob``.

``by: level``
    The task's difficulty is ``level`` in its JSON payload. ``stages`` is a schedule: each
    stage holds ``weights`` (level -> acceptance probability; ``default_weight`` for
    levels not listed) and applies until ``until`` groups have been observed on
    ``trajectories`` (the last stage may leave ``until`` unset).

Both modes learn only from the retained topic, read from offset 0 on open, so a restart
rebuilds the same estimates and the same stage. Decisions are drawn with a hash of
(seed, task id, attempt): a redelivered task gets the same decision.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from astraflow.config.processors import CurriculumOptions, Stage
from astraflow.dataflow.base import Incoming, Outgoing
from astraflow.dataflow.follower import Observed, ObservingProcessor
from astraflow.dataflow.groups import rewards_of, unit_hash
from astraflow.wire.records import Task, TrajectoryGroup


def level_of(task: Task) -> int | None:
    """``level`` from the task's JSON payload; None when absent or unreadable."""
    try:
        level = json.loads(task.payload).get("level")
    except (ValueError, AttributeError):
        return None
    return int(level) if isinstance(level, (int, float)) else None


@dataclass
class CurriculumPolicy:
    """Curriculum decision logic, free of Kafka."""

    options: CurriculumOptions = field(default_factory=CurriculumOptions)
    outcomes: dict[str, deque[tuple[int, int]]] = field(default_factory=dict)  # (passed, n)
    observed: int = 0

    def observe(self, group: TrajectoryGroup) -> None:
        """Record one produced group's passes."""
        rewards = rewards_of(group, self.options.policy)
        if not rewards:
            return
        self.observed += 1
        passed = sum(r >= self.options.success_threshold for r in rewards)
        hist = self.outcomes.setdefault(group.prompt_id, deque(maxlen=self.options.history))
        hist.append((passed, len(rewards)))

    def pass_rate(self, prompt_id: str) -> float | None:
        """Estimated pass rate of a prompt; None below ``min_samples`` observed samples."""
        hist = self.outcomes.get(prompt_id)
        n = sum(h[1] for h in hist) if hist else 0
        if n < self.options.min_samples:
            return None
        return sum(h[0] for h in hist) / n

    def stage_index(self) -> int | None:
        """Index of the level stage in force after ``observed`` groups (last one past the end)."""
        stages = self.options.stages
        for i, s in enumerate(stages):
            if s.until is None or self.observed < s.until:
                return i
        return len(stages) - 1 if stages else None

    def stage(self) -> Stage | None:
        """The level stage in force (see ``stage_index``)."""
        i = self.stage_index()
        return None if i is None else self.options.stages[i]

    def accept_probability(self, task: Task) -> float:
        """Probability of forwarding ``task`` now."""
        o = self.options
        if o.by == "level":
            stage = self.stage()
            level = level_of(task)
            if stage is None or level is None:
                return o.default_weight
            return stage.weights.get(level, o.default_weight)
        rate = self.pass_rate(task.prompt_id)
        if rate is None:
            return o.unseen_prob
        return o.in_band_prob if o.low <= rate <= o.high else o.out_band_prob

    def decide(self, task: Task) -> bool:
        """True to forward ``task``; deterministic per (seed, task id, attempt)."""
        p = self.accept_probability(task)
        return p >= 1.0 or unit_hash(self.options.seed, "curriculum", task.task_id,
                                     task.attempt) < p

    def state(self) -> dict[str, Any]:
        """A comparable snapshot of everything learnt."""
        return {"observed": self.observed,
                "outcomes": {k: list(v) for k, v in sorted(self.outcomes.items())}}


class Curriculum(ObservingProcessor):
    """Curriculum: forwards tasks by estimated pass rate or by a level schedule."""

    kind = "curriculum"
    Options = CurriculumOptions

    def __init__(self, name, inputs, outputs, options=None, observations=None):
        super().__init__(name, inputs, outputs, options, observations)
        self.policy = CurriculumPolicy(self.options)
        self.passed = 0
        self.skipped = 0

    def observe(self, obs: Observed) -> None:
        if isinstance(obs.record, TrajectoryGroup):
            self.policy.observe(obs.record)

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.drain()
        if not self.policy.decide(msg.record):
            self.skipped += 1
            return []
        self.passed += 1
        return [Outgoing(t, msg.record, key=msg.key) for t in self.outputs]

    def flush(self, now_ms: int) -> Iterable[Outgoing]:
        self.drain()
        return ()

    def snapshot(self) -> dict[str, Any]:
        """Comparable snapshot of what was learnt (``CurriculumPolicy.state``)."""
        return self.policy.state()

    def metrics(self) -> dict[str, float]:
        stage = self.policy.stage_index()
        return {
            "curriculum/passed": float(self.passed),
            "curriculum/skipped": float(self.skipped),
            "curriculum/observed": float(self.policy.observed),
            "curriculum/tracked_prompts": float(len(self.policy.outcomes)),
            "curriculum/stage": float(stage) if stage is not None else -1.0,
        }
