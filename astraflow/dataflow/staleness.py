"""Drops trajectories generated with weights too far behind the latest published version.

A sequence's tokens may come from several versions (a node that takes new weights between
an episode's calls or between chunks of one generation records each token's version): the
bound is judged on the oldest token, so it holds for every token trained; how old the
tokens are one by one is reported as ``staleness/token_lag_mean`` and ``_max``.
"""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.config.processors import StalenessOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor, ProcessorContext, SideAccess
from astraflow.dataflow.versions import LatestVersions, VersionSource, known_versions
from astraflow.kafka.config import TABLE_GROUP
from astraflow.metrics import observe_staleness
from astraflow.wire.records import TrajectoryGroup


def staleness(group: TrajectoryGroup, versions: VersionSource) -> int:
    """Versions between the oldest generated token of ``group`` and its policy's latest.

    The worst over the group's sequences; 0 when no version is published yet.
    """
    worst = 0
    for seq in group.sequences:
        latest = versions.latest(seq.policy)
        oldest = seq.min_version
        if latest is None or oldest < 0:
            continue
        worst = max(worst, latest - oldest)
    return worst


def token_lags(group: TrajectoryGroup, versions: VersionSource) -> list[int]:
    """Versions between each generated token of ``group`` and its policy's latest (tokens
    of a policy with no version published yet are left out)."""
    lags = []
    for seq in group.sequences:
        latest = versions.latest(seq.policy)
        if latest is not None:
            lags.extend(latest - v for v in seq.versions if v >= 0)
    return lags


class StalenessFilter(Processor):
    """Passes a group unless its oldest token is more than ``max_staleness`` versions old."""

    kind = "staleness_filter"
    Options = StalenessOptions

    def __init__(self, name, inputs, outputs, options=None, versions: VersionSource | None = None):
        super().__init__(name, inputs, outputs, options)
        self.versions = versions
        self.passed = 0
        self.dropped = 0
        self.max_seen = 0
        self.tokens_seen = 0  # generated tokens of the groups judged, and their lags
        self.token_lag_sum = 0
        self.token_lag_max = 0

    def open(self, context: ProcessorContext) -> None:
        if self.versions is None:
            topo = context.topology
            self.versions = LatestVersions(context.config, context.codec, {
                p: topo.full_name(f"weights.{p}") for p in self.options.policies})

    def close(self) -> None:
        if isinstance(self.versions, LatestVersions):
            self.versions.close()

    def side_access(self, topology) -> SideAccess:
        """It follows ``weights.<policy>`` of its policies (``LatestVersions``)."""
        return SideAccess(reads=tuple(f"weights.{p}" for p in self.options.policies),
                          reader_groups=(TABLE_GROUP,))

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        self.versions.refresh()
        lag = staleness(msg.record, self.versions)
        observe_staleness(lag)
        lags = token_lags(msg.record, self.versions)
        self.tokens_seen += len(lags)
        self.token_lag_sum += sum(lags)
        self.token_lag_max = max(self.token_lag_max, *lags) if lags else self.token_lag_max
        self.max_seen = max(self.max_seen, lag)
        if lag > self.options.max_staleness:
            self.dropped += 1
            return []
        self.passed += 1
        return [Outgoing(t, msg.record, key=msg.key) for t in self.outputs]

    def weight_versions(self) -> dict[str, int]:
        return known_versions(self.versions, self.options.policies)

    def metrics(self) -> dict[str, float]:
        return {"staleness/passed": float(self.passed), "staleness/dropped": float(self.dropped),
                "staleness/max_seen": float(self.max_seen),
                "staleness/token_lag_mean": (self.token_lag_sum / self.tokens_seen
                                             if self.tokens_seen else 0.0),
                "staleness/token_lag_max": float(self.token_lag_max)}
