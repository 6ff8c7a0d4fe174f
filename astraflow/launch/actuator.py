"""The actuator of ``astraflow up``: starts and stops RaaS nodes to follow ``ScalingAdvice``.

The ``autoscaler`` processor advises a pool size on ``scaling``; when the topology has one,
``up`` reads that topic and, for each new advice, starts nodes (``raas-<pool>-<i>`` with the
next free index) or stops the newest ones (SIGTERM: a node finishes its transaction and
leaves its group, whose partitions go to the others). Advice written before this ``up``
started is ignored: it was meant for processes that no longer run.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from astraflow.wire.records import ScalingAdvice


class Processes(Protocol):
    """What the actuator needs of ``up``'s supervisor."""

    procs: dict

    def add(self, name: str, cmd: list[str]) -> None: ...

    def retire(self, name: str) -> None: ...


class PoolActuator:
    """Follows advice for the pools it knows; ``command(pool, index)`` is a node's command
    line."""

    def __init__(self, pools: list[str], sup: Processes,
                 command: Callable[[str, int], list[str]],
                 log: Callable[[str], None] = print, since_ms: int | None = None):
        self.pools, self.sup, self.command, self.log = set(pools), sup, command, log
        self.since_ms = int(time.time() * 1000) if since_ms is None else since_ms
        self.followed: list[ScalingAdvice] = []

    def nodes(self, pool: str) -> list[int]:
        """Indexes of the pool's running nodes, in order."""
        prefix = f"raas-{pool}-"
        return sorted(int(n[len(prefix):]) for n in self.sup.procs
                      if n.startswith(prefix) and n[len(prefix):].isdigit())

    def follow(self, advice: ScalingAdvice) -> int:
        """Bring ``advice.pool`` to ``advice.target_size`` nodes; how many it started (>0)
        or stopped (<0)."""
        if advice.pool not in self.pools:
            self.log(f"autoscaler: advice for pool {advice.pool!r}, not one of "
                     f"{sorted(self.pools)}: ignored")
            return 0
        if advice.at_ms < self.since_ms:
            return 0
        live = self.nodes(advice.pool)
        target, before = max(0, advice.target_size), len(live)
        while len(live) < target:
            i = next(k for k in range(len(live) + 1) if k not in live)
            self.sup.add(f"raas-{advice.pool}-{i}", self.command(advice.pool, i))
            live.append(i)
            live.sort()
        while len(live) > target:
            self.sup.retire(f"raas-{advice.pool}-{live.pop()}")
        if target != before:
            self.followed.append(advice)
            self.log(f"autoscaler: pool {advice.pool} {before} -> {target} nodes "
                     f"({advice.reason})")
        return target - before


__all__ = ["PoolActuator", "Processes"]
