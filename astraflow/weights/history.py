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

A trainer of N processes (FSDP2: each holds rows of dim 0 of every parameter) runs one
``WeightPublisher`` per process with ``rows``; each writes its own blob per version and
``merge_parts`` makes of the N processes' manifests one manifest per kind naming all N
blobs. A follower applies them as one version and refuses a manifest whose parts leave a
gap or overlap.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import torch

from astraflow.weights.delta import (
    CODEC_NAME,
    DEFAULT_LEVEL,
    DEFAULT_SEGMENT_ELEMS,
    EncodeStats,
    Rows,
    StateDict,
    apply_blob,
    apply_parts,
    default_threads,
    dtype_name,
    empty_state,
    extract_delta,
    host_copy,
    iter_encode_delta,
    iter_encode_extracted,
    iter_encode_full,
)
from astraflow.weights.digest import STATE_DIGEST, own_copy, state_digest
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


def _tensor_infos(state: StateDict, rows: Mapping[str, Rows] | None = None) -> list[TensorInfo]:
    """The manifest's tensors: full shapes, also for the parts named in ``rows``."""
    out = []
    for name, t in state.items():
        r = rows.get(name) if rows else None
        if r is not None and tuple(t.shape) != r.part_shape:
            raise ValueError(f"{name}: rows {r.start}..{r.stop} of {list(r.shape)} have shape "
                             f"{list(r.part_shape)}, the tensor given is {list(t.shape)}")
        shape = list(r.shape) if r is not None else list(t.shape)
        out.append(TensorInfo(name, shape, dtype_name(t.dtype)))
    return out


def _common_dtype(dtypes: Iterable[str]) -> str:
    names = set(dtypes)
    return names.pop() if len(names) == 1 else "mixed"


def _on_cuda(state: StateDict) -> bool:
    return any(t.device.type == "cuda" for t in state.values())


def _same_layout(a: Mapping[str, torch.Tensor] | None, b: StateDict, on_device: bool) -> bool:
    """Whether ``a`` can take copies of ``b``'s tensors as they are (names, shapes, dtypes,
    and devices: ``b``'s on its device, else the CPU)."""
    if a is None or a.keys() != b.keys():
        return False
    for k, t in b.items():
        u = a[k]
        want = t.device if on_device else torch.device("cpu")
        if u.shape != t.shape or u.dtype != t.dtype or u.device != want:
            return False
    return True


def _copy_state(into: dict[str, torch.Tensor] | None, state: StateDict,
                on_device: bool) -> dict[str, torch.Tensor]:
    """``state`` copied into ``into``'s tensors when they fit, else into new contiguous
    ones (on each tensor's device with ``on_device``, else on the CPU)."""
    with torch.no_grad():
        if _same_layout(into, state, on_device):
            assert into is not None
            for k, t in state.items():
                into[k].copy_(t.detach())
            return into
        if on_device:
            return {k: t.detach().clone(memory_format=torch.contiguous_format)
                    for k, t in state.items()}
        return {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}


# kind, base version, the blob's pieces given the stats to fill in
_Job = tuple[str, "int | None", Callable[[EncodeStats], Any]]


