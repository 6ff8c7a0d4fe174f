"""The digest of a whole published state, and taking a state a reader already holds as a
version on the strength of it.

A RaaS engine loads its model from disk and counts those weights as version 0. Without
proof that they are version 0 bit for bit, its follower would fetch and decode version 0's
full checkpoint before its first delta (221 MB and about 3 s for SmolLM2-135M on two
cores). The publisher therefore writes, into version 0's manifest (``meta``, key
``STATE_DIGEST``), a sha256 over that version's tensors, and a follower whose engine
holds the same bits in any float dtype takes them as version 0 (``own_copy``): only the
deltas are fetched. A digest that differs (another model directory, a warm start the
engine has not loaded) leaves the follower as it was, fetching the full checkpoint.

A delta's own checksums cover only the elements it changes, so they could not catch a
base that differs elsewhere; the digest covers every element.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

import torch

from astraflow.weights.bits import dtype_name
from astraflow.wire.records import TensorInfo

STATE_DIGEST = "state_sha256"  # the manifest meta key


def state_digest(state: Mapping[str, torch.Tensor], tensors: Sequence[TensorInfo]) -> str:
    """sha256 over ``tensors`` in order: each one's name, dtype and shape, then the raw
    bytes (C order) of ``state[name]``, which must have that dtype and shape."""
    h = hashlib.sha256()
    for info in tensors:
        t = state[info.name]
        if dtype_name(t.dtype) != info.dtype or list(t.shape) != info.shape:
            raise ValueError(f"{info.name} is {t.dtype} {list(t.shape)}, the manifest has "
                             f"{info.dtype} {info.shape}")
        h.update(f"{info.name}\0{info.dtype}\0{info.shape}\0".encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        h.update(flat.view(torch.uint8).numpy().data)
    return h.hexdigest()


def own_copy(state: Mapping[str, torch.Tensor], tensors: Sequence[TensorInfo]
             ) -> dict[str, torch.Tensor] | None:
    """A private CPU copy of ``state``'s ``tensors``, each cast to the manifest's dtype
    (the caller's tensors are never shared: a follower updates its copy in place), or
    None when a tensor is missing or has another shape."""
    out = {}
    for info in tensors:
        t = state.get(info.name)
        dtype = getattr(torch, info.dtype, None)
        if t is None or list(t.shape) != info.shape or not isinstance(dtype, torch.dtype):
            return None
        out[info.name] = t.detach().to("cpu", dtype=dtype, copy=True)
    return out


__all__ = ["STATE_DIGEST", "own_copy", "state_digest"]
