"""A simulated environment's delay, for workflows that mimic slow tools or environments."""

from __future__ import annotations

import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass
class Latency:
    """A seeded, possibly long-tailed delay: ``const``, ``lognormal`` or ``pareto``.

    ``lognormal``: median ``median_s``, shape ``sigma``. ``pareto``: minimum ``scale_s``,
    tail index ``alpha`` (smaller: heavier tail). Every draw is capped at ``max_s``.
    """

    dist: str = "lognormal"
    median_s: float = 0.05
    sigma: float = 1.0
    scale_s: float = 0.02
    alpha: float = 1.5
    max_s: float = 30.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.dist not in ("const", "lognormal", "pareto"):
            raise ValueError(f"latency dist must be const, lognormal or pareto, not {self.dist!r}")
        self._rng = random.Random(self.seed)

    @classmethod
    def from_option(cls, value: Any) -> Latency | None:
        if value is None or isinstance(value, Latency):
            return value
        if isinstance(value, int | float):
            return cls(dist="const", median_s=float(value))
        if isinstance(value, Mapping):
            return cls(**value)
        raise ValueError(f"latency must be seconds or a mapping, not {value!r}")

    def draw(self) -> float:
        if self.dist == "const":
            s = self.median_s
        elif self.dist == "lognormal":
            s = self._rng.lognormvariate(math.log(max(self.median_s, 1e-9)), self.sigma)
        else:
            s = self.scale_s * self._rng.paretovariate(self.alpha)
        return min(max(s, 0.0), self.max_s)


__all__ = ["Latency"]
