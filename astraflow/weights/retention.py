"""Retention and garbage collection of a policy's blobs: which manifests to keep so the
newest versions stay reachable (``retained_manifests``), and removing the blobs no kept
manifest names (``collect_garbage``; ``astraflow weights gc``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from astraflow.weights.stores.base import BlobStore, blob_id_of
from astraflow.wire.records import BlobRef, WeightManifest, now_ms


def retained_manifests(
    manifests: Iterable[WeightManifest], keep_last: int | None = None
) -> list[WeightManifest]:
    """The manifests to keep so that each of the newest ``keep_last`` versions stays
    reachable from a full checkpoint: everything from the newest full checkpoint at or
    below the oldest kept version on (all of them when ``keep_last`` is None, or when no
    such checkpoint exists)."""
    ms = list(manifests)
    if keep_last is None or not ms:
        return ms
    if keep_last < 1:
        raise ValueError("keep_last must be at least 1")
    versions = sorted({m.version for m in ms})
    oldest = versions[-keep_last] if len(versions) >= keep_last else versions[0]
    fulls = [m.version for m in ms if m.kind == "full" and m.version <= oldest]
    if not fulls:
        return ms
    start = max(fulls)
    return [m for m in ms if m.version >= start]


@dataclass
class GcResult:
    """Outcome of ``collect_garbage``."""

    removed: list[str] = field(default_factory=list)
    unreachable: list[str] = field(default_factory=list)
    reachable: int = 0
    too_young: list[str] = field(default_factory=list)
    truncated: dict[int, int] = field(default_factory=dict)
    can_delete: bool = True


def collect_garbage(
    store: BlobStore,
    retained: Iterable[WeightManifest],
    *,
    min_age_s: float = 3600.0,
    dry_run: bool = False,
    kafka_truncate: bool = False,
) -> GcResult:
    """Remove blobs that no retained manifest references.

    Blobs younger than ``min_age_s`` are spared (their manifest may not be published yet).
    A file store deletes them (unless ``dry_run``). A Kafka store cannot delete single
    records: the blobs are reported in ``unreachable`` and ``can_delete`` is False; with
    ``kafka_truncate`` the records before the oldest blob still needed are deleted per
    partition (``DeleteRecords``).
    """
    reachable = {blob_id_of(ref) for m in retained for ref in m.blobs}
    now = now_ms()
    result = GcResult(reachable=len(reachable))
    keep = set(reachable)
    for blob in store.list():
        if blob.blob_id in reachable:
            continue
        if now - blob.created_at_ms < min_age_s * 1000:
            result.too_young.append(blob.blob_id)
            keep.add(blob.blob_id)
            continue
        result.unreachable.append(blob.blob_id)
    from astraflow.weights.stores import FileBlobStore

    if isinstance(store, FileBlobStore):
        if not dry_run:
            for b in result.unreachable:
                if store.delete(BlobRef(uri=store.ref_uri(b), bytes=0, sha256="")):
                    result.removed.append(b)
            store.remove_stale_temporaries(min_age_s)
    else:
        result.can_delete = False
        truncate = getattr(store, "truncate_before", None)
        if kafka_truncate and truncate is not None and not dry_run:
            result.truncated = truncate(keep)
            still = {b.blob_id for b in store.list()}
            result.removed = [b for b in result.unreachable if b not in still]
    return result
