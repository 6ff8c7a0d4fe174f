"""Reading blobs into state dicts: ``apply_delta``, ``decode_full``, ``apply_blob`` (either
kind) and ``apply_parts`` (the blobs of one version, one per process), and
``empty_state`` to write a full checkpoint's parts into.

Every segment is decoded and checked against its checksums before anything is written,
so a bad blob or a wrong base leaves the state as it was.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import numpy as np
import torch

from astraflow.weights.bits import StateDict, _bits, _flat_cpu, dtype_name, torch_dtype
from astraflow.weights.blob import (
    _F_POS_ZSTD,
    _F_VAL_ZSTD,
    KIND_DELTA,
    KIND_FULL,
    BlobSource,
    Mode,
    TensorSpec,
    _Header,
    _is_part,
    _iter_records,
    _read_header,
    _Reader,
    _Seg,
    _TensorStart,
)
from astraflow.weights.checksums import _digest
from astraflow.weights.coverage import check_coverage
from astraflow.weights.errors import BaseMismatchError, CorruptBlobError, WeightsError
from astraflow.weights.packing import _unpack
from astraflow.weights.pipeline import _pipeline, default_threads


def _decode_segment(s: _Seg, base: np.ndarray | None, isz: int, out: np.ndarray | None,
                    sum64: bool = False):
    """Decode one segment against ``base`` (the segment's current bits). Returns an op.

    Nothing is written to ``base``. For DENSE segments with ``out`` given, the values are
    decoded straight into ``out`` (used by full decode into fresh memory).
    """
    count = s.end - s.start
    if s.mode == Mode.UNCHANGED:
        return None
    if s.mode == Mode.SPARSE:
        if base is None:
            raise CorruptBlobError("sparse segment in a full checkpoint")
        k = s.num_changed
        if k == 0:
            raise CorruptBlobError("sparse segment with no changes")
        gaps = _unpack(s.pos, bool(s.flags & _F_POS_ZSTD), k, 8 if s.width > 4 else 4, s.width)
        last = int(gaps.sum(dtype=np.uint64)) + k - 1
        if last >= count:
            raise CorruptBlobError(f"position {last} beyond segment of {count} elements")
        idt = np.int32 if count <= 1 << 31 else np.int64
        pos = np.cumsum(gaps, dtype=idt)
        pos += np.arange(k, dtype=idt)
        x = _unpack(s.val, bool(s.flags & _F_VAL_ZSTD), k, isz, isz)
        cur = base[pos]
        if _digest(cur, pos, sum64) != s.crc_base:
            raise BaseMismatchError("delta does not match the state it is applied to")
        cur ^= x
        if _digest(cur, pos, sum64) != s.crc_new:
            raise CorruptBlobError("decoded values fail their checksum")
        return (pos, cur)
    if s.mode == Mode.DENSE:
        v = _unpack(s.val, bool(s.flags & _F_VAL_ZSTD), count, isz, isz, out=out)
    else:
        if base is None:
            raise CorruptBlobError("xor segment in a full checkpoint")
        v = _unpack(s.val, bool(s.flags & _F_VAL_ZSTD), count, isz, isz, out=out)
        # sum64 covers the changed positions only (those the device copied out)
        changed = np.flatnonzero(v) if sum64 else None
        if _digest(base if changed is None else base[changed], changed, sum64) != s.crc_base:
            raise BaseMismatchError("delta does not match the state it is applied to")
        if not v.flags.writeable:
            v = v.copy()
        v ^= base
        if sum64:
            if _digest(v[changed], changed, True) != s.crc_new:
                raise CorruptBlobError("decoded values fail their checksum")
            return (None, v)
    if _digest(v, None, sum64) != s.crc_new:
        raise CorruptBlobError("decoded values fail their checksum")
    return (None, v)


def _check_state(h: _Header, state: StateDict, what: str) -> None:
    for spec in h.tensors:
        t = state.get(spec.name)
        if t is None:
            raise BaseMismatchError(f"{what}: state has no tensor {spec.name!r}")
        if dtype_name(t.dtype) != spec.dtype or list(t.shape) != spec.full_shape:
            part = (f" (rows {spec.rows.start}..{spec.rows.stop} of it)"
                    if spec.rows is not None else "")
            raise BaseMismatchError(
                f"{what}: {spec.name} is {dtype_name(t.dtype)} {list(t.shape)} in the state, "
                f"{spec.dtype} {spec.full_shape}{part} in the blob"
            )


def apply_delta(
    state: StateDict,
    blob: BlobSource,
    *,
    inplace: bool = False,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Apply a delta blob to ``state`` and return the new version's state dict.

    Every segment is decoded and checked (checksum of the base bits it reads, of the bits
    it produces) before anything is written, so a bad blob or a wrong base leaves the input
    untouched. With ``inplace`` the tensors of ``state`` are updated and returned in a new
    dict; otherwise the input is left alone and copies are returned. A part (rows of dim
    0) changes only its rows of the full tensors in ``state``.
    """
    r = _Reader(blob)
    h = _read_header(r)
    if h.kind != KIND_DELTA:
        raise WeightsError("blob is a full checkpoint: use decode_full or apply_blob")
    return _apply_deltas([(r, h)], state, inplace, threads or default_threads())


def _apply_deltas(parts: list[tuple[_Reader, _Header]], state: StateDict, inplace: bool,
                  threads: int) -> dict[str, torch.Tensor]:
    for _, h in parts:
        _check_state(h, state, "apply_delta")
    flats: dict[str, torch.Tensor] = {}
    ops: list[tuple[str, int, _Seg, Any]] = []
    for r, h in parts:
        ops += _decoded_segments(r, h, state, threads, flats)
    # Every segment of every part decoded and checked: now write.
    targets, copies = _write_targets(state, flats, inplace)

    def write(item):
        name, offset, s, (pos, v) = item
        dst = targets[name][offset + s.start : offset + s.end]
        if pos is None:
            dst[:] = v
        else:
            dst[pos] = v

    for _ in _pipeline(ops, write, threads):
        pass
    return _applied_state(state, copies, inplace)


def _decoded_segments(r: _Reader, h: _Header, state: StateDict, threads: int,
                      flats: dict[str, torch.Tensor]) -> list[tuple[str, int, _Seg, Any]]:
    """Decode and check every segment of the delta against ``state``: fills ``flats`` with
    the flat CPU view (or copy) of each changed tensor, by name, and returns the segments'
    write operations as (name, offset of the blob's first element, segment, op)."""
    bits: dict[int, np.ndarray] = {}

    def jobs() -> Iterator[Any]:
        for rec in _iter_records(r, h):
            if isinstance(rec, _TensorStart):
                if rec.n_segments:
                    spec = h.tensors[rec.index]
                    f = flats.get(spec.name)
                    if f is None:
                        f = flats[spec.name] = _flat_cpu(state[spec.name])
                    bits[rec.index] = _bits(f)[spec.offset : spec.offset + spec.numel]
                continue
            yield rec

    def fn(s: _Seg):
        b = bits[s.tensor]
        return s, _decode_segment(s, b[s.start : s.end], b.itemsize, None, h.sum64)

    return [(h.tensors[s.tensor].name, h.tensors[s.tensor].offset, s, op)
            for s, op in _pipeline(jobs(), fn, threads) if op is not None]


def _write_targets(state: StateDict, flats: dict[str, torch.Tensor], inplace: bool
                   ) -> tuple[dict[str, np.ndarray], dict[str, torch.Tensor]]:
    """Where each changed tensor's new bits are written (by name), and the private copies
    among them (those that must be put back into a tensor afterwards)."""
    targets: dict[str, np.ndarray] = {}
    copies: dict[str, torch.Tensor] = {}
    for name, flat in flats.items():
        t = state[name]
        shares = t.device.type == "cpu" and t.is_contiguous()
        if inplace and shares:
            target = flat  # a view of t
        else:
            # flat is already a private CPU copy when t is on a GPU or not contiguous.
            target = flat.clone() if shares else flat
            copies[name] = target
        targets[name] = _bits(target)
    return targets, copies


def _applied_state(state: StateDict, copies: dict[str, torch.Tensor], inplace: bool
                   ) -> dict[str, torch.Tensor]:
    """The new state: the written copies put in place (or returned), the rest as they are
    (``inplace``) or cloned."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, t in state.items():
            if name in copies:
                new_t = copies[name].reshape(t.shape)
                if inplace:
                    t.copy_(new_t)
                    new_t = t
                elif new_t.device != t.device:
                    new_t = new_t.to(t.device)
                out[name] = new_t
            else:
                out[name] = t if inplace else t.detach().clone()
    return out


def decode_full(
    blob: BlobSource,
    *,
    out: StateDict | None = None,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Decode a full-checkpoint blob into new CPU tensors, or into the tensors of ``out``.

    Decoding into ``out`` checks names, shapes and dtypes before writing anything; callers
    verify the blob's sha256 first (the stores do), so a decode error after that point
    means a software bug, not bad data. A part (rows of dim 0) needs ``out``, the full
    tensors whose rows it overwrites (``empty_state`` makes them); it returns all of
    ``out``.
    """
    r = _Reader(blob)
    h = _read_header(r)
    if h.kind != KIND_FULL:
        raise WeightsError("blob is a delta: use apply_delta or apply_blob")
    return _decode_full(r, h, out, threads or default_threads())


def _needs_state(h: _Header) -> BaseMismatchError:
    name = next(s.name for s in h.tensors if s.rows is not None)
    return BaseMismatchError(
        f"this full checkpoint holds only some rows of its tensors ({name}, ...): it needs "
        f"a state to write them into (empty_state)"
    )


def _decode_full(
    r: _Reader, h: _Header, out: StateDict | None, threads: int
) -> dict[str, torch.Tensor]:
    part = _is_part(h)
    if out is None and part:
        raise _needs_state(h)
    if out is not None:
        _check_state(h, out, "decode_full")
    result: dict[str, torch.Tensor] = {}
    bits: dict[int, np.ndarray] = {}

    def jobs() -> Iterator[Any]:
        for rec in _iter_records(r, h):
            if isinstance(rec, _TensorStart):
                spec = h.tensors[rec.index]
                if rec.n_segments == 0 and spec.numel:
                    raise CorruptBlobError(f"full checkpoint has no data for {spec.name}")
                t = out[spec.name] if out is not None else None
                if t is None or t.device.type != "cpu" or not t.is_contiguous():
                    # a part decoded on its own (rows written into t below)
                    t = torch.empty(spec.shape, dtype=torch_dtype(spec.dtype))
                    bits[rec.index] = _bits(t.reshape(-1))
                else:
                    bits[rec.index] = _bits(t.reshape(-1))[spec.offset : spec.offset + spec.numel]
                result[spec.name] = t
                continue
            yield rec

    def fn(s: _Seg):
        if s.mode != Mode.DENSE:
            raise CorruptBlobError(f"{s.mode.name} segment in a full checkpoint")
        b = bits[s.tensor]
        _decode_segment(s, None, b.itemsize, b[s.start : s.end], h.sum64)

    for _ in _pipeline(jobs(), fn, threads):
        pass
    if out is not None:
        with torch.no_grad():
            for spec in h.tensors:
                t, got = out[spec.name], result[spec.name]
                if got is not t:
                    if spec.rows is not None:
                        t.narrow(0, spec.rows.start, spec.shape[0]).copy_(got)
                    else:
                        t.copy_(got)
                    result[spec.name] = t
        if part:
            return dict(out)
    return result


def apply_blob(
    state: StateDict | None,
    blob: BlobSource,
    *,
    inplace: bool = False,
    threads: int | None = None,
    part_alone: bool = False,
) -> dict[str, torch.Tensor]:
    """Apply any blob: a delta to ``state``, or a full checkpoint (``state`` may be None).

    For a full checkpoint with ``inplace`` and a matching ``state``, the tensors of
    ``state`` are overwritten; otherwise new tensors are returned. A part (rows of dim 0)
    writes only its rows of the full tensors of ``state`` (in place, or into copies of
    ``state`` when not ``inplace``); a full part needs a ``state``
    (``BaseMismatchError`` without one).

    ``part_alone``: the state holds this part alone, each of its tensors in the part's
    own shape (rows ``start..stop`` as rows ``0..stop-start``), as a process that follows
    only its own rows of a sharded model does; the blob's parts are then taken as whole
    tensors of those shapes.
    """
    r = _Reader(blob)
    h = _read_header(r)
    if part_alone:
        h = _part_as_whole(h)
    threads = threads or default_threads()
    if h.kind == KIND_FULL:
        if _is_part(h):
            if state is None:
                raise _needs_state(h)
            if not inplace:
                state = {k: t.detach().clone() for k, t in state.items()}
            return _decode_full(r, h, state, threads)
        target = state if (inplace and state is not None) else None
        return _decode_full(r, h, target, threads)
    if state is None:
        raise BaseMismatchError("a delta needs a base state")
    return _apply_deltas([(r, h)], state, inplace, threads)


def _part_as_whole(h: _Header) -> _Header:
    """``h`` with each tensor's rows taken as a whole tensor of the part's shape: its
    segments index the part's own elements, so they apply to it unchanged."""
    return dataclasses.replace(h, tensors=[TensorSpec(s.name, s.dtype, list(s.shape))
                                           for s in h.tensors])


def apply_parts(
    state: StateDict | None,
    blobs: Sequence[BlobSource],
    *,
    inplace: bool = False,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Apply the blobs of one manifest (one per process, each holding rows of dim 0 or
    whole tensors) as one version: together they must cover every element of every tensor
    of ``state`` exactly once, else ``CorruptBlobError`` names the tensor (judged from
    the headers, before anything is read or written).

    A delta's parts are all decoded and checked against ``state`` before any is written,
    so a bad part or a wrong base leaves ``state`` untouched; without ``inplace`` the
    changed tensors are copied once, not once per part. A full checkpoint's parts are
    written into ``state`` (``inplace``) or into new CPU tensors of its shapes; ``state``
    is needed either way (``empty_state`` makes one from a manifest's tensors).
    """
    if not blobs:
        raise CorruptBlobError("a manifest without blobs")
    parts = []
    for blob in blobs:
        r = _Reader(blob)
        parts.append((r, _read_header(r)))
    kinds = {h.kind for _, h in parts}
    if len(kinds) != 1:
        raise CorruptBlobError("the parts of one version mix full and delta blobs")
    threads = threads or default_threads()
    if state is None:
        what = "a delta needs a base state" if KIND_DELTA in kinds else (
            "a full checkpoint made of parts needs a state to write into (empty_state)")
        raise BaseMismatchError(what)
    for _, h in parts:
        _check_state(h, state, "apply_parts")
    check_coverage([h for _, h in parts], state)
    if KIND_DELTA in kinds:
        return _apply_deltas(parts, state, inplace, threads)
    target = state if inplace else {k: torch.empty(t.shape, dtype=t.dtype)
                                    for k, t in state.items()}
    for r, h in parts:
        _decode_full(r, h, target, threads)
    return dict(target)


def empty_state(tensors: Iterable[Any]) -> dict[str, torch.Tensor]:
    """Uninitialised CPU tensors for a manifest's ``TensorInfo`` list (``name``, ``shape``,
    ``dtype``): the state the parts of a full checkpoint are written into."""
    out: dict[str, torch.Tensor] = {}
    for t in tensors:
        if t.name in out:
            raise ValueError(f"tensor {t.name!r} is listed twice")
        dt = getattr(torch, str(t.dtype), None)
        if not isinstance(dt, torch.dtype):
            raise ValueError(f"{t.name}: unknown dtype {t.dtype!r}")
        out[t.name] = torch.empty([int(d) for d in t.shape], dtype=dt)
    return out


__all__ = [
    "apply_blob",
    "apply_delta",
    "apply_parts",
    "decode_full",
    "empty_state",
]