class PreparedVersion:
    """A version whose device-side work is done (``WeightPublisher.prepare``): ``write``
    encodes its blobs on the CPU, stores them and returns the manifests.

    ``write`` may run on another thread. It runs once: a second call returns the same
    manifests (or raises the same error), and ``prepare`` of the next version writes this
    one itself if no one has started it yet, or waits for it to finish.
    """

    def __init__(self, publisher: WeightPublisher, version: int, common: dict[str, Any],
                 jobs: list[_Job], extract_s: float, committed: bool,
                 prior_version: int | None, after: Callable[[], None] | None = None,
                 smaller_only: bool = False):
        self.version = version
        self._smaller_only = smaller_only  # jobs: a delta and a full, the smaller stored
        self.extract_s = extract_s
        self._publisher = publisher
        self._common = common
        self._jobs: list[_Job] | None = jobs
        self._committed = committed  # the publisher moved on at prepare (else at write)
        self._prior = prior_version
        self._after = after
        self._lock = threading.Lock()
        self._result: list[WeightManifest] | None = None
        self._error: BaseException | None = None

    @property
    def done(self) -> bool:
        """Whether ``write`` has finished (successfully or not)."""
        return self._result is not None or self._error is not None

    def write(self) -> list[WeightManifest]:
        """Encode and store this version's blobs; its manifests (delta first, then full)."""
        with self._lock:
            if not self.done:
                try:
                    self._result = self._run()
                except BaseException as e:
                    self._error = e
                    self._publisher._write_failed(self)
                finally:
                    self._jobs = None  # the host copies go now
            if self._error is not None:
                raise self._error
            assert self._result is not None
            return list(self._result)

    def _run(self) -> list[WeightManifest]:
        assert self._jobs is not None
        pub = self._publisher
        out: list[WeightManifest] = []
        changed: int | None = None
        jobs = self._jobs
        if self._smaller_only:
            jobs, changed = self._smaller_of(jobs)
        for kind, base, pieces in jobs:
            stats = EncodeStats(kind)
            m = pub._write(kind, pieces(stats), stats, base, self._common, self.extract_s)
            if kind == "delta":
                changed = stats.num_changed
            else:
                # changed elements against the previous version when known, else all of them
                m.num_changed = m.num_params if changed is None else changed
                m.sparsity = 1.0 - m.num_changed / m.num_params if m.num_params else 1.0
            out.append(m)
        if self._after is not None:
            self._after()
        return out

    def _smaller_of(self, jobs: list[_Job]) -> tuple[list[_Job], int | None]:
        """Of a delta job and a full job, the one whose blob is smaller (the delta on a
        tie), both encoded in memory first, and the delta's changed-element count; a full
        one chosen records in its ``meta["delta_bytes"]`` the size the delta had."""
        encoded: dict[str, tuple[int | None, list[bytes], EncodeStats]] = {}
        for kind, base, pieces in jobs:
            stats = EncodeStats(kind)
            encoded[kind] = (base, [bytes(b) for b in pieces(stats)], stats)
        size = {k: sum(len(b) for b in v[1]) for k, v in encoded.items()}
        kind = "delta" if size["delta"] <= size["full"] else "full"
        if kind == "full":
            meta = {**self._common["meta"], "delta_bytes": str(size["delta"])}
            self._common = {**self._common, "meta": meta}
        base, blobs, stats = encoded[kind]
        return [(kind, base, _replayed(stats, blobs))], encoded["delta"][2].num_changed


def _replayed(stats: EncodeStats, blobs: list[bytes]) -> Callable[[EncodeStats], Any]:
    """A job's ``pieces`` for a blob encoded already: its bytes, its encoder's figures."""

    def pieces(st: EncodeStats) -> list[bytes]:
        for f in dataclasses.fields(EncodeStats):
            if f.name != "kind":
                setattr(st, f.name, getattr(stats, f.name))
        return blobs

    return pieces


