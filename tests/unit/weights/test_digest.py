"""Version 0's digest: a follower takes the weights its engine loaded from disk as version 0
only when the digest vouches for every bit of them, and then fetches deltas only."""

from __future__ import annotations

import dataclasses
import threading

import torch

from astraflow.raas.weights_follow import WeightWatcher
from astraflow.weights import FileBlobStore, Rows, WeightFollower, WeightPublisher
from astraflow.weights.digest import STATE_DIGEST, own_copy, state_digest
from tests.unit.weights.test_weights import assert_same, chain, publish_all


def _published(tmp_path, n: int = 6, anchor_interval: int = 3):
    versions = chain(n, seed=3)
    manifests = publish_all(FileBlobStore(tmp_path), versions, anchor_interval=anchor_interval)
    return versions, manifests


def _as_loaded_from_disk(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What an fp32 engine holds: every tensor upcast (exact), plus one the trainer does
    not publish (a tied head)."""
    out = {k: t.float() for k, t in state.items()}
    out["lm_head.weight"] = out["emb"]
    return out


def test_only_version_0_of_one_process_carries_the_digest_of_every_tensor(tmp_path):
    versions, manifests = _published(tmp_path)
    full0 = manifests[0]
    assert (full0.version, full0.kind) == (0, "full")
    assert full0.meta[STATE_DIGEST] == state_digest(versions[0], full0.tensors)
    assert [m.version for m in manifests if STATE_DIGEST in m.meta] == [0]  # not v3's anchor
    # a process publishing rows of a tensor cannot vouch for the whole
    part = {k: (t[:100] if k == "emb" else t) for k, t in versions[0].items()}
    rows = {"emb": Rows(0, 100, (200, 64))}
    pub = WeightPublisher(FileBlobStore(tmp_path / "p"), "pol", rows=rows, threads=1)
    assert STATE_DIGEST not in pub.publish(part, trainer_step=0)[0].meta


def test_the_digest_covers_every_bit_name_and_shape(tmp_path):
    versions, manifests = _published(tmp_path)
    state, infos = versions[0], manifests[0].tensors
    d = state_digest(state, infos)
    one_bit = dict(state)
    w = state["w"].clone()
    w.view(torch.int16)[17, 5] ^= 1
    one_bit["w"] = w
    assert state_digest(one_bit, infos) != d
    renamed = [type(i)("w2" if i.name == "w" else i.name, i.shape, i.dtype) for i in infos]
    assert state_digest({**state, "w2": state["w"]}, renamed) != d


def test_a_follower_adopts_its_engines_weights_and_fetches_deltas_only(tmp_path):
    versions, manifests = _published(tmp_path)
    engine = _as_loaded_from_disk(versions[0])
    before = {k: t.clone() for k, t in engine.items()}
    f = WeightFollower(stores=[FileBlobStore(tmp_path)])
    f.observe(manifests)
    assert f.adopt(engine, 0)
    assert f.version == 0
    assert [(m.kind, m.version) for m in f.plan()] == [("delta", v) for v in range(1, 6)]
    result = f.update()
    assert [m.kind for m in result.applied] == ["delta"] * 5
    assert result.bytes_fetched == sum(m.encoded_bytes for m in manifests
                                       if m.kind == "delta")
    assert_same(f.state, versions[5])
    assert_same(engine, before)  # updated in place, but its own copy
    assert not f.adopt(engine, 0)  # holds a version already


def test_weights_that_differ_where_no_delta_looks_are_not_adopted(tmp_path):
    versions, manifests = _published(tmp_path)
    engine = _as_loaded_from_disk(versions[0])
    changed = torch.nonzero(versions[1]["w"].view(torch.int16)
                            != versions[0]["w"].view(torch.int16))
    untouched = next((i, j) for i in range(64) for j in range(64)
                     if not ((changed[:, 0] == i) & (changed[:, 1] == j)).any())
    engine["w"][untouched] += 1e-3  # another model: v1's delta alone would not notice
    f = WeightFollower(stores=[FileBlobStore(tmp_path)])
    f.observe(manifests)
    assert not f.adopt(engine, 0)
    assert f.version is None and f.state is None
    result = f.update()
    assert result.applied[0].kind == "full"
    assert_same(f.state, versions[5])


def test_nothing_is_adopted_without_a_digest_a_tensor_or_the_shape(tmp_path):
    versions, manifests = _published(tmp_path)
    infos = manifests[0].tensors
    engine = _as_loaded_from_disk(versions[0])
    assert own_copy({k: t for k, t in engine.items() if k != "norm"}, infos) is None
    assert own_copy({**engine, "w": engine["w"].T[:10]}, infos) is None
    copy = own_copy(engine, infos)
    assert copy is not None and copy["w"].dtype == torch.bfloat16
    assert copy["w"].data_ptr() != versions[0]["w"].data_ptr()
    f = WeightFollower()
    assert not f.adopt(engine, 0)  # no manifest seen
    unvouched = dataclasses.replace(manifests[0], meta={})
    f.observe(unvouched)  # version 0 from a publisher before digests
    assert not f.adopt(engine, 0) and f.version is None


class _Engine:
    """Holds torch weights as a TorchEngine does (``state_dict``, ``load_state_dict``)."""

    policy = "pol"

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state, self.version, self.loads = state, 0, 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        return self.state

    def load_state_dict(self, state, version: int) -> None:
        for k, t in state.items():
            self.state[k].copy_(t)
        self.version, self.loads = version, self.loads + 1


def _watcher(engine, follower) -> WeightWatcher:
    watcher = object.__new__(WeightWatcher)  # its Kafka table left out: fed by hand
    watcher.topic, watcher.engine, watcher.follower = "r.weights.pol", engine, follower
    watcher._failed_target, watcher._offered_own = None, False
    watcher.updates, watcher.update_s, watcher.last_update_s = 0, 0.0, 0.0
    watcher._lock = threading.RLock()  # the table and the follower: one thread at a time
    return watcher


def test_the_watcher_offers_the_engines_weights_once_before_its_first_update(tmp_path):
    versions, manifests = _published(tmp_path)
    engine = _Engine(_as_loaded_from_disk(versions[0]))
    follower = WeightFollower(stores=[FileBlobStore(tmp_path)])
    follower.observe(manifests[:3])  # v0, v1, v2
    watcher = _watcher(engine, follower)
    assert watcher.refresh(poll=False)
    assert engine.version == 2 and watcher._offered_own
    assert_same({k: engine.state[k].to(torch.bfloat16) for k in ("emb", "w")},
                {k: versions[2][k] for k in ("emb", "w")})
    follower.observe(manifests)
    assert watcher.refresh(poll=False) and engine.version == 5
    assert_same(follower.state, versions[5])


def test_the_watcher_fetches_the_full_checkpoint_for_an_engine_on_other_weights(tmp_path):
    versions, manifests = _published(tmp_path)
    other = _as_loaded_from_disk(chain(1, seed=9)[0])
    engine = _Engine(other)
    follower = WeightFollower(stores=[FileBlobStore(tmp_path)])
    follower.observe(manifests)
    assert _watcher(engine, follower).refresh(poll=False) and engine.version == 5
    assert_same(follower.state, versions[5])
    assert torch.equal(engine.state["w"].to(torch.bfloat16), versions[5]["w"])
