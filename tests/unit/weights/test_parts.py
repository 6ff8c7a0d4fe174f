"""Part blobs (rows of dim 0, one per trainer process), merged manifests and following
them (no broker needed)."""

from __future__ import annotations

import pytest
import torch

from astraflow.weights import (
    BaseMismatchError,
    CorruptBlobError,
    FileBlobStore,
    NoPlanError,
    Rows,
    UnsupportedFormatError,
    WeightFollower,
    WeightPublisher,
    apply_blob,
    apply_delta,
    apply_parts,
    decode_full,
    empty_state,
    encode_delta,
    encode_full,
    inspect_blob,
    merge_parts,
)
from astraflow.weights.bits import dtype_name, state_bytes_equal
from astraflow.weights.blob import read_header
from astraflow.wire.records import PartitionOffset, TensorInfo

# Written by the codec before parts and sum64 existed (format version 1, segment_elems 8):
# a = (arange(24).reshape(6, 4) / 7) as bf16, b = linspace(-1, 1, 5) as fp32; the delta sets
# a[2, 1] = 3.5, a[5, 3] = -0.25, b[4] = 0.125.
OLD_FULL = bytes.fromhex(
    "4146574201000000820000007b227365676d656e745f656c656d73223a382c2274656e736f7273223a5b7b"
    "226e616d65223a2261222c226474797065223a2262666c6f61743136222c227368617065223a5b362c345d"
    "7d2c7b226e616d65223a2262222c226474797065223a22666c6f61743332222c227368617065223a5b355d"
    "7d5d2c226d657461223a7b7d7d54030000000210bb2567c90000123e923edb3e123f373f5b3f803f0210c9"
    "a672b0923fa53fb73fc93fdb3fee3f00400940021095a163fe12401b4025402e4037404040494052405401"
    "00000002149aa9b5ca000080bf000000bf000000000000003f0000803f0200000041465745"
)
OLD_DELTA = bytes.fromhex(
    "4146574201000100820000007b227365676d656e745f656c656d73223a382c2274656e736f7273223a5b7b"
    "226e616d65223a2261222c226474797065223a2262666c6f61743136222c227368617065223a5b362c345d"
    "7d2c7b226e616d65223a2262222c226474797065223a22666c6f61743332222c227368617065223a5b355d"
    "7d5d2c226d657461223a7b7d7d54030000000001010101026e77cf24c838f85201c57f0101010102b96c88"
    "bf3f14835607d2fe540100000001010101046a6aa1acb7c225e004000080010200000041465745"
)


def old_states() -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    a = (torch.arange(24, dtype=torch.float32).reshape(6, 4) / 7).to(torch.bfloat16)
    s0 = {"a": a, "b": torch.linspace(-1, 1, 5)}
    s1 = {k: v.clone() for k, v in s0.items()}
    s1["a"][2, 1], s1["a"][5, 3], s1["b"][4] = 3.5, -0.25, 0.125
    return s0, s1


def model(seed: int) -> dict[str, torch.Tensor]:
    """Several shapes: 2-D, 1-D, fewer rows than processes, 3-D, and a 0-d scalar."""
    g = torch.Generator().manual_seed(seed)
    return {
        "emb": (torch.randn(37, 16, generator=g) * 0.02).to(torch.bfloat16),
        "bias": torch.randn(100, generator=g) * 0.1,
        "tiny": (torch.randn(2, 8, generator=g) * 0.02).to(torch.bfloat16),
        "conv": (torch.randn(5, 3, 4, generator=g) * 0.02).to(torch.float16),
        "scale": torch.tensor(0.5),
    }


