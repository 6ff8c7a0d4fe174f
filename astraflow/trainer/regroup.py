"""A resuming rank's rows of versions published by another count of processes.

A group of ``M`` processes resuming from versions that ``N`` processes published (a group
restarted with more or fewer processes) cannot follow its own part: the published parts
are cut at other rows, and a delta's checksums cover whole segments of a publisher's part,
so no rank can check only its own rows of one. ``RegroupedFollower`` shares the ``N``
parts among the ``M`` ranks instead: rank ``r`` follows parts ``r, r + M, ...`` (each a
``WeightFollower(part=(p, N))`` fetching and checking that blob alone), and after every
update the ranks hand each other the rows of one tensor at a time, so each keeps exactly
its own rows under FSDP2's ``Shard(0)``. A rank holds ``ceil(N/M)/N`` of the model (its
publishers' parts) and ``1/M`` (its rows) and, for a moment, one whole tensor (twice,
padded, during its all-gather, as FSDP2's own all-gather of a layer holds in a forward
pass), never the whole model.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

from astraflow.trainer.parallel import Group, shard_rows
from astraflow.weights.bits import torch_dtype
from astraflow.weights.errors import CorruptBlobError, NoPlanError
from astraflow.weights.follower import UpdateResult, WeightFollower
from astraflow.weights.stores import StoreResolver
from astraflow.wire.records import TensorInfo, WeightManifest


def shared_parts(rank: int, world: int, count: int) -> list[int]:
    """The publishers' parts (of ``count``) that rank ``rank`` of ``world`` follows: every
    ``world``-th from ``rank`` (none when there are fewer parts than ranks above it)."""
    return list(range(rank, count, world))


class RegroupedFollower:
    """Follows this rank's rows of versions made of ``count`` processes' parts, for a
    group of another size; every rank of ``group`` calls ``update`` with the same target
    (a collective). ``state`` holds this rank's rows alone, in their own shape, as
    ``Trainer.published_part`` gives them (a tensor the rank holds no row of is absent),
    so it is used as ``WeightFollower(part=...)``'s state is (``part`` is set).

    ``make_follower(part)``: a ``WeightFollower`` of that part that has observed the
    manifests; ``resolver`` opens the store's blobs for other reads (a trainer state's
    files)."""

    def __init__(self, group: Group, count: int, manifests: Sequence[WeightManifest],
                 make_follower: Callable[[tuple[int, int]], WeightFollower],
                 resolver: StoreResolver):
        if count < 2:
            raise ValueError(f"count (publishing processes) must be at least 2, got {count}")
        self.group = group
        self.count = count
        self.part = (group.rank, group.world)  # this rank's rows, as a part follower's
        self.resolver = resolver
        self.parts = shared_parts(group.rank, group.world, count)
        self._followers = {p: make_follower((p, count)) for p in self.parts}
        self._tensors = {m.version: m.tensors for m in manifests}
        self.state: dict[str, torch.Tensor] | None = None
        self.version: int | None = None

    def update(self, target: int) -> UpdateResult:
        """Bring every followed part to ``target``, then this rank's rows of each tensor
        from the ranks holding them. ``NoPlanError`` on every rank when any rank cannot
        reach ``target`` (the ranks agree first, so none is left waiting)."""
        result = UpdateResult(self.version, self.version)
        why = ""
        for p, f in self._followers.items():
            try:
                r = f.update(target)
            except NoPlanError as e:
                why = f"part {p + 1} of {self.count}: {e}"
                break
            result.applied += r.applied
            result.bytes_fetched += r.bytes_fetched
            result.failures += r.failures
            result.seconds += r.seconds
        if self.group.max_floats({"failed": float(bool(why))})["failed"]:
            raise NoPlanError(why or f"another rank cannot reach version {target} by parts")
        tensors = self._tensors.get(target)
        if tensors is None:
            raise NoPlanError(f"no manifest of version {target}")
        self.state = {}
        for info in tensors:
            mine = self._rows_of(info)
            if mine is not None:
                self.state[info.name] = mine
        self.version = result.version = target
        return result

    def _rows_of(self, info: TensorInfo) -> torch.Tensor | None:
        """This rank's rows of tensor ``info`` (None when it holds none): every rank
        sends the rows of its followed parts, in part order (as bytes: any dtype goes
        through any backend), and each copies out of them the rows it holds."""
        shape = tuple(info.shape)
        if not shape:
            raise NoPlanError(f"tensor {info.name} is 0-d: not made of rows")
        try:
            dtype = torch_dtype(info.dtype)
        except CorruptBlobError:  # a manifest's dtype, not a blob's: no plan, as before
            raise NoPlanError(f"tensor {info.name}: dtype {info.dtype!r} is not torch's") \
                from None
        row_bytes = math.prod(shape[1:]) * dtype.itemsize
        sent = [self._followers[p].state[info.name].reshape(-1).view(torch.uint8)
                for p in self.parts if info.name in self._followers[p].state]
        mine = torch.cat(sent) if sent else torch.empty(0, dtype=torch.uint8)
        got = self.group.all_gather_rows(mine).cpu()
        lo, hi = shard_rows(shape[0], self.group.rank, self.group.world)
        out = torch.empty((hi - lo) * row_bytes, dtype=torch.uint8)
        at = 0  # where each part's rows are in ``got``: rank order, then part order
        for q in range(self.group.world):
            for p in shared_parts(q, self.group.world, self.count):
                start, stop = shard_rows(shape[0], p, self.count)
                a, b = max(start, lo), min(stop, hi)  # the rows of it this rank holds
                if a < b:
                    out[(a - lo) * row_bytes:(b - lo) * row_bytes] = \
                        got[at + (a - start) * row_bytes:at + (b - start) * row_bytes]
                at += (stop - start) * row_bytes
        if at != got.numel():
            raise NoPlanError(f"tensor {info.name}: the parts sent {got.numel()} bytes, "
                              f"its rows take {at}")
        if hi == lo:
            return None
        return out.view(dtype).reshape((hi - lo, *shape[1:]))

    def close(self) -> None:
        for f in self._followers.values():
            f.close()
        self.resolver.close()


__all__ = ["RegroupedFollower", "shared_parts"]
