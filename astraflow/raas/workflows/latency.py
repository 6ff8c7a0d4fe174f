"""A simulated environment's delay, for workflows that mimic slow tools or environments."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Iterable, Mapping
from typing import Any

from pydantic import PrivateAttr

from astraflow.config.options import LatencyOptions


class Latency(LatencyOptions):
    """A seeded, possibly long-tailed delay: the options of ``LatencyOptions`` (their
    defaults and checks), drawn.

    ``per_task``: a task's delay is a function of ``seed`` and the task's key (its id) alone,
    drawn from its own generator (``for_task``), so the same task waits the same in every
    run, on every node and in every mode of a benchmark; otherwise draws come one after
    another from one generator seeded with ``seed`` (``draw``).
    """

    _rng: random.Random = PrivateAttr()

    def model_post_init(self, context: Any) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def from_option(cls, value: float | LatencyOptions | Mapping[str, Any] | None
                    ) -> Latency | None:
        """A ``Latency`` from a workflow option: seconds (constant), the options (or a
        mapping of them), or None (no delay)."""
        if value is None or isinstance(value, Latency):
            return value
        if isinstance(value, int | float):
            return cls(dist="const", median_s=float(value))
        if isinstance(value, LatencyOptions):
            return cls(**value.model_dump())
        if isinstance(value, Mapping):
            return cls(**value)
        raise ValueError(f"latency must be seconds or a mapping, not {value!r}")

    def _sample(self, rng: random.Random) -> float:
        if self.dist == "const":
            s = self.median_s
        elif self.dist == "lognormal":
            s = rng.lognormvariate(math.log(max(self.median_s, 1e-9)), self.sigma)
        else:
            s = self.scale_s * rng.paretovariate(self.alpha)
        return min(max(s, 0.0), self.max_s)

    def draw(self) -> float:
        """The next delay of the shared generator (seconds)."""
        return self._sample(self._rng)

    def for_task(self, key: str) -> float:
        """The delay of the task ``key``: with ``per_task`` a function of (``seed``, ``key``)
        only, else the next ``draw()``."""
        if not self.per_task:
            return self.draw()
        return self._sample(random.Random(f"latency:{self.seed}:{key}"))

    def wait_longest(self, keys: Iterable[str]) -> float:
        """Sleep as long as the slowest of the tasks ``keys`` (their environments run side
        by side); the seconds slept (0 with no keys)."""
        seconds = max((self.for_task(k) for k in keys), default=0.0)
        if seconds > 0:
            time.sleep(seconds)
        return seconds


__all__ = ["Latency"]