def step(state: dict[str, torch.Tensor], seed: int, frac: float = 0.05):
    """The next version: about ``frac`` of the elements nudged."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        mask = torch.rand(t.shape, generator=g) < frac
        out[k] = torch.where(mask, (t.float() * 1.03 + 1e-3).to(t.dtype), t)
    return out


def versions(n: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    out = [model(seed)]
    for i in range(1, n):
        out.append(step(out[-1], seed * 100 + i))
    return out


def shard(state: dict[str, torch.Tensor], world: int
          ) -> list[tuple[dict[str, torch.Tensor], dict[str, Rows]]]:
    """Each process's part as FSDP2's Shard(0) makes it: ``torch.chunk`` of dim 0 (chunks
    of ceil(n / world) rows; trailing empty chunks omitted, so a process may hold no rows
    of a tensor); a 0-d tensor is held whole by process 0."""
    parts: list[tuple[dict[str, torch.Tensor], dict[str, Rows]]] = [({}, {}) for _ in range(world)]
    for name, t in state.items():
        if t.dim() == 0:
            parts[0][0][name] = t.clone()
            continue
        start = 0
        for rank, chunk in enumerate(torch.chunk(t, world, dim=0)):
            stop = start + chunk.shape[0]
            parts[rank][0][name] = chunk.clone()
            parts[rank][1][name] = Rows(start, stop, tuple(t.shape))
            start = stop
    return parts


def publish_parts(store, vs, world, anchor_interval, **kw):
    """Each process publishes its part of every version; the merged manifests."""
    layout = [rows for _, rows in shard(vs[0], world)]
    pubs = [WeightPublisher(store, "pol", anchor_interval=anchor_interval, rows=rows, threads=1,
                            **kw) for rows in layout]
    merged = []
    for v, state in enumerate(vs):
        parts = shard(state, world)
        per = [pub.publish(part, trainer_step=v)
               for pub, (part, _) in zip(pubs, parts, strict=True)]
        merged.append(merge_parts(per))
    return merged, pubs


def clone(s):
    return {k: t.clone() for k, t in s.items()}


# --------------------------------------------------------------------------- codec


def test_a_part_writes_only_its_rows_of_the_full_tensors():
    s0 = model(1)
    s1 = step(s0, 2, frac=0.5)
    rows = {"emb": Rows(10, 20, (37, 16)), "bias": Rows(0, 30, (100,))}
    p0 = {"emb": s0["emb"][10:20].clone(), "bias": s0["bias"][:30].clone()}
    p1 = {"emb": s1["emb"][10:20].clone(), "bias": s1["bias"][:30].clone()}
    want = clone(s0)
    want["emb"][10:20], want["bias"][:30] = s1["emb"][10:20], s1["bias"][:30]

    delta, stats = encode_delta(p0, p1, rows=rows, segment_elems=50)
    assert stats.num_params == 10 * 16 + 30
    before = clone(s0)
    assert state_bytes_equal(apply_delta(s0, delta), want)
    assert state_bytes_equal(s0, before), "not inplace, yet the input changed"
    work = clone(s0)
    out = apply_blob(work, delta, inplace=True)
    assert state_bytes_equal(work, want) and all(out[k] is work[k] for k in work)
    with pytest.raises(BaseMismatchError):  # the rows' base is checked
        apply_delta(want, delta)

    full, _ = encode_full(p1, rows=rows)
    with pytest.raises(BaseMismatchError, match="needs a state"):
        apply_blob(None, full)
    with pytest.raises(BaseMismatchError, match="needs a state"):
        decode_full(full)
    assert state_bytes_equal(apply_blob(s0, full), want)
    assert state_bytes_equal(s0, before)
    work = clone(s0)
    assert state_bytes_equal(decode_full(full, out=work), want) and state_bytes_equal(work, want)

    # the header records the full shape and the rows; inspect shows them
    kind, specs, _ = read_header(full)
    assert kind == "full" and specs[0].rows == rows["emb"] and specs[0].full_shape == [37, 16]
    info = inspect_blob(full)
    assert info.format_version == 2
    assert (info.tensors[0].rows, info.tensors[0].full_shape) == ([10, 20], [37, 16])


def test_parts_are_checked_against_their_rows_and_shapes():
    with pytest.raises(ValueError, match="not within"):
        Rows(3, 2, (4,))
    with pytest.raises(ValueError, match="at least one dimension"):
        Rows(0, 0, ())
    s = model(3)
    with pytest.raises(ValueError, match="rows 0..5"):
        encode_full({"emb": s["emb"][:4]}, rows={"emb": Rows(0, 5, (37, 16))})
    full, _ = encode_full({"emb": s["emb"][:4].clone()}, rows={"emb": Rows(0, 4, (37, 16))})
    with pytest.raises(BaseMismatchError, match=r"\[38, 16\]"):
        apply_blob({"emb": torch.zeros(38, 16, dtype=torch.bfloat16)}, full)


def test_old_format_blobs_still_decode_and_whole_tensor_blobs_keep_it():
    s0, s1 = old_states()
    assert state_bytes_equal(decode_full(OLD_FULL), s0)
    assert state_bytes_equal(apply_blob(None, OLD_FULL), s0)
    assert state_bytes_equal(apply_delta(s0, OLD_DELTA), s1)
    assert inspect_blob(OLD_DELTA).format_version == 1
    # the CPU encoders write whole tensors exactly as before
    assert encode_full(s0, segment_elems=8)[0] == OLD_FULL
    assert encode_delta(s0, s1, segment_elems=8)[0] == OLD_DELTA


def test_a_reader_of_version_1_only_refuses_part_blobs():
    s0, s1 = old_states()
    rows = {"a": Rows(2, 4, (6, 4))}
    part, _ = encode_delta({"a": s0["a"][2:4].clone()}, {"a": s1["a"][2:4].clone()}, rows=rows)
    assert int.from_bytes(part[4:6], "little") == 2
    # what a pre-parts reader checks first (the version) makes it refuse the blob
    future = part[:4] + (3).to_bytes(2, "little") + part[6:]
    with pytest.raises(UnsupportedFormatError, match="version 3"):
        apply_delta(s0, future)


def test_apply_parts_refuses_gaps_and_overlaps_before_writing():
    s0 = model(4)
    s1 = step(s0, 5)
    parts0, parts1 = shard(s0, 3), shard(s1, 3)
    deltas = [encode_delta(a, b, rows=r)[0] for (a, r), (b, _) in zip(parts0, parts1, strict=True)]
    fulls = [encode_full(b, rows=r)[0] for b, r in parts1]
    assert state_bytes_equal(apply_parts(s0, deltas), s1)
    infos = [TensorInfo(k, list(t.shape), dtype_name(t.dtype)) for k, t in s0.items()]
    assert state_bytes_equal(apply_parts(empty_state(infos), fulls, inplace=True), s1)
    assert state_bytes_equal(apply_parts(s0, fulls), s1)  # into new tensors
    for blobs in (deltas, fulls):
        work = clone(s0)
        with pytest.raises(CorruptBlobError, match="no part holds rows .* of emb"):
            apply_parts(work, blobs[:2], inplace=True)
        with pytest.raises(CorruptBlobError, match="overlap: rows .* of emb"):
            apply_parts(work, [blobs[0], *blobs], inplace=True)
        assert state_bytes_equal(work, s0), "a refused manifest changed the state"
    with pytest.raises(BaseMismatchError, match="needs a state"):
        apply_parts(None, fulls)
    with pytest.raises(CorruptBlobError, match="mix full and delta"):
        apply_parts(s0, [deltas[0], fulls[1], deltas[2]])


def test_a_wrong_base_in_one_part_leaves_every_part_unwritten():
    s0 = model(6)
    s1 = step(s0, 7, frac=0.5)
    s2 = step(s1, 8, frac=0.5)
    parts = [shard(s, 2) for s in (s0, s1, s2)]
    deltas = [encode_delta(parts[0][0][0], parts[1][0][0], rows=parts[0][0][1])[0],
              encode_delta(parts[1][1][0], parts[2][1][0], rows=parts[1][1][1])[0]]
    work = clone(s0)  # process 1's part is against s1, not s0
    with pytest.raises(BaseMismatchError):
        apply_parts(work, deltas, inplace=True)
    assert state_bytes_equal(work, s0)


def test_empty_state_allocates_a_manifests_tensors():
    st = empty_state([TensorInfo("w", [3, 2], "bfloat16"), TensorInfo("s", [], "float32")])
    assert {k: (list(t.shape), t.dtype) for k, t in st.items()} == {
        "w": ([3, 2], torch.bfloat16), "s": ([], torch.float32)}
    with pytest.raises(ValueError, match="twice"):
        empty_state([TensorInfo("w", [1], "float32")] * 2)
    with pytest.raises(ValueError, match="unknown dtype"):
        empty_state([TensorInfo("w", [1], "float99")])


# --------------------------------------------------------------------------- publish/follow


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("inplace", [True, False])
@pytest.mark.parametrize("device_delta", [False, True])
def test_merged_parts_follow_like_one_publisher(tmp_path, world, inplace, device_delta):
    vs = versions(8, seed=world)
    store = FileBlobStore(tmp_path)
    one = WeightPublisher(store, "pol", anchor_interval=3, threads=1, device_delta=device_delta)
    single = [one.publish(s, trainer_step=v) for v, s in enumerate(vs)]
    merged, _ = publish_parts(store, vs, world, 3, device_delta=device_delta)

    assert [[m.kind for m in ms] for ms in merged] == [[m.kind for m in ms] for ms in single]
    for ms, ref in zip(merged, single, strict=True):
        for m, r in zip(ms, ref, strict=True):
            assert len(m.blobs) == world and m.meta["parts"] == str(world)
            assert (m.version, m.base_version) == (r.version, r.base_version)
            assert [(t.name, t.shape, t.dtype) for t in m.tensors] == [
                (t.name, t.shape, t.dtype) for t in r.tensors]
            assert (m.num_params, m.num_changed, m.sparsity) == (
                r.num_params, r.num_changed, r.sparsity)

    by_parts = WeightFollower(stores=[store], inplace=inplace, threads=2)
    by_one = WeightFollower(stores=[store], inplace=inplace, threads=2)
    by_parts.observe([m for ms in merged for m in ms])
    by_one.observe([m for ms in single for m in ms])
    held = None
    for v in range(len(vs)):
        res = by_parts.update(v)
        by_one.update(v)
        assert not res.failures and by_parts.version == v
        assert state_bytes_equal(by_parts.state, vs[v]), f"v{v} differs"
        assert state_bytes_equal(by_parts.state, by_one.state)
        if held is not None and res.applied[-1].kind == "delta":
            if inplace:  # the same tensors, changed in place
                assert all(by_parts.state[k] is held[0][k] for k in held[0])
            else:  # the earlier state is left as it was
                assert state_bytes_equal(held[0], held[1])
        held = (by_parts.state, clone(by_parts.state))

    # a newcomer plans the anchor at v6 (full parts) and the delta parts after it
    late = WeightFollower(stores=[store], inplace=inplace)
    late.observe([m for ms in merged for m in ms])
    res = late.update()
    assert [(m.kind, m.version) for m in res.applied] == [("full", 6), ("delta", 7)]
    assert state_bytes_equal(late.state, vs[-1])


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("inplace", [True, False])
def test_a_process_follows_its_own_part_alone(tmp_path, world, inplace):
    vs = versions(8, seed=world + 20)
    store = FileBlobStore(tmp_path)
    merged, _ = publish_parts(store, vs, world, 3)
    one = WeightPublisher(store, "pol", anchor_interval=3, threads=1)
    single = [one.publish(s, trainer_step=v) for v, s in enumerate(vs)]
    for rank in range(world):
        opened: list[str] = []
        f = WeightFollower(stores=[store], inplace=inplace, threads=2, part=(rank, world))
        real = f.resolver.open
        f.resolver.open = lambda ref, opened=opened, real=real: (
            opened.append(ref.uri), real(ref))[1]
        # versions of one publisher (and of another count of processes) are never planned
        f.observe([m for ms in merged + single for m in ms])
        assert all(m.meta["parts"] == str(world) for m in f.manifests)
        for v in range(len(vs)):
            res = f.update(v)
            assert not res.failures and f.version == v
            want = shard(vs[v], world)[rank][0]  # this process's rows, in their own shape
            assert state_bytes_equal(f.state, want), f"rank {rank} v{v} differs"
        # only this process's blob of each version applied was fetched
        mine = {m.blobs[rank].uri for ms in merged for m in ms}
        assert opened and set(opened) <= mine
    with pytest.raises(NoPlanError):  # versions made of another count of parts
        g = WeightFollower(stores=[store], part=(0, world + 1))
        g.observe([m for ms in merged for m in ms])
        g.update()
    with pytest.raises(ValueError, match="0 <= index < count"):
        WeightFollower(stores=[store], part=(world, world))


def test_a_full_checkpoint_of_parts_goes_into_the_held_tensors(tmp_path):
    vs = versions(4, seed=9)
    store = FileBlobStore(tmp_path)
    merged, _ = publish_parts(store, vs, 2, anchor_interval=3, delta_at_anchors=False)
    f = WeightFollower(stores=[store], inplace=True)
    f.observe(merged[0])
    f.update()
    held = f.state
    f.observe([m for ms in merged[1:] for m in ms])
    res = f.update()
    assert [(m.kind, m.version) for m in res.applied][-1] == ("full", 3)
    assert all(f.state[k] is held[k] for k in held)
    assert state_bytes_equal(f.state, vs[3])


def test_a_missing_or_doubled_part_makes_the_manifest_unusable(tmp_path):
    vs = versions(3, seed=11)
    store = FileBlobStore(tmp_path)
    layout = [rows for _, rows in shard(vs[0], 3)]
    pubs = [WeightPublisher(store, "pol", anchor_interval=100, rows=r) for r in layout]
    per = [[pub.publish(part) for pub, (part, _) in zip(pubs, shard(s, 3), strict=True)]
           for s in vs]

    f = WeightFollower(stores=[store])
    f.observe(merge_parts(per[0][:2]))  # process 2's part of the full checkpoint is missing
    with pytest.raises(NoPlanError):
        f.update(0)
    assert f.state is None
    assert any("no part holds rows" in why and "emb" in why for why in f._bad.values())

    g = WeightFollower(stores=[store], inplace=True)
    g.observe(merge_parts(per[0]))
    g.update(0)
    g.observe(merge_parts([per[1][0], per[1][0], per[1][1], per[1][2]]))  # doubled part
    with pytest.raises(NoPlanError):
        g.update(1)
    assert any("overlap" in why for why in g._bad.values())
    assert g.version == 0 and state_bytes_equal(g.state, vs[0])
    g.observe(merge_parts(per[1][1:]))  # process 0's delta is missing
    with pytest.raises(NoPlanError):
        g.update(1)
    assert state_bytes_equal(g.state, vs[0])
    g.observe(merge_parts(per[1]))  # the complete manifest
    g.update(1)
    assert state_bytes_equal(g.state, vs[1])

    lone = WeightFollower(stores=[store])  # one process's manifest, not merged
    lone.observe(per[0][1])
    with pytest.raises(NoPlanError):
        lone.update(0)
    assert any("needs a state" in why for why in lone._bad.values())


def test_merge_parts_sums_and_refuses_mismatches(tmp_path):
    vs = versions(2, seed=12)
    store = FileBlobStore(tmp_path)
    layout = [rows for _, rows in shard(vs[0], 2)]
    pubs = [WeightPublisher(store, "pol", anchor_interval=1, rows=r) for r in layout]
    off = [PartitionOffset("t", 0, 5), PartitionOffset("t", 1, 9)]
    per = [[pub.publish(part, trainer_step=1 + i, consumed_offsets=off[: i + 1],
                        meta={"batch": "b7"})
            for i, (pub, (part, _)) in enumerate(zip(pubs, shard(s, 2), strict=True))]
           for s in vs]
    per[1][0][0].meta["encode_s"], per[1][1][0].meta["encode_s"] = "0.250", "1.500"
    merged = merge_parts(per[1])
    assert [m.kind for m in merged] == ["delta", "full"]
    d = merged[0]
    assert d.num_params == sum(t.numel() for t in vs[0].values())
    assert d.num_changed == sum(p[0].num_changed for p in per[1])
    assert d.encoded_bytes == sum(p[0].encoded_bytes for p in per[1])
    assert d.sparsity == pytest.approx(1 - d.num_changed / d.num_params)
    assert d.meta["encode_s"] == "1.500" and d.meta["parts"] == "2" and d.meta["batch"] == "b7"
    assert d.trainer_step == 2 and [p.offset for p in d.consumed_offsets] == [5, 9]
    assert [t.name for t in d.tensors] == list(vs[0]) and d.dtype == "mixed"
    assert [b.uri for b in d.blobs] == [per[1][0][0].blobs[0].uri, per[1][1][0].blobs[0].uri]

    with pytest.raises(ValueError, match="version"):  # v0's full and v1's full
        merge_parts([[per[0][0][0]], [per[1][1][1]]])
    with pytest.raises(ValueError, match="gives"):
        merge_parts([per[1][0], per[1][1][:1]])
    with pytest.raises(ValueError, match="at least one"):
        merge_parts([])
    bad = per[1][1][0]
    bad.tensors[0].shape = [99, 16]
    with pytest.raises(ValueError, match="emb"):
        merge_parts(per[1])


def test_publisher_refuses_a_part_that_does_not_fit_its_rows(tmp_path):
    pub = WeightPublisher(FileBlobStore(tmp_path), "pol", rows={"emb": Rows(0, 5, (37, 16))})
    with pytest.raises(ValueError, match="emb"):
        pub.publish({"emb": torch.zeros(4, 16)})
    assert pub.version is None


def test_a_delta_of_parts_copies_the_state_once_not_once_per_part(tmp_path, monkeypatch):
    vs = versions(2, seed=13)
    store = FileBlobStore(tmp_path)
    merged, _ = publish_parts(store, vs, 3, anchor_interval=100)
    f = WeightFollower(stores=[store], inplace=False)
    f.observe(merged[0])
    f.update()
    f.observe(merged[1])
    held = clone(f.state)
    copies = []
    real_clone = torch.Tensor.clone

    def counting_clone(self, *args, **kwargs):
        copies.append(self.numel())
        return real_clone(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "clone", counting_clone)
    f.update()
    assert state_bytes_equal(f.state, vs[1])
    assert sum(copies) <= sum(t.numel() for t in vs[0].values())  # 3 parts, one copy
    assert state_bytes_equal(held, vs[0])
