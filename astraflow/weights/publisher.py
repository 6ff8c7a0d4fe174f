"""Publishing versions: ``WeightPublisher`` turns successive state dicts of one policy into
blobs in a store and their manifests (a full checkpoint at anchors, a delta otherwise;
``weights.planning`` says which each version gets), ``prepare`` doing the part that needs
the state and ``PreparedVersion.write`` the CPU encoding and storing.

A trainer of N processes (FSDP2: each holds rows of dim 0 of every parameter) runs one
``WeightPublisher`` per process with ``rows``; each writes its own blob per version and
``merge_parts`` (``weights.merge``) makes of the N processes' manifests one manifest per
kind naming all N blobs.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from astraflow.weights.bits import StateDict, dtype_name
from astraflow.weights.blob import CODEC_NAME, DEFAULT_SEGMENT_ELEMS, Rows
from astraflow.weights.digest import STATE_DIGEST, state_digest
from astraflow.weights.encode import EncodeStats, iter_encode_delta, iter_encode_full
from astraflow.weights.extract import extract_delta, host_copy, iter_encode_extracted
from astraflow.weights.manifests import _common_dtype
from astraflow.weights.packing import DEFAULT_LEVEL
from astraflow.weights.pipeline import default_threads
from astraflow.weights.stores.base import BlobStore, new_blob_id
from astraflow.wire.records import PartitionOffset, TensorInfo, WeightManifest

log = logging.getLogger(__name__)


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
