"""Encoding on the CPU: the delta blob that turns one state dict into another
(``encode_delta``, ``iter_encode_delta``) and the full checkpoint of one
(``encode_full``, ``iter_encode_full``), with CRC-32 segment checksums.

Each tensor is compared and encoded segment by segment on a few threads
(``weights.pipeline``); ``_assemble`` writes the segments' records into the container of
``weights.blob`` in order, and is shared with the device encoder (``weights.extract``).
"""

from __future__ import annotations

import threading
import time
import zlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from astraflow.weights.bits import StateDict, _as_bytes, _bits, _flat_cpu, dtype_name
from astraflow.weights.blob import (
    _F_POS_ZSTD,
    _F_VAL_ZSTD,
    _FOOTER,
    _TENSOR,
    DEFAULT_SEGMENT_ELEMS,
    END_MAGIC,
    KIND_DELTA,
    KIND_FULL,
    Mode,
    Rows,
    TensorSpec,
    _header_bytes,
    _segment,
    _SegOut,
    _tensor_mode,
    _TensorStart,
)
from astraflow.weights.packing import DEFAULT_LEVEL, _gaps, _pack
from astraflow.weights.pipeline import _pipeline, default_threads

_SCAN_CHUNK = 1 << 17  # elements compared per numpy call: keeps both chunks in L2


class _Scratch(threading.local):
    """A thread's mask buffer for ``_changes``' comparisons."""

    def __init__(self) -> None:
        self.mask = np.empty(_SCAN_CHUNK, dtype=bool)


_SCRATCH = _Scratch()


@dataclass
class EncodeStats:
    """What an encoder produced. ``num_changed`` counts elements whose bits changed."""

    kind: str
    num_tensors: int = 0
    num_params: int = 0
    num_changed: int = 0
    raw_bytes: int = 0
    encoded_bytes: int = 0
    seconds: float = 0.0
    segments: dict[str, int] = field(default_factory=dict)
    tensor_modes: dict[str, int] = field(default_factory=dict)

    @property
    def sparsity(self) -> float:
        """Fraction of elements whose bit pattern did not change."""
        return 1.0 - self.num_changed / self.num_params if self.num_params else 1.0

    @property
    def ratio(self) -> float:
        """Encoded size as a fraction of the raw size of the new state."""
        return self.encoded_bytes / self.raw_bytes if self.raw_bytes else 0.0


