"""Versioned weights: manifests, update plans, publishing, following, retention and GC.

Every published version has a ``WeightManifest``. Version 0, and every version that is a
multiple of the anchor interval N, has a full checkpoint; every other version has a delta
against its predecessor. Anchors (other than the first) also get a delta, so a reader one
version behind never has to take the full checkpoint: for the same version there are then
two manifests, one ``full`` and one ``delta``.

A reader holding version h that wants version t asks ``plan_update`` for the cheapest
chain (fewest bytes, then fewest steps): deltas from h, or the best full checkpoint at or
below t followed by deltas. It fetches and verifies every blob of that plan before
applying any; a blob that is missing or fails its sha256 removes its manifest from
consideration and the plan is recomputed (``WeightFollower.update``).
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import tempfile
import time
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from astraflow.weights.delta import (
    CODEC_NAME,
    DEFAULT_LEVEL,
    DEFAULT_SEGMENT_ELEMS,
    EncodeStats,
    StateDict,
    apply_blob,
    default_threads,
    dtype_name,
    iter_encode_delta,
    iter_encode_full,
)
from astraflow.weights.errors import (
    BaseMismatchError,
    BlobError,
    ManifestSignatureError,
    NoPlanError,
    WeightsError,
)
from astraflow.weights.stores import StoreResolver
from astraflow.weights.stores.base import BlobStore, blob_id_of, new_blob_id
from astraflow.wire.records import BlobRef, PartitionOffset, TensorInfo, WeightManifest, now_ms

if TYPE_CHECKING:
    from astraflow.kafka.config import KafkaConfig
    from astraflow.weights.signing import ManifestVerifier

log = logging.getLogger(__name__)

ManifestKey = tuple[int, str, int | None, tuple[str, ...]]


def manifest_key(m: WeightManifest) -> ManifestKey:
    """Identity of a manifest: (version, kind, base version, blob uris)."""
    return (m.version, m.kind, m.base_version, tuple(b.uri for b in m.blobs))


def _cost(m: WeightManifest) -> int:
    return m.encoded_bytes if m.encoded_bytes > 0 else sum(b.bytes for b in m.blobs)


# --------------------------------------------------------------------------- planning


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


# --------------------------------------------------------------------------- publishing


def _tensor_infos(state: StateDict) -> list[TensorInfo]:
    return [TensorInfo(name, list(t.shape), dtype_name(t.dtype)) for name, t in state.items()]


def _common_dtype(state: StateDict) -> str:
    names = {dtype_name(t.dtype) for t in state.values()}
    return names.pop() if len(names) == 1 else "mixed"


class WeightPublisher:
    """Turns successive state dicts of one policy into blobs and manifests.

    ``publish`` writes the blob(s) of the next version to ``store`` and returns the
    manifests, in order; it does not send them anywhere (the trainer produces them on
    ``weights.<policy>`` in the same transaction as its offset commit). The publisher keeps
    a CPU copy of the last published state to compute the next delta (one model copy).

    To resume after a restart pass ``version`` (the last published version) and ``state``
    (its weights); without them the first publish is a full checkpoint.
    """

    def __init__(
        self,
        store: BlobStore,
        policy: str,
        *,
        anchor_interval: int = 10,
        delta_at_anchors: bool = True,
        threads: int | None = None,
        level: int = DEFAULT_LEVEL,
        compress_full: bool = True,
        segment_elems: int = DEFAULT_SEGMENT_ELEMS,
        version: int | None = None,
        state: StateDict | None = None,
    ):
        if (version is None) != (state is None):
            raise ValueError("pass both version and state to resume, or neither")
        self.store = store
        self.policy = policy
        self.anchor_interval = anchor_interval
        self.delta_at_anchors = delta_at_anchors
        self.threads = threads or default_threads()
        self.level = level
        self.compress_full = compress_full
        self.segment_elems = segment_elems
        self.version = version
        self._prev: dict[str, torch.Tensor] | None = None
        if state is not None:
            self._remember(state)

    def is_anchor(self, version: int) -> bool:
        """True when ``version`` gets a full checkpoint."""
        if self._prev is None or version == 0:
            return True
        return self.anchor_interval > 0 and version % self.anchor_interval == 0

    def _remember(self, state: StateDict) -> None:
        prev = self._prev
        if (
            prev is not None
            and prev.keys() == state.keys()
            and all(prev[k].shape == t.shape and prev[k].dtype == t.dtype for k, t in state.items())
        ):
            for k, t in state.items():
                prev[k].copy_(t.detach())
        else:
            self._prev = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}

    def publish(
        self,
        state: StateDict,
        *,
        version: int | None = None,
        trainer_step: int = 0,
        consumed_offsets: Sequence[PartitionOffset] = (),
        meta: Mapping[str, str] | None = None,
    ) -> list[WeightManifest]:
        """Write the next version's blobs; return its manifests (delta first, then full)."""
        v = (0 if self.version is None else self.version + 1) if version is None else version
        if self.version is not None and v <= self.version:
            raise ValueError(f"version {v} is not after the last published {self.version}")
        common = dict(
            policy=self.policy,
            version=v,
            dtype=_common_dtype(state),
            tensors=_tensor_infos(state),
            trainer_step=trainer_step,
            consumed_offsets=list(consumed_offsets),
            codec=CODEC_NAME,
            meta={**{str(k): str(x) for k, x in (meta or {}).items()},
                  "anchor_interval": str(self.anchor_interval)},
        )
        opts = dict(threads=self.threads, level=self.level, segment_elems=self.segment_elems)
        out: list[WeightManifest] = []
        anchor = self.is_anchor(v)
        changed: int | None = None
        if self._prev is not None and (not anchor or self.delta_at_anchors):
            base = self.version
            ds = EncodeStats("delta")
            blob_meta = {"policy": self.policy, "version": str(v), "base_version": str(base)}
            pieces = iter_encode_delta(self._prev, state, meta=blob_meta, stats=ds, **opts)
            out.append(self._write("delta", pieces, ds, base, common))
            changed = ds.num_changed
        if anchor:
            fs = EncodeStats("full")
            blob_meta = {"policy": self.policy, "version": str(v)}
            pieces = iter_encode_full(
                state, compress=self.compress_full, meta=blob_meta, stats=fs, **opts
            )
            m = self._write("full", pieces, fs, None, common)
            # changed elements against the previous version when known, else all of them
            m.num_changed = m.num_params if changed is None else changed
            m.sparsity = 1.0 - m.num_changed / m.num_params if m.num_params else 1.0
            out.append(m)
        self._remember(state)
        self.version = v
        return out

    def _write(self, kind: str, pieces: Any, stats: EncodeStats, base: int | None,
               common: dict[str, Any]) -> WeightManifest:
        """Store one encoded blob of ``kind``; its manifest (``common`` fields included)."""
        ref = self.store.put(new_blob_id(self.policy, common["version"], kind), pieces)
        n, changed = stats.num_params, stats.num_changed  # filled in while it was stored
        return WeightManifest(
            base_version=base,
            kind=kind,
            blobs=[ref],
            num_params=n,
            num_changed=changed,
            sparsity=1.0 - changed / n if n else 1.0,
            encoded_bytes=ref.bytes,
            **{**common, "meta": {**common["meta"], "encode_s": f"{stats.seconds:.3f}"}},
        )


