"""The segment checksums of a blob: CRC-32 (what the CPU encoders write) and sum64 (deltas
found on the tensors' device, ``weights.extract``).

``sum64`` is ``sum(bits[p] * w(p)) mod 2**64`` over positions ``p`` within the segment,
with ``w(p) = 0x9E3779B97F4A7C15 * (p + 1) mod 2**64``: numpy computes it on the host
(``_sum64``), torch on the device (``_torch_weighted``, summed by the caller); both wrap
mod 2**64, so the two agree bit for bit. ``weights.blob``'s docstring says which
positions each segment mode sums over.
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import torch

# sum64 weights: w(p) = _SUM_MULT * (p + 1) mod 2**64 (odd, so w(p) != 0 for p < 2**63)
_SUM_MULT = 0x9E3779B97F4A7C15
_SUM_MULT_I64 = _SUM_MULT - (1 << 64)  # the same bits as a signed int64 (torch has no u64)

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
