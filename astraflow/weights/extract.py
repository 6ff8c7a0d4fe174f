"""Deltas found on the tensors' own device (CUDA or CPU): ``extract_delta`` compares the
two states there with torch and copies to the host only the changed positions, their XORs
and two sum64 figures per segment; ``iter_encode_extracted`` encodes that into a delta
blob (format version 2, sum64 checksums) on the CPU. ``host_copy`` copies a state to the
host through pinned memory (for the full checkpoint of the same version).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from astraflow.weights.bits import _INT_TORCH, _UINT_NP, StateDict, torch_dtype
from astraflow.weights.blob import (
    _F_POS_ZSTD,
    _F_VAL_ZSTD,
    DEFAULT_SEGMENT_ELEMS,
    KIND_DELTA,
    Mode,
    Rows,
    TensorSpec,
    _segment,
    _SegOut,
    _TensorStart,
)
from astraflow.weights.checksums import _torch_weighted
from astraflow.weights.encode import (
    EncodeStats,
    _assemble,
    _check_pair,
    _check_segment_elems,
)
from astraflow.weights.packing import DEFAULT_LEVEL, _gaps, _pack
from astraflow.weights.pipeline import default_threads

_DEVICE_CHUNK = 1 << 26  # elements compared per device pass (whole segments at least)


@dataclass
class _ChunkChanges:
    """The changes one device pass found in elements ``start..`` (whole segments, one per
    entry of ``ends``) of one tensor, copied to the host. ``pos``, ``xor`` are the pass's
    arrays, shared by every tensor in it: this tensor's changes are ``first..ends[-1]``,
    and element ``start`` of the tensor sits at pass position ``shift``."""

    start: int  # first element (a multiple of segment_elems)
    first: int  # index in pos/xor of this part's first change
    ends: np.ndarray  # per segment: index in pos/xor just after its last change
    pos: np.ndarray  # int32 positions in the pass, increasing
    shift: int  # pass position of element ``start``
    xor: np.ndarray  # old ^ new bit patterns at pos (unsigned)
    sum_old: np.ndarray  # per segment: sum64 of the old bits at its changed positions
    sum_new: np.ndarray  # per segment: the same of the new bits


@dataclass
class ExtractedDelta:
    """The changes between two states as ``extract_delta`` found them on the tensors'
    device, held on the host: positions, XORs and per-segment sum64 figures of the changed
    elements only. ``iter_encode_extracted`` turns it into a delta blob."""

    specs: list[TensorSpec]
    segment_elems: int
    chunks: list[list[_ChunkChanges]]  # per tensor, in element order; only those with changes
    num_changed: int = 0
    host_bytes: int = 0  # bytes copied from the device
    seconds: float = 0.0

    @property
    def num_params(self) -> int:
        return sum(s.numel for s in self.specs)


def _flat_device(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1)


def _to_host(ts: list[torch.Tensor]) -> list[np.ndarray]:
    """Host copies of device tensors (CPU tensors as they are). From a GPU they go into
    pinned memory (PyTorch caches and reuses those blocks), several times faster than
    into pageable memory, with one wait for all of them."""
    if ts[0].device.type != "cuda":
        return [t.cpu().numpy() for t in ts]
    out = []
    for t in ts:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t, non_blocking=True)
        out.append(host)
    torch.cuda.current_stream(ts[0].device).synchronize()
    return [h.numpy() for h in out]


def host_copy(state: StateDict) -> dict[str, torch.Tensor]:
    """Contiguous CPU copies of ``state``'s tensors (copies also of CPU tensors); from a
    GPU through pinned memory, with one wait for all of them."""
    out: dict[str, torch.Tensor] = {}
    waits: set[torch.device] = set()
    with torch.no_grad():
        for k, t in state.items():
            t = t.detach()
            if t.device.type == "cuda":
                host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                host.copy_(t, non_blocking=True)
                waits.add(t.device)
                out[k] = host
            else:
                out[k] = t.to("cpu", copy=True).contiguous()
    for d in waits:
        torch.cuda.current_stream(d).synchronize()
    return out


@dataclass
class _Slice:
    tensor: int
    start: int  # first element in the tensor (a multiple of segment_elems)
    old: torch.Tensor  # flat integer views
    new: torch.Tensor


class _Pass:
    """Slices of tensors of one element size on one device, compared together: a pass
    costs a fixed number of kernel launches, one sync and three device-to-host copies,
    however many (small) tensors it holds."""

    def __init__(self, seg: int, out: ExtractedDelta):
        self.seg = seg
        self.out = out
        self.slices: list[_Slice] = []
        self.size = 0

    def add(self, s: _Slice, limit: int) -> None:
        if self.slices and self.size + s.new.numel() > limit:
            self.run()
        self.slices.append(s)
        self.size += s.new.numel()

    def run(self) -> None:
        slices, self.slices, total, self.size = self.slices, [], self.size, 0
        if not slices:
            return
        seg = self.seg
        first = slices[0].new
        if len(slices) == 1:
            old, x = slices[0].old, torch.bitwise_xor(slices[0].old, first)
        else:  # the old bits side by side too, so that one gather reads them
            old = torch.empty(total, dtype=first.dtype, device=first.device)
            x = torch.empty_like(old)
        seg_starts, seg_ends, offsets = [], [], []
        at = 0
        for s in slices:
            n = s.new.numel()
            if len(slices) > 1:
                old[at : at + n].copy_(s.old)
                torch.bitwise_xor(old[at : at + n], s.new, out=x[at : at + n])
            starts = np.arange(at, at + n, seg, dtype=np.int64)
            seg_starts.append(starts)
            seg_ends.append(np.minimum(starts + seg, at + n))
            offsets.append(at)
            at += n
        p = torch.nonzero(x).reshape(-1)  # increasing; the pass's one device sync
        if p.numel() == 0:
            return
        dev = p.device
        xv = x[p]
        ov = old[p]
        s_starts = torch.from_numpy(np.concatenate(seg_starts)).to(dev)
        s_ends = torch.from_numpy(np.concatenate(seg_ends)).to(dev)
        local = p - s_starts[torch.searchsorted(s_ends, p, right=True)]  # in its segment
        # per-segment sums from one running sum: exact, since int64 addition wraps
        # (mod 2**64) and is associative; no atomics, so deterministic on any device
        zero = torch.zeros(1, dtype=torch.int64, device=dev)
        cs_old = torch.cat([zero, torch.cumsum(_torch_weighted(ov, local), 0)])
        cs_new = torch.cat([zero, torch.cumsum(_torch_weighted(ov ^ xv, local), 0)])
        ends = torch.searchsorted(p, s_ends)
        starts = torch.cat([zero, ends[:-1]])
        figures = torch.stack([ends, cs_old[ends] - cs_old[starts], cs_new[ends] - cs_new[starts]])
        # a pass holds at most max(2**26, seg) <= 2**31 elements: int32 positions
        figs, pos, xor = _to_host([figures, p.to(torch.int32), xv])
        xor = xor.view(_UINT_NP[xv.element_size()])
        self.out.host_bytes += figs.nbytes + pos.nbytes + xor.nbytes
        self.out.num_changed += int(pos.size)
        i = 0
        for s, off, starts_of in zip(slices, offsets, seg_starts, strict=True):
            k = starts_of.size
            e = figs[0, i : i + k]
            lo = int(figs[0, i - 1]) if i else 0
            if int(e[-1]) > lo:
                self.out.chunks[s.tensor].append(_ChunkChanges(
                    s.start, lo, e, pos, off, xor,
                    figs[1, i : i + k].view(np.uint64), figs[2, i : i + k].view(np.uint64)))
            i += k


def extract_delta(
    old: StateDict,
    new: StateDict,
    *,
    segment_elems: int = DEFAULT_SEGMENT_ELEMS,
    rows: Mapping[str, Rows] | None = None,
) -> ExtractedDelta:
    """Find what changed from ``old`` to ``new`` with torch on the device each tensor pair
    lives on (CUDA or CPU), and copy to the host only the changed positions, the XOR of
    old and new bits there, and two sum64 figures per segment.

    Tensors of one element size on one device are compared in passes of about 2**26
    elements (small tensors together), so the cost per tensor is one or two kernel
    launches. The states are not needed afterwards: ``new`` may change once this returns.
    ``iter_encode_extracted`` encodes the result (on the CPU, off the caller's thread if
    it likes). ``rows`` as for ``iter_encode_delta``.
    """
    t0 = time.perf_counter()
    specs = _check_pair(old, new, rows)
    seg = _check_segment_elems(segment_elems)
    per = max(1, _DEVICE_CHUNK // seg) * seg
    out = ExtractedDelta(specs, seg, [[] for _ in specs])
    passes: dict[tuple[int, torch.device], _Pass] = {}
    with torch.no_grad():
        for i, spec in enumerate(specs):
            o, n = _flat_device(old[spec.name]), _flat_device(new[spec.name])
            if o.device != n.device:
                raise ValueError(f"{spec.name}: old is on {o.device}, new on {n.device}")
            size = n.element_size()
            if size not in _INT_TORCH:
                raise TypeError(f"dtype {n.dtype} is not supported (element size {size})")
            oi, ni = o.view(_INT_TORCH[size]), n.view(_INT_TORCH[size])
            batch = passes.setdefault((size, n.device), _Pass(seg, out))
            for c0 in range(0, ni.numel(), per):
                batch.add(_Slice(i, c0, oi[c0 : c0 + per], ni[c0 : c0 + per]), per)
        for batch in passes.values():
            batch.run()
    out.seconds = time.perf_counter() - t0
    return out


def _encode_extracted_segment(pos: np.ndarray, x: np.ndarray, count: int, cb: int, cn: int,
                              level: int) -> _SegOut:
    """SPARSE or DENSE_XOR (whichever is smaller; no base needed to choose) of one segment
    from its changed positions and XORs, with sum64 checksums."""
    k = int(pos.size)
    if k == 0:
        return _segment(Mode.UNCHANGED, 0, 0, 0, b"", b"", 0, 0, True)
    isz = x.dtype.itemsize
    raw = count * isz
    gaps, width = _gaps(pos)
    pp, pz = _pack(gaps, width, level)
    vp, vz = _pack(x, isz, level)
    sparse = (Mode.SPARSE, pz * _F_POS_ZSTD | vz * _F_VAL_ZSTD, width, k, pp, vp, cb, cn)
    if len(pp) + len(vp) <= raw // 4 and 4 * k <= count:
        return _segment(*sparse, True)
    whole = np.zeros(count, dtype=x.dtype)
    whole[pos] = x
    xp, xz = _pack(whole, isz, level)
    dense_xor = (Mode.DENSE_XOR, xz * _F_VAL_ZSTD, isz, k, b"", xp, cb, cn)
    return _segment(*(sparse if len(pp) + len(vp) < len(xp) else dense_xor), True)


def iter_encode_extracted(
    changes: ExtractedDelta,
    *,
    threads: int | None = None,
    level: int = DEFAULT_LEVEL,
    meta: Mapping[str, str] | None = None,
    stats: EncodeStats | None = None,
) -> Iterator[Any]:
    """Stream the delta blob of ``extract_delta``'s result (format version 2, sum64
    checksums): gaps and XORs packed and zstd-compressed on the CPU, nothing else read.
    It applies exactly like the CRC-32 blob ``iter_encode_delta`` makes of the same
    states."""
    seg = changes.segment_elems
    stats = stats if stats is not None else EncodeStats("delta")
    stats.kind = "delta"
    threads = threads or default_threads()

    def jobs() -> Iterator[Any]:
        for i, (spec, found) in enumerate(zip(changes.specs, changes.chunks, strict=True)):
            numel = spec.numel
            isz = torch_dtype(spec.dtype).itemsize
            stats.num_params += numel
            stats.raw_bytes += numel * isz
            nseg = -(-numel // seg)
            yield _TensorStart(i, nseg)
            by_start = {c.start: c for c in found}
            si = 0
            while si < nseg:
                c = by_start.get(si * seg)
                if c is None:
                    yield (None, min(seg, numel - si * seg))
                    si += 1
                    continue
                lo = c.first
                for j, hi in enumerate(c.ends.tolist()):
                    s0 = c.start + j * seg
                    yield ((c, lo, hi, j), min(seg, numel - s0))
                    lo = hi
                si += c.ends.size

    def fn(job):
        if isinstance(job, _TensorStart):
            return job
        where, count = job
        if where is None:
            return _segment(Mode.UNCHANGED, 0, 0, 0, b"", b"", 0, 0, True)
        c, lo, hi, j = where
        pos = c.pos[lo:hi].astype(np.int64)
        pos -= c.shift + j * seg  # pass positions -> positions in the segment
        return _encode_extracted_segment(pos, c.xor[lo:hi], count, int(c.sum_old[j]),
                                         int(c.sum_new[j]), level)

    return _assemble(KIND_DELTA, changes.specs, jobs(), fn, threads, seg, meta or {}, stats,
                     sum64=True)


__all__ = [
    "ExtractedDelta",
    "extract_delta",
    "host_copy",
    "iter_encode_extracted",
]
