"""Bit-exact weight blobs: full checkpoints and sparse deltas in one container format.

Everything works on raw bit patterns: a bf16/fp16 tensor is read as 16-bit integers, fp32
as 32-bit integers (any fixed-size dtype works the same way by its element size), so a
round trip reproduces NaN payloads, infinities and the sign of zero exactly.

Each tensor is cut into segments of ``segment_elems`` elements, encoded independently (so
encoding streams and runs on several threads) in one of four modes:

``UNCHANGED``
    no element differs from the base; nothing stored.
``SPARSE``
    positions whose bit pattern changed, as gaps (``pos[i] - pos[i-1] - 1``, the first
    from -1) in the fewest bytes that hold the largest gap, and the XOR of old and new bit
    patterns at those positions (decode has the base; an XOR of a small update is mostly
    zero bits, which compresses far better than the new value itself).
``DENSE``
    the new bit patterns of the whole segment (used when a sparse encoding would be
    larger, and for every segment of a full checkpoint).
``DENSE_XOR``
    the XOR of old and new over the whole segment (for segments where most elements
    changed by a few low bits).

A stream of integers is stored either raw (natural little-endian order) or as zstd of its
byte planes (all first bytes, then all second bytes, ...), whichever is smaller. Each
segment carries a checksum of the base bits it reads and of the new bits it produces;
applying a delta to the wrong base raises ``BaseMismatchError`` before anything is written.

Two checksum kinds (header flag ``SUM64``):

``crc32`` (flag clear; the CPU encoders ``iter_encode_delta``/``iter_encode_full``)
    CRC-32 of the bit patterns the segment reads or writes: for SPARSE the base and new
    values at the changed positions, for DENSE the whole new segment, for DENSE_XOR the
    whole base and the whole new segment.
``sum64`` (flag set; deltas found on the tensors' own device, ``extract_delta``)
    ``sum(bits[p] * w(p)) mod 2**64`` over positions ``p`` within the segment, with
    ``w(p) = 0x9E3779B97F4A7C15 * (p + 1) mod 2**64`` and ``bits`` the unsigned bit pattern
    (zero-extended). Integer addition mod 2**64 is order-independent, so torch computes it
    exactly and deterministically on any device (int64 arithmetic wraps in two's
    complement on CPU and CUDA; the tests check it) and numpy recomputes it on the reader.
    SPARSE and DENSE_XOR sum over the changed positions (for DENSE_XOR those where the
    stored XOR is non-zero), DENSE over the whole segment. Such blobs hold no DENSE
    segments: the device copies only the changed positions and their XORs to the host.

A blob may hold a *part* of each tensor: rows ``start..stop`` of dim 0 of a tensor whose
full shape is ``shape`` (``Rows``; one process's shard under FSDP2). Its header entry then
gives the part's shape under ``"shape"`` and the full tensor under ``"rows"``; decoding
reads and writes only those rows of the full tensor in the state.

Container (all integers little-endian)::

    header   "AFWB" u16 format_version u8 kind(0 full, 1 delta) u8 flags u32 meta_len
             meta: JSON {"segment_elems", "tensors": [{"name", "dtype", "shape",
                   "rows"?: {"start", "stop", "shape"}}], "meta"}
    tensor   "T" u32 n_segments          (one per tensor, in header order; 0 = unchanged)
      segment  u8 tag = mode | flags << 2  (flags: 1 positions zstd, 2 values zstd)
               UNCHANGED  -
               SPARSE     u8 gap_width, varint n_changed, varint len_pos, varint len_val,
                          c sum_base, c sum_new, positions, values
               DENSE      varint len_val, c sum_new, values
               DENSE_XOR  varint len_val, c sum_base, c sum_new, values
    footer   u32 n_tensors "AFWE"

``c`` is a u32 CRC-32, or a u64 for ``sum64``. Format version 1: no header flags, no
``rows`` (what the CPU encoders write for whole tensors, byte for byte as before).
Version 2: header flags (``1`` = ``SUM64``; other bits refused) and ``rows`` entries; it
is written only when a blob uses either, so a reader that predates them refuses it by its
version instead of misapplying it. Readers accept both.

A segment never stores more than its raw bytes plus a header of at most 38 bytes; an
unchanged segment costs one byte and a wholly unchanged tensor five.
"""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from enum import IntEnum
from struct import Struct
from typing import Any, BinaryIO

