"""Event time: processors that run over recorded topics judge each record as of its own time.

Live, a staleness filter compares a trajectory with the newest weight version published
*now*. Replaying a run's recorded trajectories later, "now" would be the end of the run and
every trajectory would look stale. As Kafka Streams joins a stream with a versioned table at
each record's timestamp, a replay gives its processors a ``StreamClock`` (set from each
input record's timestamp by the runtime) and a ``VersionsAtTime``: the newest version whose
manifest was recorded at or before the clock.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable


class StreamClock:
    """The time a processor runs at: ``now_ms`` is the timestamp of the record being
    processed (or, while emitting held records, the stream time); ``stream_ms`` the newest
    input timestamp seen so far."""

    __slots__ = ("now_ms", "stream_ms")

    def __init__(self) -> None:
        self.now_ms = 0
        self.stream_ms = 0

    def at_record(self, timestamp_ms: int) -> None:
        """Processing a record of this timestamp."""
        self.now_ms = timestamp_ms
        if timestamp_ms > self.stream_ms:
            self.stream_ms = timestamp_ms

    def at_stream(self) -> int:
        """Emitting what is due: the clock moves to the stream time, which it returns."""
        self.now_ms = self.stream_ms
        return self.stream_ms


class VersionsAtTime:
    """A ``VersionSource`` that answers as of ``clock.now_ms``: the highest version among
    the manifests recorded at or before it (``None`` before the first)."""

    def __init__(self, clock: StreamClock, history: dict[str, Iterable[tuple[int, int]]]):
        self.clock = clock
        self._times: dict[str, list[int]] = {}
        self._best: dict[str, list[int]] = {}  # running max of the versions, in time order
        for policy, points in history.items():
            times, best = [], []
            for ts, version in sorted(points):
                times.append(ts)
                best.append(max(version, best[-1]) if best else version)
            self._times[policy], self._best[policy] = times, best

    def refresh(self) -> None:
        pass

    def latest(self, policy: str) -> int | None:
        times = self._times.get(policy)
        if not times:
            return None
        i = bisect.bisect_right(times, self.clock.now_ms)
        return self._best[policy][i - 1] if i else None


__all__ = ["StreamClock", "VersionsAtTime"]
