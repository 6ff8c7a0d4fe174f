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
segment carries the CRC-32 of the base bits it reads and of the new bits it produces;
applying a delta to the wrong base raises ``BaseMismatchError`` before anything is written.

Container (all integers little-endian)::

    header   "AFWB" u16 format_version u8 kind(0 full, 1 delta) u8 flags u32 meta_len
             meta: JSON {"segment_elems", "tensors": [{"name", "dtype", "shape"}], "meta"}
    tensor   "T" u32 n_segments          (one per tensor, in header order; 0 = unchanged)
      segment  u8 tag = mode | flags << 2  (flags: 1 positions zstd, 2 values zstd)
               UNCHANGED  -
               SPARSE     u8 gap_width, varint n_changed, varint len_pos, varint len_val,
                          u32 crc_base, u32 crc_new, positions, values
               DENSE      varint len_val, u32 crc_new, values
               DENSE_XOR  varint len_val, u32 crc_base, u32 crc_new, values
    footer   u32 n_tensors "AFWE"

A segment never stores more than its raw bytes plus a header of at most 30 bytes; an
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
from collections.abc import Callable, Iterable, Iterator, Mapping
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
FORMAT_VERSION = 1
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
_FOOTER = Struct("<I4s")
_F_POS_ZSTD = 1
_F_VAL_ZSTD = 2
_SCAN_CHUNK = 1 << 17  # elements compared per numpy call: keeps both chunks in L2
_MIN_COMPRESS = 32

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


@dataclass
class TensorSummary:
    """One tensor of a blob, as ``inspect_blob`` sees it."""

    name: str
    dtype: str
    shape: list[int]
    mode: str
    num_changed: int
    encoded_bytes: int
    segments: dict[str, int]


@dataclass
class BlobInfo:
    """Header and per-tensor summary of a blob (nothing is decompressed)."""

    kind: str
    format_version: int
    segment_elems: int
    meta: dict[str, str]
    tensors: list[TensorSummary]
    total_bytes: int

    @property
    def num_params(self) -> int:
        return sum(math.prod(t.shape) for t in self.tensors)

    @property
    def num_changed(self) -> int:
        return sum(t.num_changed for t in self.tensors)


@dataclass
class TensorSpec:
    name: str
    dtype: str
    shape: list[int]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class _Header:
    kind: int
    segment_elems: int
    tensors: list[TensorSpec]
    meta: dict[str, str]


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


def _segment(mode: Mode, flags: int, width: int, k: int, pos: Any, val: Any, cb: int, cn: int):
    hdr = bytes((mode | flags << 2,))
    if mode == Mode.SPARSE:
        hdr += bytes((width,)) + _uvarint(k) + _uvarint(len(pos)) + _uvarint(len(val))
        hdr += _CRC2.pack(cb, cn)
    elif mode == Mode.DENSE:
        hdr += _uvarint(len(val)) + _CRC1.pack(cn)
    elif mode == Mode.DENSE_XOR:
        hdr += _uvarint(len(val)) + _CRC2.pack(cb, cn)
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
    gaps = np.empty_like(pos)
    gaps[0] = pos[0]
    np.subtract(pos[1:], pos[:-1], out=gaps[1:])
    gaps[1:] -= 1
    width = _gap_width(int(gaps.max()))
    pp, pz = _pack(gaps.astype(np.uint32 if width <= 4 else np.uint64), width, level)
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


def _header_bytes(kind: int, specs: list[TensorSpec], seg: int, meta: Mapping[str, str]) -> bytes:
    body = json.dumps(
        {
            "segment_elems": seg,
            "tensors": [{"name": s.name, "dtype": s.dtype, "shape": s.shape} for s in specs],
            "meta": {str(k): str(v) for k, v in meta.items()},
        },
        separators=(",", ":"),
    ).encode()
    return _HEADER.pack(MAGIC, FORMAT_VERSION, kind, 0, len(body)) + body


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