import numpy as np
import torch
import zstandard

from astraflow.weights.errors import (
    BaseMismatchError,
    CorruptBlobError,
    UnsupportedFormatError,
    WeightsError,
)

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("astraflow.weights assumes a little-endian host")

MAGIC = b"AFWB"
END_MAGIC = b"AFWE"
FORMAT_VERSION = 1  # what blobs without rows or sum64 checksums are written as
FORMAT_VERSIONS = (1, 2)  # what this code reads
CODEC_NAME = "astraflow-wblob-v1"
KIND_FULL = 0
KIND_DELTA = 1
KIND_NAMES = {KIND_FULL: "full", KIND_DELTA: "delta"}
DEFAULT_SEGMENT_ELEMS = 1 << 22
DEFAULT_LEVEL = 1

_HEADER = Struct("<4sHBBI")
_TENSOR = Struct("<cI")
_CRC1 = Struct("<I")
_CRC2 = Struct("<II")
_SUM1 = Struct("<Q")
_SUM2 = Struct("<QQ")
_FOOTER = Struct("<I4s")
_F_POS_ZSTD = 1
_F_VAL_ZSTD = 2
_HF_SUM64 = 1  # header flag (format version 2): segments carry sum64 checksums
_SCAN_CHUNK = 1 << 17  # elements compared per numpy call: keeps both chunks in L2
_MIN_COMPRESS = 32
# sum64 weights: w(p) = _SUM_MULT * (p + 1) mod 2**64 (odd, so w(p) != 0 for p < 2**63)
_SUM_MULT = 0x9E3779B97F4A7C15
_SUM_MULT_I64 = _SUM_MULT - (1 << 64)  # the same bits as a signed int64 (torch has no u64)
_DEVICE_CHUNK = 1 << 26  # elements compared per device pass (whole segments at least)

_INT_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_NP: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

StateDict = Mapping[str, torch.Tensor]
BlobSource = bytes | bytearray | memoryview | BinaryIO


class Mode(IntEnum):
    """How one segment is stored."""

    UNCHANGED = 0
    SPARSE = 1
    DENSE = 2
    DENSE_XOR = 3


def default_threads() -> int:
    """``min(4, cpu count)``."""
    return max(1, min(4, os.cpu_count() or 1))


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


@dataclass(frozen=True)
class Rows:
    """Rows ``start..stop`` (``stop`` excluded) of dim 0 of a tensor whose full shape is
    ``shape``: the part of it one process holds (FSDP2's ``Shard(0)``). The part's own
    shape is ``(stop - start, *shape[1:])``; ``start == stop`` is a part with no rows."""

    start: int
    stop: int
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        shape = tuple(int(d) for d in self.shape)
        object.__setattr__(self, "shape", shape)
        if not shape or any(d < 0 for d in shape):
            raise ValueError(f"Rows needs a shape of at least one dimension, got {list(shape)}")
        if not 0 <= self.start <= self.stop <= shape[0]:
            raise ValueError(
                f"rows {self.start}..{self.stop} are not within dim 0 of shape {list(shape)}"
            )

    @property
    def part_shape(self) -> tuple[int, ...]:
        """Shape of the part: ``(stop - start, *shape[1:])``."""
        return (self.stop - self.start, *self.shape[1:])

    @property
    def row_elems(self) -> int:
        """Elements in one row (the product of ``shape[1:]``)."""
        return math.prod(self.shape[1:])


