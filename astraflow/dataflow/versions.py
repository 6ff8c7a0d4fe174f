"""The latest published weight version of each policy, read from ``weights.<policy>``."""

from __future__ import annotations

from typing import Protocol

from astraflow.kafka.table import TopicTable
from astraflow.wire.records import WeightManifest


class VersionSource(Protocol):
    """Anything that knows the latest published version per policy."""

    def refresh(self) -> object: ...

    def latest(self, policy: str) -> int | None: ...


def newer(old: WeightManifest, new: WeightManifest) -> WeightManifest:
    """The manifest of the higher version (the old one on a tie)."""
    return new if new.version > old.version else old


class LatestVersions:
    """Follows every partition of the given ``weights.<policy>`` topics without a group.

    Every copy of a processor reads the whole weights topics (they are small: manifests
    only): one ``TopicTable`` per policy, keyed by the policy and keeping the manifest of
    the highest version; ``refresh`` takes in what has arrived without blocking.
    """

    def __init__(self, config, codec, topics: dict[str, str]):
        self.tables: dict[str, TopicTable[str, WeightManifest]] = {}
        try:
            for policy, topic in topics.items():
                self.tables[policy] = TopicTable.open(
                    config, topic, WeightManifest, codec=codec, reduce=newer,
                    key=lambda _e, p=policy: p, client_id="versions")
        except BaseException:
            self.close()
            raise

    def refresh(self, timeout: float = 0.0) -> int:
        """Take in what has arrived; how many policies got a newer version."""
        return sum(t.poll(timeout) for t in self.tables.values())

    def latest(self, policy: str) -> int | None:
        """The highest version published for ``policy`` (None: none yet)."""
        manifest = self.manifest(policy)
        return manifest.version if manifest is not None else None

    def manifest(self, policy: str) -> WeightManifest | None:
        """The manifest of the highest version published for ``policy`` (None: none yet)."""
        table = self.tables.get(policy)
        return table.get(policy) if table is not None else None

    def close(self) -> None:
        """Close the readers."""
        for t in self.tables.values():
            t.close()


class StaticVersions:
    """A fixed table of versions (for decision-logic tests and offline replays)."""

    def __init__(self, versions: dict[str, int] | None = None):
        self.versions = dict(versions or {})

    def refresh(self) -> None:
        pass

    def latest(self, policy: str) -> int | None:
        return self.versions.get(policy)


def known_versions(source: VersionSource | None, policies: list[str]) -> dict[str, int]:
    """Policy -> newest version ``source`` knows, for those it knows one of."""
    if source is None:
        return {}
    out = {}
    for p in policies:
        v = source.latest(p)
        if v is not None:
            out[p] = v
    return out