# --------------------------------------------------------------------------- following


@dataclass
class UpdateResult:
    """What ``WeightFollower.update`` did."""

    from_version: int | None
    version: int | None
    applied: list[WeightManifest] = field(default_factory=list)
    bytes_fetched: int = 0
    failures: list[tuple[WeightManifest, str]] = field(default_factory=list)
    seconds: float = 0.0


class WeightFollower:
    """Keeps a state dict at the newest (or a chosen) version of one policy.

    Feed it every manifest seen on ``weights.<policy>`` with ``observe``; ``update`` plans
    from the held version, fetches and verifies all blobs of the plan, then applies them.
    A blob that is missing or corrupt excludes its manifest and the plan is recomputed; a
    delta that does not match the held state (``BaseMismatchError``) makes the follower
    forget its version and continue from a full checkpoint. Nothing unverified is applied.

    ``inplace`` updates the tensors of ``state`` (the engine's weights, if they live on
    the CPU); otherwise each step produces new tensors.

    With a ``verifier`` (``astraflow.weights.signing.ManifestVerifier``) a manifest that is
    not signed by a trusted key is refused by ``observe``: it is never planned with, so the
    held version stays in use; ``take_refused`` hands each refusal over once (to be
    dead-lettered).
    """

    def __init__(
        self,
        *,
        state: StateDict | None = None,
        version: int | None = None,
        policy: str | None = None,
        stores: Iterable[BlobStore] = (),
        kafka_config: KafkaConfig | None = None,
        threads: int | None = None,
        inplace: bool = True,
        verifier: ManifestVerifier | None = None,
    ):
        if (state is None) != (version is None):
            raise ValueError("pass both state and version, or neither")
        self.verifier = verifier
        # every refusal: (manifest key, its signature) -> reason
        self.refused: dict[tuple[ManifestKey, bytes], str] = {}
        self._unreported: list[tuple[WeightManifest, str]] = []
        self.state: dict[str, torch.Tensor] | None = dict(state) if state is not None else None
        self.version = version
        self.policy = policy
        self.resolver = StoreResolver(stores, kafka_config)
        self.threads = threads or default_threads()
        self.inplace = inplace
        self._manifests: dict[ManifestKey, WeightManifest] = {}
        self._bad: dict[ManifestKey, str] = {}

    def observe(self, manifests: WeightManifest | Iterable[WeightManifest]) -> None:
        """Remember manifest(s); those of another policy are ignored once one is set."""
        if isinstance(manifests, WeightManifest):
            manifests = [manifests]
        for m in manifests:
            if self.policy is None:
                self.policy = m.policy
            if m.policy == self.policy and self._trusted(m):
                self._manifests[manifest_key(m)] = m

    def _trusted(self, m: WeightManifest) -> bool:
        """Whether ``m`` passes the verifier (always, without one); a refusal is logged
        and kept for ``take_refused``."""
        if self.verifier is None:
            return True
        try:  # every time: a forged copy of a key must not shadow the signed one
            self.verifier.verify(m)
        except ManifestSignatureError as e:
            seen = (manifest_key(m), m.signature or b"")
            if seen not in self.refused:
                log.warning("weights: refused: %s; the held version stays in use", e)
                self.refused[seen] = str(e)
                self._unreported.append((m, str(e)))
            return False
        return True

    def take_refused(self) -> list[tuple[WeightManifest, str]]:
        """The manifests refused since the last call, with the reason."""
        out, self._unreported = self._unreported, []
        return out

    @property
    def manifests(self) -> list[WeightManifest]:
        return sorted(self._manifests.values(), key=lambda m: (m.version, m.kind))

    @property
    def latest_version(self) -> int | None:
        """Newest version seen (None if none)."""
        return max((m.version for m in self._manifests.values()), default=None)

    def plan(self, target: int | None = None) -> list[WeightManifest]:
        """The plan ``update`` would follow now."""
        t = self.latest_version if target is None else target
        if t is None:
            raise NoPlanError("no manifest seen yet")
        return plan_update(self.version, t, self._manifests.values(), exclude=self._bad)

    def forget_failures(self) -> None:
        """Let manifests that failed before be tried again (e.g. after a store recovered)."""
        self._bad.clear()

    def _fetch(self, plan: list[WeightManifest]) -> list[tuple[WeightManifest, list[BinaryIO]]]:
        """Open (fetch and verify) every blob of the plan, or raise ``_FetchError``."""
        opened: list[tuple[WeightManifest, list[BinaryIO]]] = []
        try:
            for m in plan:
                files: list[BinaryIO] = []
                opened.append((m, files))
                for ref in m.blobs:
                    try:
                        files.append(self.resolver.open(ref))
                    except BlobError as e:
                        raise _FetchError(m, e) from e
        except BaseException:
            _close(opened)
            raise
        return opened

    def update_reachable(self, target: int | None = None, max_versions: int = 50
                         ) -> UpdateResult:
        """``update`` to ``target`` (default: the newest seen) or, when no usable chain
        reaches it (a blob missing or corrupt), to the newest older version one reaches;
        ``NoPlanError`` only when none of the ``max_versions`` newest does."""
        t = self.latest_version if target is None else target
        if t is None:
            raise NoPlanError("no manifest seen yet")
        if t == self.version:
            return self.update(t)
        floor = self.version if self.version is not None else -1
        candidates = sorted({m.version for m in self._manifests.values()
                             if floor < m.version <= t}, reverse=True)[:max_versions]
        error: NoPlanError | None = None
        for v in candidates:
            try:
                result = self.update(v)
            except NoPlanError as e:
                error = error or e
                continue
            if v != t:
                log.warning("weights: v%s is unreachable (%s); now at v%s, the newest "
                            "reachable version", t, error, v)
            return result
        raise error or NoPlanError(f"no version after v{floor} up to v{t} is known")

    def update(self, target: int | None = None, max_attempts: int = 100) -> UpdateResult:
        """Bring the state to ``target`` (default: the newest version seen).

        Raises ``NoPlanError`` when no usable chain of manifests is left.
        """
        t0 = time.perf_counter()
        t = self.latest_version if target is None else target
        result = UpdateResult(self.version, self.version)
        if t is None:
            raise NoPlanError("no manifest seen yet")
        attempts = 0
        while self.version != t:
            attempts += 1
            if attempts > max_attempts:
                raise NoPlanError(f"gave up after {max_attempts} plans: {result.failures[-3:]}")
            plan = plan_update(self.version, t, self._manifests.values(), exclude=self._bad)
            try:
                opened = self._fetch(plan)
            except _FetchError as e:
                self._fail(e.manifest, e.error, result)
                continue
            try:
                for m, files in opened:
                    try:
                        state = self.state
                        for f in files:
                            state = apply_blob(state, f, inplace=self.inplace, threads=self.threads)
                    except BlobError as e:
                        self._fail(m, e, result)
                        break
                    except BaseMismatchError as e:
                        if m.kind == "full":  # does not fit the engine's tensors at all
                            self._fail(m, e, result)
                        else:
                            log.warning(
                                "weights: delta v%s does not fit held v%s (%s); "
                                "continuing from a full checkpoint",
                                m.version,
                                self.version,
                                e,
                            )
                            result.failures.append((m, f"base mismatch: {e}"))
                            self.version = None
                        break
                    self.state = state
                    self.version = m.version
                    result.applied.append(m)
                    result.bytes_fetched += sum(b.bytes for b in m.blobs)
            finally:
                _close(opened)
        result.version = self.version
        result.seconds = time.perf_counter() - t0
        return result

    def _fail(self, m: WeightManifest, e: Exception, result: UpdateResult) -> None:
        log.warning("weights: %s manifest v%s unusable: %s", m.kind, m.version, e)
        self._bad[manifest_key(m)] = str(e)
        result.failures.append((m, str(e)))

    def close(self) -> None:
        self.resolver.close()