def _spec(name: str, t: torch.Tensor) -> TensorSpec:
    return TensorSpec(name, dtype_name(t.dtype), list(t.shape))


def _assemble(
    kind: int,
    specs: list[TensorSpec],
    jobs: Iterator[Any],
    fn: Callable[[Any], Any],
    threads: int,
    seg: int,
    meta: Mapping[str, str],
    stats: EncodeStats,
) -> Iterator[Any]:
    t0 = time.perf_counter()
    stats.num_tensors = len(specs)
    total = 0

    def emit(parts):
        nonlocal total
        for p in parts:
            total += len(p)
            yield p

    yield from emit([_header_bytes(kind, specs, seg, meta)])
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


def _check_pair(old: StateDict, new: StateDict) -> list[TensorSpec]:
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
        specs.append(_spec(name, t))
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
) -> Iterator[Any]:
    """Stream the delta blob that turns ``old`` into ``new`` as a sequence of bytes-like pieces.

    Tensors are visited one at a time and cut into segments; at most ``4 * threads``
    segments are in flight, so memory stays at a few segments beyond the two states (plus
    one CPU copy of a tensor pair when the states live on a GPU). Pieces may be
    memoryviews into ``new``: consume them before mutating it. ``stats`` (if given) is
    filled in when the generator is exhausted.
    """
    specs = _check_pair(old, new)
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
) -> Iterator[Any]:
    """Stream a full checkpoint of ``state`` (every segment dense; zstd where it helps)."""
    specs = [_spec(name, t) for name, t in state.items()]
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
    )
    blob = b"".join(it)
    return blob, stats


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
    magic, version, kind, _flags, mlen = _HEADER.unpack(raw)
    if magic != MAGIC:
        raise UnsupportedFormatError(
            f"not an AstraFlow weight blob: magic {bytes(magic)!r}, expected {MAGIC!r}"
        )
    if version != FORMAT_VERSION:
        raise UnsupportedFormatError(
            f"weight blob format version {version}; this code reads version {FORMAT_VERSION}"
        )
    if kind not in KIND_NAMES:
        raise UnsupportedFormatError(f"unknown blob kind {kind}")
    try:
        meta = json.loads(bytes(r.read(mlen, "header metadata")))
        specs = [
            TensorSpec(str(t["name"]), str(t["dtype"]), [int(d) for d in t["shape"]])
            for t in meta["tensors"]
        ]
        seg = int(meta["segment_elems"])
        user = {str(k): str(v) for k, v in meta.get("meta", {}).items()}
    except (ValueError, KeyError, TypeError) as e:
        raise CorruptBlobError(f"bad blob header metadata: {e}") from e
    if not 1 <= seg <= 1 << 31:
        raise CorruptBlobError(f"bad segment size {seg}")
    for s in specs:
        _torch_dtype(s.dtype)
    return _Header(kind, seg, specs, user)


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
                cb, cn = _CRC2.unpack(r.read(_CRC2.size, where))
            elif m == Mode.DENSE:
                k, lv = end - start, r.uvarint(where)
                (cn,) = _CRC1.unpack(r.read(_CRC1.size, where))
            elif m == Mode.DENSE_XOR:
                k, lv = end - start, r.uvarint(where)
                cb, cn = _CRC2.unpack(r.read(_CRC2.size, where))
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


def _decode_segment(s: _Seg, base: np.ndarray | None, isz: int, out: np.ndarray | None):
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
        if zlib.crc32(cur) != s.crc_base:
            raise BaseMismatchError("delta does not match the state it is applied to")
        cur ^= x
        if zlib.crc32(cur) != s.crc_new:
            raise CorruptBlobError("decoded values fail their CRC")
        return (pos, cur)
    if s.mode == Mode.DENSE:
        v = _unpack(s.val, bool(s.flags & _F_VAL_ZSTD), count, isz, isz, out=out)
    else:
        if base is None:
            raise CorruptBlobError("xor segment in a full checkpoint")
        if zlib.crc32(base) != s.crc_base:
            raise BaseMismatchError("delta does not match the state it is applied to")
        v = _unpack(s.val, bool(s.flags & _F_VAL_ZSTD), count, isz, isz, out=out)
        if not v.flags.writeable:
            v = v.copy()
        v ^= base
    if zlib.crc32(v) != s.crc_new:
        raise CorruptBlobError("decoded values fail their CRC")
    return (None, v)