def _changes(o: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old bits, new bits) where the bit patterns differ.

    Compares in cache-sized chunks and gathers the values while the chunk is still in
    cache; no Python work per element.
    """
    scratch = _SCRATCH.mask
    size = o.size
    pos, old, new = [], [], []
    for s in range(0, size, _SCAN_CHUNK):
        oc = o[s : s + _SCAN_CHUNK]
        nc = n[s : s + _SCAN_CHUNK]
        m = scratch[: oc.size]
        np.not_equal(oc, nc, out=m)
        p = np.flatnonzero(m)
        if p.size:
            old.append(oc[p])
            new.append(nc[p])
            if s:
                p += s
            pos.append(p)
    if not pos:
        return np.empty(0, dtype=np.intp), o[:0], n[:0]
    if len(pos) == 1:
        return pos[0], old[0], new[0]
    return np.concatenate(pos), np.concatenate(old), np.concatenate(new)


def _encode_delta_segment(o: np.ndarray, n: np.ndarray, level: int) -> _SegOut:
    """Smallest of SPARSE, DENSE (raw new bits) and DENSE_XOR for one segment."""
    pos, ov, nv = _changes(o, n)
    k = int(pos.size)
    if k == 0:
        return _segment(Mode.UNCHANGED, 0, 0, 0, b"", b"", 0, 0)
    isz = n.dtype.itemsize
    raw = n.size * isz
    gaps, width = _gaps(pos)
    pp, pz = _pack(gaps, width, level)
    vp, vz = _pack(ov ^ nv, isz, level)
    flags = pz * _F_POS_ZSTD | vz * _F_VAL_ZSTD
    sparse = (Mode.SPARSE, flags, width, k, pp, vp, zlib.crc32(ov), zlib.crc32(nv))
    if len(pp) + len(vp) <= raw // 4 and 4 * k <= n.size:
        return _segment(*sparse)
    # Many changes: whole-segment encodings may win (ties go to DENSE, which needs no base).
    crc_new = zlib.crc32(n)
    options = [(raw, 0, (Mode.DENSE, 0, isz, k, b"", _as_bytes(n), 0, crc_new))]
    options.append((len(pp) + len(vp), 1, sparse))
    xp, xz = _pack(o ^ n, isz, level)
    if xz:
        dense_xor = (Mode.DENSE_XOR, _F_VAL_ZSTD, isz, k, b"", xp, zlib.crc32(o), crc_new)
        options.append((len(xp), 2, dense_xor))
    return _segment(*min(options, key=lambda c: (c[0], c[1]))[2])


def _encode_full_segment(n: np.ndarray, level: int | None) -> _SegOut:
    vp, vz = _pack(n, n.dtype.itemsize, level)
    return _segment(
        Mode.DENSE, vz * _F_VAL_ZSTD, n.dtype.itemsize, n.size, b"", vp, 0, zlib.crc32(n)
    )


def _check_segment_elems(seg: int) -> int:
    if not 1 <= seg <= 1 << 31:
        raise ValueError(f"segment_elems must be in [1, 2**31], got {seg}")
    return seg


def _spec(name: str, t: torch.Tensor, rows: Mapping[str, Rows] | None = None) -> TensorSpec:
    r = rows.get(name) if rows else None
    if r is not None:
        if not isinstance(r, Rows):
            raise TypeError(f"rows[{name!r}] is {type(r).__name__}, expected Rows")
        if tuple(t.shape) != r.part_shape:
            raise ValueError(
                f"{name}: rows {r.start}..{r.stop} of {list(r.shape)} have shape "
                f"{list(r.part_shape)}, the tensor given is {list(t.shape)}"
            )
    return TensorSpec(name, dtype_name(t.dtype), list(t.shape), r)


def _assemble(
    kind: int,
    specs: list[TensorSpec],
    jobs: Iterator[Any],
    fn: Callable[[Any], Any],
    threads: int,
    seg: int,
    meta: Mapping[str, str],
    stats: EncodeStats,
    sum64: bool = False,
) -> Iterator[Any]:
    t0 = time.perf_counter()
    stats.num_tensors = len(specs)
    total = 0

    def emit(parts):
        nonlocal total
        for p in parts:
            total += len(p)
            yield p

    yield from emit([_header_bytes(kind, specs, seg, meta, sum64)])
    pending: list[Any] = []
    changed = False
    remaining = 0
    t_modes: set[str] = set()

    def finish() -> Iterator[Any]:
        if not changed:
            yield from emit([_TENSOR.pack(b"T", 0)])
        name = _tensor_mode(t_modes)
        stats.tensor_modes[name] = stats.tensor_modes.get(name, 0) + 1

    for r in _pipeline(jobs, fn, threads):
        if isinstance(r, _TensorStart):
            pending = [_TENSOR.pack(b"T", r.n_segments)]
            changed, remaining, t_modes = False, r.n_segments, set()
            if remaining == 0:
                yield from finish()
            continue
        mode_name = r.mode.name.lower()
        stats.segments[mode_name] = stats.segments.get(mode_name, 0) + 1
        t_modes.add(mode_name)
        stats.num_changed += r.num_changed
        if r.mode == Mode.UNCHANGED and not changed:
            pending.extend(r.parts)
        else:
            if not changed:
                yield from emit(pending)
                changed = True
            yield from emit(r.parts)
        remaining -= 1
        if remaining == 0:
            yield from finish()
    yield from emit([_FOOTER.pack(len(specs), END_MAGIC)])
    stats.encoded_bytes = total
    stats.seconds = time.perf_counter() - t0


def _check_pair(old: StateDict, new: StateDict,
                rows: Mapping[str, Rows] | None = None) -> list[TensorSpec]:
    if set(old) != set(new):
        missing = sorted(set(new) - set(old))[:5]
        extra = sorted(set(old) - set(new))[:5]
        raise ValueError(f"state dicts differ in names: new-only {missing}, old-only {extra}")
    specs = []
    for name, t in new.items():
        o = old[name]
        if o.dtype != t.dtype or tuple(o.shape) != tuple(t.shape):
            raise ValueError(
                f"{name}: old is {o.dtype} {tuple(o.shape)}, new is {t.dtype} {tuple(t.shape)}"
            )
        specs.append(_spec(name, t, rows))
    return specs


def iter_encode_delta(
    old: StateDict,
    new: StateDict,
    *,
    threads: int | None = None,
    level: int = DEFAULT_LEVEL,
    segment_elems: int = DEFAULT_SEGMENT_ELEMS,
    meta: Mapping[str, str] | None = None,
    stats: EncodeStats | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> Iterator[Any]:
    """Stream the delta blob that turns ``old`` into ``new`` as a sequence of bytes-like pieces.

    Tensors are visited one at a time and cut into segments; at most ``4 * threads``
    segments are in flight, so memory stays at a few segments beyond the two states (plus
    one CPU copy of a tensor pair when the states live on a GPU). Pieces may be
    memoryviews into ``new``: consume them before mutating it. ``stats`` (if given) is
    filled in when the generator is exhausted. With ``rows``, the tensors named there are
    those rows of dim 0 of a bigger tensor (``Rows``), and the blob says so.
    """
    specs = _check_pair(old, new, rows)
    seg = _check_segment_elems(segment_elems)
    stats = stats if stats is not None else EncodeStats("delta")
    stats.kind = "delta"
    threads = threads or default_threads()

    def jobs() -> Iterator[Any]:
        for i, spec in enumerate(specs):
            o = _bits(_flat_cpu(old[spec.name]))
            n = _bits(_flat_cpu(new[spec.name]))
            stats.num_params += n.size
            stats.raw_bytes += n.nbytes
            nseg = -(-n.size // seg)
            yield _TensorStart(i, nseg)
            for s in range(0, n.size, seg):
                yield (o[s : s + seg], n[s : s + seg])

    def fn(job):
        if isinstance(job, _TensorStart):
            return job
        return _encode_delta_segment(job[0], job[1], level)

    return _assemble(KIND_DELTA, specs, jobs(), fn, threads, seg, meta or {}, stats)


def iter_encode_full(
    state: StateDict,
    *,
    compress: bool = True,
    threads: int | None = None,
    level: int = DEFAULT_LEVEL,
    segment_elems: int = DEFAULT_SEGMENT_ELEMS,
    meta: Mapping[str, str] | None = None,
    stats: EncodeStats | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> Iterator[Any]:
    """Stream a full checkpoint of ``state`` (every segment dense; zstd where it helps).
    With ``rows``, the tensors named there are parts (see ``iter_encode_delta``)."""
    specs = [_spec(name, t, rows) for name, t in state.items()]
    seg = _check_segment_elems(segment_elems)
    stats = stats if stats is not None else EncodeStats("full")
    stats.kind = "full"
    threads = threads or default_threads()
    zlevel = level if compress else None

    def jobs() -> Iterator[Any]:
        for i, spec in enumerate(specs):
            n = _bits(_flat_cpu(state[spec.name]))
            stats.num_params += n.size
            stats.raw_bytes += n.nbytes
            yield _TensorStart(i, -(-n.size // seg))
            for s in range(0, n.size, seg):
                yield n[s : s + seg]

    def fn(job):
        if isinstance(job, _TensorStart):
            return job
        return _encode_full_segment(job, zlevel)

    return _assemble(KIND_FULL, specs, jobs(), fn, threads, seg, meta or {}, stats)


def encode_delta(
    old: StateDict,
    new: StateDict,
    *,
    threads: int | None = None,
    level: int = DEFAULT_LEVEL,
    segment_elems: int = DEFAULT_SEGMENT_ELEMS,
    meta: Mapping[str, str] | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> tuple[bytes, EncodeStats]:
    """Delta blob turning ``old`` into ``new`` (same names, shapes, dtypes), and its stats."""
    stats = EncodeStats("delta")
    it = iter_encode_delta(
        old,
        new,
        threads=threads,
        level=level,
        segment_elems=segment_elems,
        meta=meta,
        stats=stats,
        rows=rows,
    )
    blob = b"".join(it)
    return blob, stats


def encode_full(
    state: StateDict,
    *,
    compress: bool = True,
    threads: int | None = None,
    level: int = DEFAULT_LEVEL,
    segment_elems: int = DEFAULT_SEGMENT_ELEMS,
    meta: Mapping[str, str] | None = None,
    rows: Mapping[str, Rows] | None = None,
) -> tuple[bytes, EncodeStats]:
    """Full-checkpoint blob of ``state``, and its stats."""
    stats = EncodeStats("full")
    it = iter_encode_full(
        state,
        compress=compress,
        threads=threads,
        level=level,
        segment_elems=segment_elems,
        meta=meta,
        stats=stats,
        rows=rows,
    )
    blob = b"".join(it)
    return blob, stats


__all__ = [
    "EncodeStats",
    "encode_delta",
    "encode_full",
    "iter_encode_delta",
    "iter_encode_full",
]
