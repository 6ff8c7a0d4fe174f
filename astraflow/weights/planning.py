"""Update plans: which manifests a reader applies, in order, to go from the version it
holds to the one it wants.

Every published version has a ``WeightManifest``. Version 0, and every version that is a
multiple of the anchor interval N, has a full checkpoint; every other version has a delta
against its predecessor. Anchors (other than the first) also get a delta, so a reader one
version behind never has to take the full checkpoint: for the same version there are then
two manifests, one ``full`` and one ``delta``.

A reader holding version h that wants version t asks ``plan_update`` for the cheapest
chain (fewest bytes, then fewest steps): deltas from h, or the best full checkpoint at or
below t followed by deltas. It fetches and verifies every blob of that plan before
applying any; a blob that is missing or fails its sha256 removes its manifest from
consideration and the plan is recomputed (``WeightFollower.update``, ``weights.follower``).
"""

from __future__ import annotations

import heapq
from collections.abc import Collection, Iterable, Sequence

from astraflow.weights.errors import NoPlanError
from astraflow.weights.manifests import ManifestKey, manifest_key
from astraflow.wire.records import WeightManifest


def _cost(m: WeightManifest) -> int:
    return m.encoded_bytes if m.encoded_bytes > 0 else sum(b.bytes for b in m.blobs)


def plan_update(
    held_version: int | None,
    target_version: int,
    manifests: Iterable[WeightManifest],
    *,
    exclude: Collection[ManifestKey] = (),
) -> list[WeightManifest]:
    """Cheapest list of manifests to apply, in order, to go from ``held_version`` to
    ``target_version``.

    ``held_version`` None means nothing is held (the plan starts with a full checkpoint).
    Cost is total blob bytes, then the number of manifests. Deltas are only used forward
    (base < version <= target); a reader ahead of the target gets a full checkpoint.
    Manifests whose key is in ``exclude`` are ignored. Raises ``NoPlanError``.
    """
    if held_version is not None and held_version == target_version:
        return []
    best = _cheapest_routes(held_version, target_version, manifests, exclude)
    if target_version not in best:
        held = "nothing" if held_version is None else f"version {held_version}"
        raise NoPlanError(f"no usable manifests lead from {held} to version {target_version}")
    plan: list[WeightManifest] = []
    v: int | None = target_version
    while v is not None:
        _, _, m, prev = best[v]
        if m is None:
            break
        plan.append(m)
        v = prev
    plan.reverse()
    return plan


# version -> (bytes, manifests, the last manifest applied, the version it starts from)
_Route = tuple[int, int, WeightManifest | None, int | None]


def _cheapest_routes(held_version: int | None, target_version: int,
                     manifests: Iterable[WeightManifest],
                     exclude: Collection[ManifestKey]) -> dict[int, _Route]:
    """The cheapest way to reach each version up to ``target_version`` (``plan_update``)."""
    best: dict[int, _Route] = {}
    deltas: dict[int, list[WeightManifest]] = {}
    for m in manifests:
        if m.version > target_version or manifest_key(m) in exclude:
            continue
        if m.kind == "full":
            cand = (_cost(m), 1, m, None)
            if m.version not in best or cand[:2] < best[m.version][:2]:
                best[m.version] = cand
        elif m.kind == "delta" and m.base_version is not None and m.base_version < m.version:
            deltas.setdefault(m.base_version, []).append(m)
    if held_version is not None and held_version <= target_version:
        best[held_version] = (0, 0, None, None)
    # Every delta goes to a higher version and full checkpoints start from anywhere, so
    # taking versions in increasing order settles each one before it is used.
    heap = sorted(set(best) | set(deltas))
    seen: set[int] = set()
    while heap:
        v = heapq.heappop(heap)
        if v in seen:
            continue
        seen.add(v)
        if v not in best:
            continue
        cost, hops = best[v][:2]
        for d in deltas.get(v, ()):
            cand = (cost + _cost(d), hops + 1, d, v)
            cur = best.get(d.version)
            if cur is None or cand[:2] < cur[:2]:
                best[d.version] = cand
                heapq.heappush(heap, d.version)
    return best


def plan_bytes(plan: Sequence[WeightManifest]) -> int:
    """Total blob bytes a plan fetches."""
    return sum(_cost(m) for m in plan)