class WeightPublisher:
    """Turns successive state dicts of one policy into blobs and manifests.

    ``publish`` writes the blob(s) of the next version to ``store`` and returns the
    manifests, in order; it does not send them anywhere (the trainer produces them on
    ``weights.<policy>`` in the same transaction as its offset commit). The publisher keeps
    a copy of the last published state to compute the next delta.

    ``prepare`` + ``PreparedVersion.write`` split ``publish`` so that the slow half (CPU
    encoding, ``store.put``) overlaps the next training step: ``prepare`` does what needs
    the state and returns, after which the caller may change the state.

    ``device_delta`` (None: when the state has a tensor on a CUDA device): the previous
    state is kept on the state's device and each delta is found there (``extract_delta``);
    only the changed positions and XORs (for a full checkpoint, the whole state) are
    copied to the host, through pinned memory that PyTorch keeps for reuse, and the delta
    blob carries sum64 checksums. Otherwise the previous
    state is kept on the CPU and ``iter_encode_delta`` compares there (CRC-32 blobs); a
    ``prepare`` then copies the state to a second CPU buffer (two model copies).

    ``rows``: the states given are this process's part of each tensor named there (rows
    of dim 0, ``Rows``; other names are whole tensors, and a name absent from the state is
    simply not this process's). Each manifest then names this process's one blob and the
    full shapes of its tensors; ``merge_parts`` joins the processes' manifests.

    ``whole_when_smaller`` (a small state such as a LoRA adapter, where a step may change
    most elements): a version between anchors is encoded both ways and only the smaller
    blob is stored, a ``full`` manifest recording the delta's size in ``meta["delta_bytes"]``.
    ``meta``: entries of every manifest's ``meta`` (a LoRA policy's adapter settings).

    To resume after a restart pass ``version`` (the last published version) and ``state``
    (its weights); without them the first publish is a full checkpoint. If a write fails,
    the publisher goes back to the last version it wrote and the next version is a full
    checkpoint (the failed version's number may be used again).
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
        rows: Mapping[str, Rows] | None = None,
        device_delta: bool | None = None,
        whole_when_smaller: bool = False,
        meta: Mapping[str, str] | None = None,
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
        self.rows: dict[str, Rows] = dict(rows or {})
        self.device_delta = device_delta
        self.whole_when_smaller = whole_when_smaller
        self.meta = {str(k): str(v) for k, v in (meta or {}).items()}
        self.version = version
        self._prev: dict[str, torch.Tensor] | None = None
        self._spare: dict[str, torch.Tensor] | None = None  # CPU buffer for prepare()
        self._pending: PreparedVersion | None = None
        self._need_full = False  # a write failed: the next version has no usable base
        if state is not None:
            self._remember(state)

    def is_anchor(self, version: int) -> bool:
        """True when ``version`` gets a full checkpoint."""
        if self._prev is None or version == 0 or self._need_full:
            return True
        return self.anchor_interval > 0 and version % self.anchor_interval == 0

    def _remember(self, state: StateDict, on_device: bool = False) -> None:
        self._prev = _copy_state(self._prev, state, on_device)

    def _uses_device(self, state: StateDict) -> bool:
        return self.device_delta if self.device_delta is not None else _on_cuda(state)

    def publish(
        self,
        state: StateDict,
        *,
        version: int | None = None,
        trainer_step: int = 0,
        consumed_offsets: Sequence[PartitionOffset] = (),
        meta: Mapping[str, str] | None = None,
    ) -> list[WeightManifest]:
        """Write the next version's blobs; return its manifests (delta first, then full).
        The same as ``prepare(...).write()``."""
        return self._prepare(state, version, trainer_step, consumed_offsets, meta,
                             keep_copy=False).write()

    def prepare(
        self,
        state: StateDict,
        *,
        version: int | None = None,
        trainer_step: int = 0,
        consumed_offsets: Sequence[PartitionOffset] = (),
        meta: Mapping[str, str] | None = None,
    ) -> PreparedVersion:
        """The part of ``publish`` that needs ``state``, on the calling thread: the delta
        found on the device and copied to the host (``device_delta``; for a full
        checkpoint the whole state is copied to the host), or the state copied to the CPU,
        and the kept previous state updated. Once it returns the caller may change
        ``state``; ``write()`` on the result (from any thread) finishes the version. The
        previous version's write is finished first (run here if it has not started)."""
        return self._prepare(state, version, trainer_step, consumed_offsets, meta,
                             keep_copy=True)

    def _finish_pending(self) -> None:
        pv, self._pending = self._pending, None
        if pv is not None:
            try:
                pv.write()
            except Exception as e:  # its writer hears of it; this version starts afresh
                log.warning("weights: writing v%s failed (%s); the next version is a full "
                            "checkpoint", pv.version, e)

    def _prepare(self, state: StateDict, version: int | None, trainer_step: int,
                 consumed_offsets: Sequence[PartitionOffset], meta: Mapping[str, str] | None,
                 keep_copy: bool) -> PreparedVersion:
        self._finish_pending()
        t0 = time.perf_counter()
        v = (0 if self.version is None else self.version + 1) if version is None else version
        if self.version is not None and v <= self.version:
            raise ValueError(f"version {v} is not after the last published {self.version}")
        tensors = _tensor_infos(state, self.rows)
        common = dict(
            policy=self.policy,
            version=v,
            dtype=_common_dtype(t.dtype for t in tensors),
            tensors=tensors,
            trainer_step=trainer_step,
            consumed_offsets=list(consumed_offsets),
            codec=CODEC_NAME,
            meta={**self.meta, **{str(k): str(x) for k, x in (meta or {}).items()},
                  "anchor_interval": str(self.anchor_interval)},
        )
        if v == 0 and not self.rows:  # what engines load from disk (weights.digest)
            common["meta"][STATE_DIGEST] = state_digest(state, tensors)
        opts = dict(threads=self.threads, level=self.level)
        seg, rows = self.segment_elems, self.rows
        anchor = self.is_anchor(v)
        base = self.version
        with_delta = (self._prev is not None and not self._need_full
                      and (not anchor or self.delta_at_anchors))
        # between anchors: the delta or the whole state, whichever blob is smaller
        smaller = self.whole_when_smaller and with_delta and not anchor
        delta_meta = {"policy": self.policy, "version": str(v), "base_version": str(base)}
        full_meta = {"policy": self.policy, "version": str(v)}
        jobs: list[_Job] = []
        after: Callable[[], None] | None = None
        host: StateDict | None = None  # what the full checkpoint is encoded from
        device = self._uses_device(state)
        if device:
            if with_delta:
                assert self._prev is not None
                for k, t in state.items():  # e.g. resumed from a CPU state: onto the device
                    p = self._prev.get(k)
                    if p is not None and p.device != t.device:
                        self._prev[k] = p.to(t.device)
                ext = extract_delta(self._prev, state, segment_elems=seg, rows=rows)
                jobs.append(("delta", base, lambda st: iter_encode_extracted(
                    ext, meta=delta_meta, stats=st, **opts)))
            if anchor or smaller:
                host = host_copy(state)
            self._remember(state, on_device=True)
            # the copies are queued on the device: done before the caller may change state
            for d in {t.device for t in state.values() if t.device.type == "cuda"}:
                torch.cuda.synchronize(d)
        elif keep_copy:
            old = self._prev
            if with_delta:
                assert old is not None
                _check_names(old, state)
            host = self._prev = _copy_state(self._spare, state, on_device=False)
            self._spare = old  # rewritten by the next prepare, once this write is done
            if with_delta:
                jobs.append(("delta", base, lambda st: iter_encode_delta(
                    old, host, segment_elems=seg, rows=rows, meta=delta_meta, stats=st,
                    **opts)))
        else:
            # publish(): encode from the caller's state while it waits; remember it after
            host, old = state, self._prev
            if with_delta:
                assert old is not None
                _check_names(old, state)
                jobs.append(("delta", base, lambda st: iter_encode_delta(
                    old, state, segment_elems=seg, rows=rows, meta=delta_meta, stats=st,
                    **opts)))

            def after() -> None:
                self._remember(state)
                self.version = v
                self._need_full = False

        if anchor or smaller:
            assert host is not None
            full_state = host
            jobs.append(("full", None, lambda st: iter_encode_full(
                full_state, compress=self.compress_full, segment_elems=seg, rows=rows,
                meta=full_meta, stats=st, **opts)))
        committed = after is None
        pv = PreparedVersion(self, v, common, jobs, time.perf_counter() - t0, committed,
                             self.version, after, smaller_only=smaller)
        if committed:
            self.version = v
            self._need_full = False
            self._pending = pv
        return pv

    def _write_failed(self, pv: PreparedVersion) -> None:
        """A version's write failed: a version prepared before it changed the kept state,
        so go back to the last version written and make the next one a full checkpoint."""
        if pv._committed and self.version == pv.version:
            self.version = pv._prior
            self._need_full = True

    def _write(self, kind: str, pieces: Any, stats: EncodeStats, base: int | None,
               common: dict[str, Any], extract_s: float) -> WeightManifest:
        """Store one encoded blob of ``kind``; its manifest (``common`` fields included)."""
        ref = self.store.put(new_blob_id(self.policy, common["version"], kind), pieces)
        n, changed = stats.num_params, stats.num_changed  # filled in while it was stored
        timings = {"extract_s": f"{extract_s:.3f}", "encode_s": f"{stats.seconds:.3f}"}
        return WeightManifest(
            base_version=base,
            kind=kind,
            blobs=[ref],
            num_params=n,
            num_changed=changed,
            sparsity=1.0 - changed / n if n else 1.0,
            encoded_bytes=ref.bytes,
            **{**common, "meta": {**common["meta"], **timings}},
        )


