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

This module is the container itself: its constants, the header and the tensor and segment
records as written (``_header_bytes``, ``_segment``) and read (``_Reader``,
``_iter_records``), ``read_header`` and ``inspect_blob``. Blobs are made by
``weights.encode`` (on the CPU) and ``weights.extract`` (on the tensors' device) and
applied by ``weights.apply``; ``weights.packing`` stores the integer streams and
``weights.checksums`` computes the segment checksums.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import IntEnum
from struct import Struct
from typing import Any, BinaryIO

from astraflow.weights.bits import torch_dtype
from astraflow.weights.errors import CorruptBlobError, UnsupportedFormatError

MAGIC = b"AFWB"
END_MAGIC = b"AFWE"
FORMAT_VERSION = 1  # what blobs without rows or sum64 checksums are written as
FORMAT_VERSIONS = (1, 2)  # what this code reads
CODEC_NAME = "astraflow-wblob-v1"
KIND_FULL = 0
KIND_DELTA = 1
KIND_NAMES = {KIND_FULL: "full", KIND_DELTA: "delta"}
DEFAULT_SEGMENT_ELEMS = 1 << 22

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

BlobSource = bytes | bytearray | memoryview | BinaryIO


class Mode(IntEnum):
    """How one segment is stored."""

    UNCHANGED = 0
    SPARSE = 1
    DENSE = 2
    DENSE_XOR = 3


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
        torch_dtype(s.dtype)
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


def read_header(blob: BlobSource) -> tuple[str, list[TensorSpec], dict[str, str]]:
    """(kind, tensors, meta) from a blob's header; reads only the header. A part's
    ``TensorSpec.rows`` says which rows of which tensor it holds."""
    h = _read_header(_Reader(blob))
    return KIND_NAMES[h.kind], h.tensors, h.meta


def _is_part(h: _Header) -> bool:
    return any(s.rows is not None for s in h.tensors)


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


__all__ = [
    "CODEC_NAME",
    "BlobInfo",
    "Mode",
    "Rows",
    "TensorSpec",
    "TensorSummary",
    "inspect_blob",
    "read_header",
]
