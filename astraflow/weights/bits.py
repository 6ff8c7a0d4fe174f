"""Tensors as raw bit patterns: the views every blob is computed on.

A bf16/fp16 tensor is read as 16-bit unsigned integers, fp32 as 32-bit ones (any
fixed-size dtype by its element size), so that encoding and applying a blob reproduce NaN
payloads, infinities and the sign of zero exactly. ``state_bytes_equal`` compares two
state dicts that way.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from astraflow.weights.errors import CorruptBlobError

if sys.byteorder != "little":  # pragma: no cover - every supported host is little-endian
    raise ImportError("astraflow.weights assumes a little-endian host")

_INT_TORCH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_UINT_NP: dict[int, Any] = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}

StateDict = Mapping[str, torch.Tensor]


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def torch_dtype(name: str) -> torch.dtype:
    """``"bfloat16"`` -> ``torch.bfloat16`` (a blob header's dtype, or a manifest's);
    ``CorruptBlobError`` for a name torch has no dtype of."""
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
    "dtype_name",
    "state_bytes_equal",
    "torch_dtype",
]