def _check_names(old: StateDict, new: StateDict) -> None:
    """What ``iter_encode_delta`` would refuse, refused before anything changes."""
    if set(old) != set(new):
        missing = sorted(set(new) - set(old))[:5]
        extra = sorted(set(old) - set(new))[:5]
        raise ValueError(f"state dicts differ in names: new-only {missing}, old-only {extra}")
    for name, t in new.items():
        o = old[name]
        if o.dtype != t.dtype or tuple(o.shape) != tuple(t.shape):
            raise ValueError(
                f"{name}: old is {o.dtype} {tuple(o.shape)}, new is {t.dtype} {tuple(t.shape)}"
            )


def merge_parts(per_process: Sequence[Sequence[WeightManifest]]) -> list[WeightManifest]:
    """One manifest per kind from each process's manifests of one version (process
    order): every process's blobs in process order, the full ``tensors`` list (each name
    once), ``num_params``/``num_changed``/``encoded_bytes`` summed, ``sparsity``
    recomputed, ``meta`` merged (the first process's value of a key, the largest
    ``encode_s``/``extract_s``) with ``meta["parts"]`` the number of processes.
    ``trainer_step``, ``created_at_ms`` and each partition's consumed offset are the
    largest; signatures are dropped (sign the merged manifest). ``ValueError`` when the
    processes disagree on policy, version, base version, kinds or a tensor."""
    if not per_process:
        raise ValueError("merge_parts needs the manifests of at least one process")
    kinds = [m.kind for m in per_process[0]]
    if not kinds or len(set(kinds)) != len(kinds):
        raise ValueError(f"process 0 must give one manifest per kind, got {kinds}")
    for i, ms in enumerate(per_process):
        if [m.kind for m in ms] != kinds:
            raise ValueError(f"process {i} gives {[m.kind for m in ms]}, process 0 {kinds}")
    out = []
    for j in range(len(kinds)):
        group = [ms[j] for ms in per_process]
        first = group[0]
        for i, m in enumerate(group):
            got = (m.policy, m.version, m.base_version, m.codec)
            want = (first.policy, first.version, first.base_version, first.codec)
            if got != want:
                raise ValueError(f"process {i}'s {m.kind} manifest is (policy, version, base, "
                                 f"codec) {got}, process 0's {want}")
        tensors = _merge_tensor_infos(group)
        n = sum(m.num_params for m in group)
        changed = sum(m.num_changed for m in group)
        meta: dict[str, str] = {}
        for m in group:
            for k, v in m.meta.items():
                if k in ("encode_s", "extract_s") and k in meta:
                    meta[k] = max(meta[k], v, key=float)
                else:
                    meta.setdefault(k, v)
        meta["parts"] = str(len(group))
        offsets: dict[tuple[str, int], PartitionOffset] = {}
        for m in group:
            for p in m.consumed_offsets:
                cur = offsets.get((p.topic, p.partition))
                if cur is None or p.offset > cur.offset:
                    offsets[(p.topic, p.partition)] = p
        out.append(WeightManifest(
            policy=first.policy,
            version=first.version,
            base_version=first.base_version,
            kind=first.kind,
            dtype=_common_dtype(t.dtype for t in tensors),
            tensors=tensors,
            blobs=[b for m in group for b in m.blobs],
            num_params=n,
            num_changed=changed,
            sparsity=1.0 - changed / n if n else 1.0,
            encoded_bytes=sum(m.encoded_bytes for m in group),
            trainer_step=max(m.trainer_step for m in group),
            consumed_offsets=[offsets[k] for k in sorted(offsets)],
            created_at_ms=max(m.created_at_ms for m in group),
            codec=first.codec,
            meta=meta,
        ))
    return out


