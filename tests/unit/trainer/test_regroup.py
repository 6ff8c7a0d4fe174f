"""A group resuming from versions that another count of processes published: each rank
follows a share of the publishers' parts and ends with exactly its own rows
(``RegroupedFollower``), in spawned gloo groups over a file store (no broker needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from astraflow.trainer.parallel import spawn_local
from astraflow.trainer.regroup import shared_parts
from astraflow.weights import FileBlobStore
from astraflow.weights.bits import state_bytes_equal
from tests.unit.trainer import parallel_workers as workers
from tests.unit.weights.test_parts import publish_parts, shard, versions

TIMEOUT_S = 300.0


def _rows_versions(n: int, seed: int) -> list[dict[str, torch.Tensor]]:
    """test_parts' versions without their 0-d tensor: a sharded trainer's weights are all
    rows (``Trainer.fully_sharded``)."""
    return [{k: t for k, t in s.items() if t.dim()} for s in versions(n, seed)]


def test_ranks_share_the_parts_in_turn():
    assert shared_parts(0, 3, 2) == [0] and shared_parts(2, 3, 2) == []
    assert shared_parts(0, 2, 5) == [0, 2, 4] and shared_parts(1, 2, 5) == [1, 3]


@pytest.mark.parametrize(("published", "resumed"), [(2, 3), (3, 2)])
def test_each_rank_holds_exactly_its_rows_of_versions_of_another_count(
        tmp_path: Path, published: int, resumed: int):
    """Versions 0-7 (anchors every 3) published as ``published`` processes' parts,
    followed by a group of ``resumed``: at every version each rank holds its own rows
    (torch.chunk's split for ``resumed``), no more, in their own shape, and fetched only
    the blobs of the parts it follows."""
    vs = _rows_versions(8, seed=published * 10 + resumed)
    store = FileBlobStore(tmp_path)
    merged, _ = publish_parts(store, vs, published, 3)
    manifests = [m for ms in merged for m in ms]
    got = spawn_local(resumed, workers.regrouped,
                      (str(tmp_path), manifests, published, len(vs) - 1),
                      timeout_s=TIMEOUT_S)
    for rank, out in enumerate(got):
        assert out["error"] is None, out["error"]
        assert out["parts"] == shared_parts(rank, resumed, published)
        for v, state in enumerate(out["states"]):
            want = shard(vs[v], resumed)[rank][0]
            assert state_bytes_equal(state, want), f"rank {rank} v{v} differs"
        followed = {m.blobs[p].uri for m in manifests for p in out["parts"]}
        assert set(out["opened"]) <= followed
        assert bool(out["opened"]) == bool(out["parts"])


def test_a_part_no_rank_can_reach_stops_every_rank(tmp_path: Path):
    """Every blob of publisher 1's part is gone: the rank that follows it cannot reach
    version 0, and every rank of the group is told so (none waits for it)."""
    vs = _rows_versions(4, seed=5)
    store = FileBlobStore(tmp_path)
    merged, _ = publish_parts(store, vs, 2, 3)
    manifests = [m for ms in merged for m in ms]
    for m in manifests:
        store.delete(m.blobs[1])
    got = spawn_local(3, workers.regrouped, (str(tmp_path), manifests, 2, 3),
                      timeout_s=TIMEOUT_S)
    assert all(out["states"] == [] for out in got)
    assert "part 2 of 2" in got[1]["error"]
    assert "another rank cannot reach version 0" in got[0]["error"]
    assert "another rank cannot reach version 0" in got[2]["error"]