@dataclass
class TensorSummary:
    """One tensor of a blob, as ``inspect_blob`` sees it. For a part, ``rows`` is
    ``[start, stop]`` of dim 0 and ``full_shape`` the whole tensor's shape."""

    name: str
    dtype: str
    shape: list[int]
    mode: str
    num_changed: int
    encoded_bytes: int
    segments: dict[str, int]
    rows: list[int] | None = None
    full_shape: list[int] | None = None


@dataclass
class BlobInfo:
    """Header and per-tensor summary of a blob (nothing is decompressed). ``checksum`` is
    the segments' checksum kind: ``crc32`` or ``sum64``."""

    kind: str
    format_version: int
    segment_elems: int
    meta: dict[str, str]
    tensors: list[TensorSummary]
    total_bytes: int
    checksum: str = "crc32"

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def num_changed(self) -> int:
        return sum(t.num_changed for t in self.tensors)


@dataclass
class TensorSpec:
    """A tensor as a blob header names it: ``shape`` is what the blob holds (a part's
    shape when ``rows`` is set)."""

    name: str
    dtype: str
    shape: list[int]
    rows: Rows | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def full_shape(self) -> list[int]:
        """Shape of the whole tensor the blob's elements belong to."""
        return list(self.rows.shape) if self.rows is not None else self.shape

    @property
    def offset(self) -> int:
        """Index of the blob's first element in the whole tensor, flattened."""
        return self.rows.start * self.rows.row_elems if self.rows is not None else 0

    def row_span(self) -> tuple[int, int, int]:
        """(first row, end row, rows of the whole tensor); a 0-d tensor is one row."""
        if self.rows is not None:
            return self.rows.start, self.rows.stop, self.rows.shape[0]
        n = self.shape[0] if self.shape else 1
        return 0, n, n


@dataclass
class _Header:
    kind: int
    segment_elems: int
    tensors: list[TensorSpec]
    meta: dict[str, str]
    version: int = FORMAT_VERSION
    sum64: bool = False


# --------------------------------------------------------------------------- helpers


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def _torch_dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise CorruptBlobError(f"unknown dtype {name!r} in blob header")
    return dt