def _merge_tensor_infos(group: Sequence[WeightManifest]) -> list[TensorInfo]:
    """Each name once, in an order that keeps every process's order (a name a process
    lacks goes after the names it follows in the process that has it)."""
    order: list[str] = []
    infos: dict[str, TensorInfo] = {}
    for i, m in enumerate(group):
        at = 0
        for t in m.tensors:
            known = infos.get(t.name)
            if known is None:
                infos[t.name] = t
                order.insert(at, t.name)
                at += 1
                continue
            if list(known.shape) != list(t.shape) or known.dtype != t.dtype:
                raise ValueError(f"{t.name} is {known.dtype} {list(known.shape)} in an earlier "
                                 f"process, {t.dtype} {list(t.shape)} in process {i}")
            at = max(at, order.index(t.name) + 1)
    return [infos[name] for name in order]


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

    def adopt(self, state: StateDict, version: int = 0) -> bool:
        """Hold a copy of ``state`` (an engine's weights loaded from disk) as ``version``
        when that version's full checkpoint manifest carries a digest
        (``weights.digest``) that the copy, cast to the manifest's dtypes, matches: the
        next update then fetches only what follows ``version``. Otherwise, or when a
        version is held already, nothing changes and it returns False."""
        if self.version is not None:
            return False
        vouching = [m for m in self._manifests.values()
                    if m.version == version and m.kind == "full" and STATE_DIGEST in m.meta]
        if not vouching:
            return False
        m = vouching[0]
        copy = own_copy(state, m.tensors)
        if copy is None or state_digest(copy, m.tensors) != m.meta[STATE_DIGEST]:
            return False
        self.state, self.version = copy, version
        return True

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
                        state = self._apply(m, files)
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

    def _apply(self, m: WeightManifest, files: list[BinaryIO]) -> dict[str, torch.Tensor]:
        """The held state with manifest ``m``'s verified blobs applied. Several blobs (a
        merged manifest, ``merge_parts``) are one version's parts, applied together: a
        full checkpoint's parts go into the held tensors (``inplace``, when they match) or
        a new state, and must cover every element once."""
        if len(files) == 1 and "parts" not in m.meta:
            return apply_blob(self.state, files[0], inplace=self.inplace, threads=self.threads)
        state = self.state
        if m.kind == "full" and (state is None or not self.inplace
                                 or not _matches(state, m.tensors)):
            state = empty_state(m.tensors)
            return apply_parts(state, files, inplace=True, threads=self.threads)
        return apply_parts(state, files, inplace=self.inplace, threads=self.threads)

    def _fail(self, m: WeightManifest, e: Exception, result: UpdateResult) -> None:
        log.warning("weights: %s manifest v%s unusable: %s", m.kind, m.version, e)
        self._bad[manifest_key(m)] = str(e)
        result.failures.append((m, str(e)))

    def close(self) -> None:
        self.resolver.close()


def _matches(state: StateDict, tensors: Sequence[TensorInfo]) -> bool:
    """Whether ``state`` has exactly the manifest's tensors (names, shapes, dtypes)."""
    if len(state) != len(tensors):
        return False
    for t in tensors:
        u = state.get(t.name)
        if u is None or list(u.shape) != list(t.shape) or dtype_name(u.dtype) != t.dtype:
            return False
    return True


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