def _check_state(h: _Header, state: StateDict, what: str) -> None:
    for spec in h.tensors:
        t = state.get(spec.name)
        if t is None:
            raise BaseMismatchError(f"{what}: state has no tensor {spec.name!r}")
        if dtype_name(t.dtype) != spec.dtype or list(t.shape) != spec.shape:
            raise BaseMismatchError(
                f"{what}: {spec.name} is {dtype_name(t.dtype)} {list(t.shape)} in the state, "
                f"{spec.dtype} {spec.shape} in the blob"
            )


def read_header(blob: BlobSource) -> tuple[str, list[TensorSpec], dict[str, str]]:
    """(kind, tensors, meta) from a blob's header; reads only the header."""
    h = _read_header(_Reader(blob))
    return KIND_NAMES[h.kind], h.tensors, h.meta


def apply_delta(
    state: StateDict,
    blob: BlobSource,
    *,
    inplace: bool = False,
    threads: int | None = None,
) -> dict[str, torch.Tensor]:
    """Apply a delta blob to ``state`` and return the new version's state dict.

    Every segment is decoded and checked (CRC of the base bits it reads, CRC of the bits it
    produces) before anything is written, so a bad blob or a wrong base leaves the input
    untouched. With ``inplace`` the tensors of ``state`` are updated and returned in a new
    dict; otherwise the input is left alone and copies are returned.
    """
    r = _Reader(blob)
    h = _read_header(r)
    if h.kind != KIND_DELTA:
        raise WeightsError("blob is a full checkpoint: use decode_full or apply_blob")
    return _apply_delta(r, h, state, inplace, threads or default_threads())


def _apply_delta(
    r: _Reader, h: _Header, state: StateDict, inplace: bool, threads: int
) -> dict[str, torch.Tensor]:
    _check_state(h, state, "apply_delta")
    flats, ops = _decoded_segments(r, h, state, threads)
    # Every segment decoded and checked: now write.
    targets, copies = _write_targets(h, state, flats, inplace)

    def write(item):
        s, (pos, v) = item
        dst = targets[s.tensor][s.start : s.end]
        if pos is None:
            dst[:] = v
        else:
            dst[pos] = v

    for _ in _pipeline(ops, write, threads):
        pass
    return _applied_state(h, state, copies, inplace)


def _decoded_segments(r: _Reader, h: _Header, state: StateDict, threads: int
                      ) -> tuple[dict[int, torch.Tensor], list[tuple[_Seg, Any]]]:
    """Decode and check every segment of the delta against ``state``: the flat CPU view
    (or copy) of each changed tensor, by index, and the segments' write operations."""
    flats: dict[int, torch.Tensor] = {}
    bits: dict[int, np.ndarray] = {}

    def jobs() -> Iterator[Any]:
        for rec in _iter_records(r, h):
            if isinstance(rec, _TensorStart):
                if rec.n_segments:
                    name = h.tensors[rec.index].name
                    flats[rec.index] = f = _flat_cpu(state[name])
                    bits[rec.index] = _bits(f)
                continue
            yield rec

    def fn(s: _Seg):
        b = bits[s.tensor]
        return s, _decode_segment(s, b[s.start : s.end], b.itemsize, None)

    ops = [(s, op) for s, op in _pipeline(jobs(), fn, threads) if op is not None]
    return flats, ops


