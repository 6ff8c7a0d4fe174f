"""Small helpers on trajectory groups shared by the data algorithms."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence
from dataclasses import replace

from astraflow.wire import records
from astraflow.wire.records import TrajectoryGroup

EASY = "easy"
HARD = "hard"
MIXED = "mixed"


def with_sequences(group: TrajectoryGroup,
                   seqs: list[records.Sequence]) -> TrajectoryGroup | None:
    """``group`` cut down to ``seqs`` (a subset of its sequences, in order) with their
    rewards; ``group`` itself when nothing was cut, None when nothing is left."""
    if not seqs:
        return None
    if len(seqs) == len(group.sequences):
        return group
    return replace(group, sequences=seqs, rewards=[s.reward for s in seqs])


def rewards_of(group: TrajectoryGroup, policy: str | None = None) -> list[float]:
    """The rewards of ``group``'s sequences (only ``policy``'s when given).

    Falls back to ``group.rewards`` for a group that carries no sequences.
    """
    if not group.sequences:
        return [] if policy is not None else list(group.rewards)
    return [s.reward for s in group.sequences if policy is None or s.policy == policy]


def all_equal(rewards: Sequence[float], tol: float = 1e-6) -> bool:
    """True when every reward is within ``tol`` of every other (also for 0 or 1 rewards)."""
    return not rewards or max(rewards) - min(rewards) <= tol


def classify(
    rewards: Sequence[float], easy_threshold: float = 1.0, tol: float = 1e-6, min_size: int = 2
) -> str | None:
    """``"easy"``, ``"hard"`` or ``"mixed"`` for a group's rewards; None when too small.

    A zero-variance group (all rewards equal within ``tol``) is *easy* when its common
    reward reaches ``easy_threshold`` (all correct), else *hard* (all wrong, or all equally
    partial: no learning signal either way). A group with fewer than ``min_size`` rewards
    says nothing about variance and is not classified.
    """
    if len(rewards) < min_size:
        return None
    if not all_equal(rewards, tol):
        return MIXED
    return EASY if min(rewards) >= easy_threshold - tol else HARD


def unit_hash(*parts: object) -> float:
    """A deterministic number in [0, 1) from ``parts`` (same inputs, same number).

    Processors draw their random decisions with it, keyed by the task, so a record that
    is redelivered after an aborted transaction gets the same decision again.
    """
    h = hashlib.blake2b(":".join(str(p) for p in parts).encode(), digest_size=8).digest()
    return int.from_bytes(h, "big") / 2.0**64


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean (0.0 for no values)."""
    vals = list(values)
    return sum(vals) / len(vals) if vals else 0.0
