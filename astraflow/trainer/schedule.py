"""The learning rate of each trainer step: a linear warm-up, then constant or a decay.

The rate is a pure function of the number of batches already trained (``Trainer.steps``),
which a resumed trainer restores with its state, so a restart continues the schedule
exactly where the crashed process left it. Every optimizer step of one batch
(``minibatches``) takes that batch's rate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

DECAYS = ("constant", "linear", "cosine")


@dataclass(frozen=True)
class LrSchedule:
    """``lr`` after ``warmup_steps`` batches that rise to it linearly (the first at
    ``lr / warmup_steps``), then ``decay``: ``constant`` keeps it; ``linear`` and
    ``cosine`` take it to ``final`` over ``decay_steps`` batches and hold it there."""

    lr: float
    warmup_steps: int = 0
    decay: str = "constant"
    final: float = 0.0
    decay_steps: int | None = None

    def __post_init__(self) -> None:
        if self.decay not in DECAYS:
            raise ValueError(f"lr_decay: {self.decay!r} is not one of {', '.join(DECAYS)}")
        if self.decay != "constant" and not self.decay_steps:
            raise ValueError(f"lr_decay_steps: lr_decay {self.decay} needs the number of "
                             "steps it takes (at least 1)")

    def at(self, step: int) -> float:
        """The rate of the batch trained after ``step`` others (0: the first one)."""
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.decay == "constant":
            return self.lr
        assert self.decay_steps is not None  # __post_init__
        done = min(1.0, (step - self.warmup_steps) / self.decay_steps)
        if self.decay == "linear":
            return self.lr + (self.final - self.lr) * done
        return self.final + (self.lr - self.final) * 0.5 * (1.0 + math.cos(math.pi * done))