def _close(opened: list[tuple[WeightManifest, list[BinaryIO]]]) -> None:
    for _, files in opened:
        for f in files:
            try:
                f.close()
            except Exception:  # pragma: no cover
                pass


class _FetchError(Exception):
    def __init__(self, manifest: WeightManifest, error: BlobError):
        super().__init__(str(error))
        self.manifest = manifest
        self.error = error


# --------------------------------------------------------------------------- retention


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


# --------------------------------------------------------------------------- JSON manifests


def manifest_to_json(m: WeightManifest) -> str:
    return json.dumps(m.to_dict(), indent=1, sort_keys=True)


def manifest_from_json(text: str) -> WeightManifest:
    try:
        return WeightManifest.from_dict(json.loads(text))
    except (ValueError, TypeError, KeyError) as e:
        raise WeightsError(f"not a WeightManifest JSON document: {e}") from e


def save_manifest(m: WeightManifest, directory: str | os.PathLike[str]) -> Path:
    """Write ``m`` as JSON into ``directory`` (atomically); returns the file's path."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    stem = blob_id_of(m.blobs[0]) if m.blobs else f"{m.policy}.v{m.version:08d}.{m.kind}"
    path = d / f"{stem}.json"
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=d)
    with os.fdopen(fd, "w") as f:
        f.write(manifest_to_json(m))
    os.replace(tmp, path)
    return path


def load_manifests(directory: str | os.PathLike[str]) -> list[WeightManifest]:
    """Every ``*.json`` manifest in ``directory``, by version."""
    out = [manifest_from_json(p.read_text()) for p in sorted(Path(directory).glob("*.json"))]
    return sorted(out, key=lambda m: (m.version, m.kind))