def _write_targets(h: _Header, state: StateDict, flats: dict[int, torch.Tensor],
                   inplace: bool) -> tuple[dict[int, np.ndarray], dict[int, torch.Tensor]]:
    """Where each changed tensor's new bits are written (by index), and the private copies
    among them (those that must be put back into a tensor afterwards)."""
    targets: dict[int, np.ndarray] = {}
    copies: dict[int, torch.Tensor] = {}
    for i, spec in enumerate(h.tensors):
        t = state[spec.name]
        if i not in flats:
            continue
        shares = t.device.type == "cpu" and t.is_contiguous()
        if inplace and shares:
            target = flats[i]  # a view of t
        else:
            # flats[i] is already a private CPU copy when t is on a GPU or not contiguous.
            target = flats[i].clone() if shares else flats[i]
            copies[i] = target
        targets[i] = _bits(target)
    return targets, copies


def _applied_state(h: _Header, state: StateDict, copies: dict[int, torch.Tensor],
                   inplace: bool) -> dict[str, torch.Tensor]:
    """The new state: the written copies put in place (or returned), the rest as they are
    (``inplace``) or cloned."""
    out: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for i, spec in enumerate(h.tensors):
            t = state[spec.name]
            if i in copies:
                new_t = copies[i].reshape(t.shape)
                if inplace:
                    t.copy_(new_t)
                    new_t = t
                elif new_t.device != t.device:
                    new_t = new_t.to(t.device)
                out[spec.name] = new_t
        for name, t in state.items():
            if name not in out:
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
    means a software bug, not bad data.
    """
    r = _Reader(blob)
    h = _read_header(r)
    if h.kind != KIND_FULL:
        raise WeightsError("blob is a delta: use apply_delta or apply_blob")
    return _decode_full(r, h, out, threads or default_threads())


def _decode_full(
    r: _Reader, h: _Header, out: StateDict | None, threads: int
) -> dict[str, torch.Tensor]:
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
                    t = torch.empty(spec.shape, dtype=_torch_dtype(spec.dtype))
                result[spec.name] = t
                bits[rec.index] = _bits(t.reshape(-1))
                continue
            yield rec

    def fn(s: _Seg):
        if s.mode != Mode.DENSE:
            raise CorruptBlobError(f"{s.mode.name} segment in a full checkpoint")
        b = bits[s.tensor]
        _decode_segment(s, None, b.itemsize, b[s.start : s.end])

    for _ in _pipeline(jobs(), fn, threads):
        pass
    if out is not None:
        with torch.no_grad():
            for name, t in out.items():
                if name in result and result[name] is not t:
                    t.copy_(result[name])
                    result[name] = t
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
    ``state`` are overwritten; otherwise new tensors are returned.
    """
    r = _Reader(blob)
    h = _read_header(r)
    threads = threads or default_threads()
    if h.kind == KIND_FULL:
        target = state if (inplace and state is not None) else None
        return _decode_full(r, h, target, threads)
    if state is None:
        raise BaseMismatchError("a delta needs a base state")
    return _apply_delta(r, h, state, inplace, threads)


def inspect_blob(blob: BlobSource) -> BlobInfo:
    """Parse a blob's header and segment table; payloads are skipped, not decompressed."""
    r = _Reader(blob)
    h = _read_header(r)
    tensors = [
        TensorSummary(s.name, s.dtype, s.shape, "unchanged", 0, _TENSOR.size, {}) for s in h.tensors
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
    return BlobInfo(KIND_NAMES[h.kind], FORMAT_VERSION, h.segment_elems, h.meta, tensors, r.pos)


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
    "Mode",
    "TensorSpec",
    "TensorSummary",
    "apply_blob",
    "apply_delta",
    "decode_full",
    "default_threads",
    "dtype_name",
    "encode_delta",
    "encode_full",
    "inspect_blob",
    "iter_encode_delta",
    "iter_encode_full",
    "read_header",
    "state_bytes_equal",
]