def _flat_cpu(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.contiguous().reshape(-1)


def _bits(flat: torch.Tensor) -> np.ndarray:
    """Unsigned-integer numpy view of a flat contiguous CPU tensor's bit patterns."""
    size = flat.element_size()
    if size not in _INT_TORCH:
        raise TypeError(f"dtype {flat.dtype} is not supported (element size {size})")
    return flat.view(_INT_TORCH[size]).numpy().view(_UINT_NP[size])


def _as_bytes(a: np.ndarray) -> memoryview:
    return memoryview(np.ascontiguousarray(a)).cast("B")


class _Local(threading.local):
    def __init__(self) -> None:
        self.cctx: dict[int, zstandard.ZstdCompressor] = {}
        self.dctx: zstandard.ZstdDecompressor | None = None
        self.scratch = np.empty(_SCAN_CHUNK, dtype=bool)


_LOCAL = _Local()


def _cctx(level: int) -> zstandard.ZstdCompressor:
    """Thread-local compressor. Level 1 (the default) is zstd's fast strategy with 7-byte
    minimum matches and a small hash table: on byte planes of weights most of the gain is
    entropy coding, and this is both faster and a little smaller than stock level 1.
    Other levels are zstd's own."""
    c = _LOCAL.cctx.get(level)
    if c is None:
        frame = dict(write_content_size=True, write_checksum=False, write_dict_id=False)
        if level == 1:
            params = zstandard.ZstdCompressionParameters(
                strategy=zstandard.STRATEGY_FAST,
                min_match=7,
                hash_log=10,
                search_log=1,
                window_log=17,
                **frame,
            )
        else:
            params = zstandard.ZstdCompressionParameters.from_level(level, **frame)
        c = _LOCAL.cctx[level] = zstandard.ZstdCompressor(compression_params=params)
    return c


def _dctx() -> zstandard.ZstdDecompressor:
    if _LOCAL.dctx is None:
        _LOCAL.dctx = zstandard.ZstdDecompressor()
    return _LOCAL.dctx


def _changes(o: np.ndarray, n: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, old bits, new bits) where the bit patterns differ.

    Compares in cache-sized chunks and gathers the values while the chunk is still in
    cache; no Python work per element.
    """
    scratch = _LOCAL.scratch
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


def _split_planes(a: np.ndarray, width: int) -> np.ndarray:
    """Byte planes of unsigned integers: plane k holds byte k (little-endian) of each one."""
    out = np.empty((width, a.size), dtype=np.uint8)
    for k in range(width):
        np.copyto(out[k], a >> (8 * k) if k else a, casting="unsafe")
    return out


def _merge_planes(planes: np.ndarray, out: np.ndarray) -> None:
    """Inverse of ``_split_planes`` into ``out`` (shift/or passes: no strided copies)."""
    np.copyto(out, planes[0], casting="unsafe")
    for k in range(1, planes.shape[0]):
        out |= planes[k].astype(out.dtype) << (8 * k)


def _pack(a: np.ndarray, width: int, level: int | None) -> tuple[Any, bool]:
    """Integers -> (payload, zstd?). Keeps the low ``width`` bytes of each element."""
    isz = a.dtype.itemsize
    raw_len = a.size * width
    if level is not None and raw_len >= _MIN_COMPRESS:
        z = _cctx(level).compress(_split_planes(a, width))
        if len(z) < raw_len:
            return z, True
    if width == isz:
        return _as_bytes(a), False
    return _as_bytes(a.view(np.uint8).reshape(-1, isz)[:, :width]), False


def _decompress(payload: Any, expected: int) -> bytes:
    try:
        size = zstandard.frame_content_size(payload)
    except zstandard.ZstdError as e:
        raise CorruptBlobError(f"bad zstd frame header: {e}") from e
    if size != expected:
        raise CorruptBlobError(f"zstd frame holds {size} bytes, segment needs {expected}")
    try:
        data = _dctx().decompress(payload, max_output_size=expected)
    except zstandard.ZstdError as e:
        raise CorruptBlobError(f"zstd frame does not decompress: {e}") from e
    if len(data) != expected:
        raise CorruptBlobError(f"zstd frame gave {len(data)} bytes, expected {expected}")
    return data


def _unpack(
    payload: Any, zflag: bool, count: int, isz: int, width: int, out: np.ndarray | None = None
) -> np.ndarray:
    """Inverse of ``_pack``: ``count`` unsigned integers of ``isz`` bytes (into ``out``)."""
    n = count * width
    if out is None:
        out = np.empty(count, dtype=_UINT_NP[isz])
    if zflag:
        planes = np.frombuffer(_decompress(payload, n), dtype=np.uint8).reshape(width, count)
        _merge_planes(planes, out)
        return out
    if len(payload) != n:
        raise CorruptBlobError(f"raw stream has {len(payload)} bytes, expected {n}")
    src = np.frombuffer(payload, dtype=np.uint8).reshape(count, width)
    ob = out.view(np.uint8).reshape(count, isz)
    ob[:, :width] = src
    if width < isz:
        ob[:, width:] = 0
    return out


def _gap_width(gmax: int) -> int:
    for w in (1, 2, 3, 4):
        if gmax < 1 << (8 * w):
            return w
    return 8


def _gaps(pos: np.ndarray) -> tuple[np.ndarray, int]:
    """Increasing positions -> (gaps as uint32/uint64, bytes per gap)."""
    gaps = np.empty(pos.size, dtype=np.int64)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    width = _gap_width(int(gaps.max()))
    return gaps.astype(np.uint32 if width <= 4 else np.uint64), width


# --------------------------------------------------------------------------- sum64

_WEIGHTS_LOCK = threading.Lock()
_WEIGHTS = np.empty(0, dtype=np.uint64)


def _dense_weights(n: int) -> np.ndarray:
    """``w(0..n-1)`` (read-only; one array shared by every thread, grown on demand)."""
    global _WEIGHTS
    w = _WEIGHTS
    if w.size < n:
        with _WEIGHTS_LOCK:
            if _WEIGHTS.size < n:
                w = np.arange(1, n + 1, dtype=np.uint64)
                w *= np.uint64(_SUM_MULT)
                w.flags.writeable = False
                _WEIGHTS = w
            w = _WEIGHTS
    return w[:n]


def _sum64(vals: np.ndarray, pos: np.ndarray | None = None) -> int:
    """``sum(vals[i] * w(pos[i])) mod 2**64`` (``pos`` None: ``pos[i] = i``); numpy's
    unsigned arithmetic wraps by definition."""
    v = vals.astype(np.uint64)
    if pos is None:
        v *= _dense_weights(v.size)
    else:
        w = pos.astype(np.uint64)
        w += np.uint64(1)
        w *= np.uint64(_SUM_MULT)
        v *= w
    return int(v.sum(dtype=np.uint64))


def _digest(vals: np.ndarray, pos: np.ndarray | None, sum64: bool) -> int:
    """A segment checksum of ``vals`` (at ``pos``, for sum64), of the blob's kind."""
    return _sum64(vals, pos) if sum64 else zlib.crc32(vals)


def _torch_u64(bits: torch.Tensor) -> torch.Tensor:
    """Signed integer bit patterns -> int64 holding their unsigned (zero-extended) value."""
    if bits.dtype == torch.int64:
        return bits
    wide = bits.to(torch.int64)
    if bits.dtype == torch.int16:
        wide &= 0xFFFF
    elif bits.dtype == torch.int32:
        wide &= 0xFFFFFFFF
    return wide  # uint8 is zero-extended already


def _torch_weighted(bits: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """``bits[i] * w(pos[i])`` as int64 on ``bits``' device. Relies on int64 products
    wrapping mod 2**64 (two's complement), as torch's kernels do on CPU and CUDA."""
    return _torch_u64(bits) * ((pos + 1) * _SUM_MULT_I64)


# --------------------------------------------------------------------------- encoding


@dataclass
class _SegOut:
    mode: Mode
    parts: tuple[Any, ...]
    num_changed: int
    nbytes: int


@dataclass
class _TensorStart:
    index: int
    n_segments: int


def _uvarint(v: int) -> bytes:
    out = bytearray()
    while v >= 0x80:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _segment(mode: Mode, flags: int, width: int, k: int, pos: Any, val: Any, cb: int, cn: int,
             sum64: bool = False):
    one, two = (_SUM1, _SUM2) if sum64 else (_CRC1, _CRC2)
    hdr = bytes((mode | flags << 2,))
    if mode == Mode.SPARSE:
        hdr += bytes((width,)) + _uvarint(k) + _uvarint(len(pos)) + _uvarint(len(val))
        hdr += two.pack(cb, cn)
    elif mode == Mode.DENSE:
        hdr += _uvarint(len(val)) + one.pack(cn)
    elif mode == Mode.DENSE_XOR:
        hdr += _uvarint(len(val)) + two.pack(cb, cn)
    parts = (hdr, pos, val) if len(pos) else (hdr, val) if len(val) else (hdr,)
    return _SegOut(mode, parts, k, len(hdr) + len(pos) + len(val))


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


def _pipeline(items: Iterable[Any], fn: Callable[[Any], Any], threads: int) -> Iterator[Any]:
    """Ordered map with at most ``4 * threads`` items in flight (inline when threads == 1)."""
    if threads <= 1:
        for it in items:
            yield fn(it)
        return
    window = 4 * threads
    with ThreadPoolExecutor(threads, thread_name_prefix="astraflow-weights") as ex:
        q: deque = deque()
        try:
            for it in items:
                q.append(ex.submit(fn, it))
                if len(q) >= window:
                    yield q.popleft().result()
            while q:
                yield q.popleft().result()
        finally:
            for f in q:
                f.cancel()


def _spec_json(s: TensorSpec) -> dict[str, Any]:
    d: dict[str, Any] = {"name": s.name, "dtype": s.dtype, "shape": s.shape}
    if s.rows is not None:
        d["rows"] = {"start": s.rows.start, "stop": s.rows.stop, "shape": list(s.rows.shape)}
    return d


def _header_bytes(kind: int, specs: list[TensorSpec], seg: int, meta: Mapping[str, str],
                  sum64: bool = False) -> bytes:
    body = json.dumps(
        {
            "segment_elems": seg,
            "tensors": [_spec_json(s) for s in specs],
            "meta": {str(k): str(v) for k, v in meta.items()},
        },
        separators=(",", ":"),
    ).encode()
    # Version 1 exactly as before unless the blob needs what a version-1 reader lacks.
    flags = _HF_SUM64 if sum64 else 0
    version = 2 if flags or any(s.rows is not None for s in specs) else 1
    return _HEADER.pack(MAGIC, version, kind, flags, len(body)) + body


def _tensor_mode(segment_modes: set[str]) -> str:
    """A tensor's mode from its segments' modes: unchanged, sparse, dense or mixed."""
    modes = segment_modes - {"unchanged"}
    if not modes:
        return "unchanged"
    if modes == {"sparse"}:
        return "sparse"
    return "dense" if modes <= {"dense", "dense_xor"} else "mixed"


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


# --------------------------------------------------------------------------- device deltas


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
            isz = _torch_dtype(spec.dtype).itemsize
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


# --------------------------------------------------------------------------- decoding


class _Reader:
    """Exact reads from bytes (zero-copy) or a binary file object."""

    def __init__(self, src: BlobSource):
        if isinstance(src, bytes | bytearray | memoryview):
            self.buf: memoryview | None = memoryview(src).cast("B")
            self.f = None
        else:
            self.buf = None
            self.f = src
        self.pos = 0

    def read(self, n: int, what: str) -> Any:
        if self.buf is not None:
            if self.pos + n > len(self.buf):
                raise CorruptBlobError(f"blob truncated in {what} at byte {self.pos}")
            out = self.buf[self.pos : self.pos + n]
        else:
            out = self.f.read(n)  # type: ignore[union-attr]
            if len(out) != n:
                raise CorruptBlobError(f"blob truncated in {what} at byte {self.pos}")
        self.pos += n
        return out

    def uvarint(self, what: str) -> int:
        v = shift = 0
        while True:
            b = self.read(1, what)[0]
            v |= (b & 0x7F) << shift
            if b < 0x80:
                return v
            shift += 7
            if shift > 63:
                raise CorruptBlobError(f"bad varint in {what}")

    def at_end(self) -> bool:
        if self.buf is not None:
            return self.pos == len(self.buf)
        return self.f.read(1) == b""  # type: ignore[union-attr]


def _read_header(r: _Reader) -> _Header:
    raw = r.read(_HEADER.size, "header")
    magic, version, kind, flags, mlen = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise UnsupportedFormatError(
            f"not an AstraFlow weight blob: magic {bytes(magic)!r}, expected {MAGIC!r}"
        )
    if version not in FORMAT_VERSIONS:
        raise UnsupportedFormatError(
            f"weight blob format version {version}; this code reads versions "
            f"{', '.join(map(str, FORMAT_VERSIONS))}"
        )
    if version == 1:
        flags = 0  # version 1 has no header flags (its writers left the byte 0)
    elif flags & ~_HF_SUM64:
        raise UnsupportedFormatError(f"weight blob header flags {flags:#x} are not known here")
    if kind not in KIND_NAMES:
        raise UnsupportedFormatError(f"unknown blob kind {kind}")
    try:
        meta = json.loads(bytes(r.read(mlen, "header metadata")))
        specs = [_parse_spec(t, version) for t in meta["tensors"]]
        seg = int(meta["segment_elems"])
        user = {str(k): str(v) for k, v in meta.get("meta", {}).items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlobError(f"bad blob header metadata: {e}") from e
    if not 1 <= seg <= 1 << 31:
        raise CorruptBlobError(f"bad segment size {seg}")
    for s in specs:
        _torch_dtype(s.dtype)
    return _Header(kind, seg, specs, user, version, bool(flags & _HF_SUM64))


def _parse_spec(t: dict[str, Any], version: int) -> TensorSpec:
    spec = TensorSpec(str(t["name"]), str(t["dtype"]), [int(d) for d in t["shape"]])
    r = t.get("rows") if version >= 2 else None
    if r is not None:
        spec.rows = Rows(int(r["start"]), int(r["stop"]), tuple(int(d) for d in r["shape"]))
        if tuple(spec.shape) != spec.rows.part_shape:
            raise ValueError(f"{spec.name}: shape {spec.shape} is not that of its rows")
    return spec


@dataclass
class _Seg:
    tensor: int
    index: int
    start: int
    end: int
    mode: Mode
    flags: int
    width: int
    num_changed: int
    pos: Any
    val: Any
    crc_base: int
    crc_new: int
    nbytes: int


def _iter_records(r: _Reader, h: _Header) -> Iterator[_TensorStart | _Seg]:
    one, two = (_SUM1, _SUM2) if h.sum64 else (_CRC1, _CRC2)
    for ti, spec in enumerate(h.tensors):
        tag, nseg = _TENSOR.unpack(r.read(_TENSOR.size, f"tensor record {spec.name}"))
        numel = spec.numel
        expected = -(-numel // h.segment_elems)
        if tag != b"T" or nseg not in (0, expected):
            raise CorruptBlobError(f"bad tensor record for {spec.name}: {tag!r} {nseg} segments")
        yield _TensorStart(ti, nseg)
        for si in range(nseg):
            where = f"segment {spec.name}[{si}]"
            seg_start = r.pos
            tag = r.read(1, where)[0]
            start = si * h.segment_elems
            end = min(numel, start + h.segment_elems)
            if tag & 3 > Mode.DENSE_XOR or tag >> 4:
                raise CorruptBlobError(f"{where}: bad segment tag {tag:#x}")
            m, flags = Mode(tag & 3), tag >> 2
            width, k, lp, lv, cb, cn = 0, 0, 0, 0, 0, 0
            if m == Mode.SPARSE:
                width = r.read(1, where)[0]
                k, lp, lv = r.uvarint(where), r.uvarint(where), r.uvarint(where)
                cb, cn = two.unpack(r.read(two.size, where))
            elif m == Mode.DENSE:
                k, lv = end - start, r.uvarint(where)
                (cn,) = one.unpack(r.read(one.size, where))
            elif m == Mode.DENSE_XOR:
                k, lv = end - start, r.uvarint(where)
                cb, cn = two.unpack(r.read(two.size, where))
            if k > end - start or width not in (0, 1, 2, 3, 4, 8):
                raise CorruptBlobError(f"{where}: bad segment header")
            pos = r.read(lp, where)
            val = r.read(lv, where)
            yield _Seg(ti, si, start, end, m, flags, width, k, pos, val, cb, cn, r.pos - seg_start)
    n, end_magic = _FOOTER.unpack(r.read(_FOOTER.size, "footer"))
    if end_magic != END_MAGIC or n != len(h.tensors):
        raise CorruptBlobError("bad blob footer")
    if not r.at_end():
        raise CorruptBlobError("trailing bytes after the blob footer")


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


def read_header(blob: BlobSource) -> tuple[str, list[TensorSpec], dict[str, str]]:
    """(kind, tensors, meta) from a blob's header; reads only the header. A part's
    ``TensorSpec.rows`` says which rows of which tensor it holds."""
    h = _read_header(_Reader(blob))
    return KIND_NAMES[h.kind], h.tensors, h.meta


def _is_part(h: _Header) -> bool:
    return any(s.rows is not None for s in h.tensors)


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
                    t = torch.empty(spec.shape, dtype=_torch_dtype(spec.dtype))
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
) -> dict[str, torch.Tensor]:
    """Apply any blob: a delta to ``state``, or a full checkpoint (``state`` may be None).

    For a full checkpoint with ``inplace`` and a matching ``state``, the tensors of
    ``state`` are overwritten; otherwise new tensors are returned. A part (rows of dim 0)
    writes only its rows of the full tensors of ``state`` (in place, or into copies of
    ``state`` when not ``inplace``); a full part needs a ``state``
    (``BaseMismatchError`` without one).
    """
    r = _Reader(blob)
    h = _read_header(r)
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


def _check_coverage(headers: list[_Header], state: StateDict) -> None:
    """Every element of every tensor of ``state`` in exactly one of the blobs, judged from
    their headers (whole tensors or rows of dim 0); raises ``CorruptBlobError`` naming
    the first tensor with a gap or an overlap."""
    spans: dict[str, list[tuple[int, int, int]]] = {}
    for i, h in enumerate(headers):
        for spec in h.tensors:
            start, stop, _ = spec.row_span()
            spans.setdefault(spec.name, []).append((start, stop, i))
    for name, t in state.items():
        n = t.shape[0] if t.dim() else 1
        at, last = 0, None
        for start, stop, i in sorted(spans.get(name, [])):
            if start == stop:
                continue
            if start < at:
                raise CorruptBlobError(
                    f"parts overlap: rows {start}..{min(at, stop)} of {name} are in parts "
                    f"{last} and {i}"
                )
            if start > at:
                break
            at, last = stop, i
        if at < n:
            nxt = min((s for s, e, _ in spans.get(name, []) if s >= at and e > s), default=n)
            raise CorruptBlobError(f"no part holds rows {at}..{nxt} of {name} ({n} rows)")


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
    _check_coverage([h for _, h in parts], state)
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


def inspect_blob(blob: BlobSource) -> BlobInfo:
    """Parse a blob's header and segment table; payloads are skipped, not decompressed."""
    r = _Reader(blob)
    h = _read_header(r)
    tensors = [
        TensorSummary(s.name, s.dtype, s.shape, "unchanged", 0, _TENSOR.size, {},
                      [s.rows.start, s.rows.stop] if s.rows is not None else None,
                      list(s.rows.shape) if s.rows is not None else None)
        for s in h.tensors
    ]
    for rec in _iter_records(r, h):
        if isinstance(rec, _TensorStart):
            continue
        t = tensors[rec.tensor]
        t.num_changed += rec.num_changed
        t.encoded_bytes += rec.nbytes
        name = rec.mode.name.lower()
        t.segments[name] = t.segments.get(name, 0) + 1
    for t in tensors:
        t.mode = _tensor_mode(set(t.segments))
    return BlobInfo(KIND_NAMES[h.kind], h.version, h.segment_elems, h.meta, tensors, r.pos,
                    "sum64" if h.sum64 else "crc32")


def state_bytes_equal(a: StateDict, b: StateDict) -> bool:
    """True when both state dicts hold the same names, dtypes, shapes and raw bytes."""
    if set(a) != set(b):
        return False
    for name, t in a.items():
        u = b[name]
        if t.dtype != u.dtype or tuple(t.shape) != tuple(u.shape):
            return False
        if not np.array_equal(_bits(_flat_cpu(t)), _bits(_flat_cpu(u))):
            return False
    return True


__all__ = [
    "CODEC_NAME",
    "BlobInfo",
    "EncodeStats",
    "ExtractedDelta",
    "Mode",
    "Rows",
    "TensorSpec",
    "TensorSummary",
    "apply_blob",
    "apply_delta",
    "apply_parts",
    "decode_full",
    "default_threads",
    "dtype_name",
    "empty_state",
    "encode_delta",
    "encode_full",
    "extract_delta",
    "host_copy",
    "inspect_blob",
    "iter_encode_delta",
    "iter_encode_extracted",
    "iter_encode_full",
    "read_header",
    "state_bytes_equal",
]
