"""How a blob stores a stream of unsigned integers: raw (little-endian, the low ``width``
bytes of each) or zstd of its byte planes (all first bytes, then all second bytes, ...),
whichever is smaller; and changed positions as gaps in the fewest bytes that hold them.

The zstd contexts are per thread (encoding and decoding run on several threads).
"""

from __future__ import annotations

import threading
from typing import Any

import numpy as np
import zstandard

from astraflow.weights.bits import _UINT_NP, _as_bytes
from astraflow.weights.errors import CorruptBlobError

DEFAULT_LEVEL = 1  # zstd level of the streams (level 1 is tuned: see _cctx)

_MIN_COMPRESS = 32  # shorter streams are stored raw without trying zstd


class _Local(threading.local):
    def __init__(self) -> None:
        self.cctx: dict[int, zstandard.ZstdCompressor] = {}
        self.dctx: zstandard.ZstdDecompressor | None = None


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
