"""Semantic checks of decoded records: a record that decodes but makes no sense.

Avro guarantees the types, not the meaning: a sequence whose token ids, loss mask,
log-probs and versions differ in length, a NaN reward, a positive log-probability, an
empty group or batch. ``check_record`` raises ``InvalidRecord`` with the reason, so the
first component that reads such a record (processor runtime, RaaS node, trainer) sends it
to the dead-letter topic instead of passing it on or crashing on it over and over.
"""

from __future__ import annotations

import math

from astraflow.wire.records import Batch, Record, Sequence, Task, TrajectoryGroup


class InvalidRecord(Exception):
    """A record that decodes but must not pass (raised by these checks and by a
    processor's ``process``); it goes to the dead-letter topic with the reason."""


def sequence_problem(s: Sequence) -> str | None:
    """What is wrong with one sequence, or None."""
    n = len(s.token_ids)
    if n == 0:
        return "no token ids"
    if not len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n:
        return (f"token_ids ({n}), loss_mask ({len(s.loss_mask)}), logprobs "
                f"({len(s.logprobs)}) and versions ({len(s.versions)}) differ in length")
    if not math.isfinite(s.reward):
        return f"reward is {s.reward}"
    if any(t < 0 for t in s.token_ids):
        return "a negative token id"
    if any(m not in (0, 1) for m in s.loss_mask):
        return "loss_mask values other than 0 and 1"
    if any(not math.isfinite(lp) or lp > 1e-6 for lp in s.logprobs):
        return "a log-probability that is not finite or is above 0"
    if any(v < -1 for v in s.versions):
        return "a version below -1"
    if any(m and v < 0 for m, v in zip(s.loss_mask, s.versions)):
        return "a trained token (loss_mask 1) without the version that generated it"
    return None


def group_problem(g: TrajectoryGroup) -> str | None:
    """What is wrong with a trajectory group, or None."""
    if not g.sequences:
        return "an empty group (no sequences)"
    if len(g.rewards) != len(g.sequences):
        return f"{len(g.rewards)} rewards for {len(g.sequences)} sequences"
    for i, s in enumerate(g.sequences):
        why = sequence_problem(s)
        if why:
            return f"sequence {i}: {why}"
    if any(not math.isfinite(r) for r in g.rewards):
        return "a reward that is not finite"
    return None


def batch_problem(b: Batch) -> str | None:
    """What is wrong with a batch, or None."""
    if not b.groups:
        return "an empty batch (no groups)"
    for g in b.groups:
        why = group_problem(g)
        if why:
            return f"group {g.group_id}: {why}"
    return None


def task_problem(t: Task) -> str | None:
    """What is wrong with a task, or None."""
    if not t.task_id or not t.workflow:
        return "a task needs a task_id and a workflow"
    return None


_CHECKS = {Batch: batch_problem, TrajectoryGroup: group_problem, Task: task_problem,
           Sequence: sequence_problem}


def problem_finder(cls: type[Record]):
    """The function that says what is wrong with a ``cls`` record (or None), or None when
    records of ``cls`` are not checked beyond their schema."""
    return _CHECKS.get(cls)


def check_record(record: Record) -> None:
    """Raise ``InvalidRecord`` naming what is wrong with ``record`` (types it knows)."""
    check = _CHECKS.get(type(record))
    why = check(record) if check else None  # type: ignore[operator]
    if why:
        raise InvalidRecord(f"{type(record).__name__}: {why}")


__all__ = ["batch_problem", "check_record", "problem_finder", "group_problem", "sequence_problem",
           "task_problem"]
