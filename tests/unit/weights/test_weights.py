"""Weight codec, manifests/plans, file blob store and GC (no broker needed)."""

from __future__ import annotations

import argparse
import importlib.util
import math
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from astraflow.cli import weights as wcli
from astraflow.weights import (
    BaseMismatchError,
    CorruptBlobError,
    FileBlobStore,
    MissingBlobError,
    NoPlanError,
    UnsupportedFormatError,
    WeightFollower,
    WeightPublisher,
    WeightsError,
    apply_blob,
    apply_delta,
    collect_garbage,
    decode_full,
    encode_delta,
    encode_full,
    inspect_blob,
    iter_encode_delta,
    load_manifests,
    open_store,
    plan_update,
    retained_manifests,
    save_manifest,
)
from astraflow.weights.manifests import manifest_key
from astraflow.wire.records import BlobRef, WeightManifest

REPO = Path(__file__).resolve().parents[3]
INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw(t: torch.Tensor) -> bytes:
    """The tensor's raw bytes (bit patterns, not values: NaN == NaN, -0.0 != 0.0)."""
    t = t.detach().contiguous().reshape(-1)
    return t.view(INT_VIEW[t.element_size()]).numpy().tobytes()


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert list(a) == list(b) or set(a) == set(b)
    for k in b:
        assert a[k].dtype == b[k].dtype, k
        assert tuple(a[k].shape) == tuple(b[k].shape), k
        assert raw(a[k]) == raw(b[k]), f"{k} differs"


def clone(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in s.items()}


def bits_tensor(values: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``dtype`` with the given bit patterns."""
    size = torch.empty(0, dtype=dtype).element_size()
    npt = {2: np.uint16, 4: np.uint32}[size]
    arr = np.array(values, dtype=npt).view({2: np.int16, 4: np.int32}[size])
    return torch.from_numpy(arr.copy()).view(dtype)


def random_state(seed: int, dtypes=(torch.bfloat16, torch.float16, torch.float32)):
    g = torch.Generator().manual_seed(seed)
    state = {}
    shapes = [(64, 96), (3, 5, 7), (1000,), (1,), (), (0,), (0, 4), (257, 33)]
    for i, shape in enumerate(shapes):
        dt = dtypes[i % len(dtypes)]
        state[f"t{i}.{str(dt)[6:]}"] = (torch.randn(shape, generator=g) * 0.02).to(dt)
    return state


def perturb(state, frac: float, seed: int):
    """New version: about ``frac`` of elements nudged by a small relative amount."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, t in state.items():
        mask = torch.rand(t.shape, generator=g) < frac
        noise = 1 + torch.randn(t.shape, generator=g) * 0.01
        new[k] = torch.where(mask, (t.float() * noise).to(t.dtype), t)
    return new


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("segment_elems", [1 << 22, 100, 1])
def test_round_trip_random(threads, segment_elems):
    old = random_state(1)
    new = perturb(old, 0.05, 2)
    blob, stats = encode_delta(old, new, threads=threads, segment_elems=segment_elems)
    assert stats.num_params == sum(t.numel() for t in new.values())
    assert 0 < stats.num_changed < stats.num_params
    before = {k: raw(v) for k, v in old.items()}
    out = apply_delta(old, blob, threads=threads)
    assert_same(out, new)
    assert {k: raw(v) for k, v in old.items()} == before, "non-inplace apply touched the input"
    work = clone(old)
    out2 = apply_delta(work, blob, inplace=True, threads=threads)
    assert_same(work, new)
    assert all(out2[k] is work[k] for k in work)
    full, _ = encode_full(new, threads=threads, segment_elems=segment_elems)
    assert_same(decode_full(full, threads=threads), new)


def test_changed_count_matches_bit_differences():
    old = random_state(3)
    new = perturb(old, 0.1, 4)
    _, stats = encode_delta(old, new)
    expect = sum(
        int(
            (
                old[k].reshape(-1).view(INT_VIEW[old[k].element_size()])
                != new[k].reshape(-1).view(INT_VIEW[new[k].element_size()])
            ).sum()
        )
        for k in old
    )
    assert stats.num_changed == expect


SPECIAL16 = [
    0x0000,
    0x8000,
    0x7F80,
    0xFF80,
    0x7FC0,
    0xFFC1,
    0x7F81,
    0x7FFF,
    0x0001,
    0x8001,
    0x3F80,
]  # bf16: +0, -0, +inf, -inf, qNaN, -NaN payload, sNaN, NaN max payload, subnormals, 1.0
SPECIAL16_FP16 = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x7E00, 0xFE01, 0x7C01, 0x0001, 0x3C00]
SPECIAL32 = [
    0x00000000,
    0x80000000,
    0x7F800000,
    0xFF800000,
    0x7FC00000,
    0xFFC00001,
    0x7F800001,
    0x00000001,
    0x3F800000,
]


@pytest.mark.parametrize(
    "dtype,patterns",
    [
        (torch.bfloat16, SPECIAL16),
        (torch.float16, SPECIAL16_FP16),
        (torch.float32, SPECIAL32),
    ],
)
def test_special_bit_patterns(dtype, patterns):
    # every ordered pair of special patterns: NaN payloads, infinities, signed zeros
    a = [p for p in patterns for _ in patterns]
    b = [q for _ in patterns for q in patterns]
    old = {"x": bits_tensor(a, dtype), "s": bits_tensor([patterns[0]], dtype).reshape(())}
    new = {"x": bits_tensor(b, dtype), "s": bits_tensor([patterns[1]], dtype).reshape(())}
    blob, stats = encode_delta(old, new)
    assert stats.num_changed == sum(x != y for x, y in zip(a, b, strict=True)) + 1
    assert_same(apply_delta(old, blob), new)
    # -0.0 vs 0.0 compare equal as values but must count as a change
    z_old = {"z": torch.zeros(5, dtype=dtype)}
    z_new = {"z": -torch.zeros(5, dtype=dtype)}
    assert torch.equal(z_old["z"], z_new["z"])
    blob, stats = encode_delta(z_old, z_new)
    assert stats.num_changed == 5
    assert_same(apply_delta(z_old, blob), z_new)
    full, _ = encode_full(new)
    assert_same(decode_full(full), new)


def test_nan_to_same_nan_is_unchanged():
    old = {"x": bits_tensor([0x7FC0, 0xFFC1, 0x7F81], torch.bfloat16)}
    new = {"x": old["x"].clone()}
    blob, stats = encode_delta(old, new)
    assert stats.num_changed == 0
    assert_same(apply_delta(old, blob), new)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_none_changed(dtype):
    old = {"a": torch.randn(300, 7).to(dtype), "b": torch.randn(()).to(dtype)}
    blob, stats = encode_delta(old, clone(old))
    assert stats.num_changed == 0
    assert stats.tensor_modes == {"unchanged": 2}
    assert len(blob) < 200
    assert_same(apply_delta(old, blob), old)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_all_changed_random_falls_back_to_dense(dtype):
    g = torch.Generator().manual_seed(5)
    n = 50_000
    isz = torch.empty(0, dtype=dtype).element_size()
    old = {
        "w": torch.randint(-(2**15), 2**15, (n * isz // 2,), generator=g, dtype=torch.int16).view(
            dtype
        )
    }
    new = {
        "w": torch.randint(-(2**15), 2**15, (n * isz // 2,), generator=g, dtype=torch.int16).view(
            dtype
        )
    }
    blob, stats = encode_delta(old, new, segment_elems=8192)
    assert stats.num_changed > 0.99 * n
    # never larger than the tensor (plus a few header bytes per segment)
    assert len(blob) <= n * isz + 64 * math.ceil(n / 8192) + 512
    assert stats.segments.get("sparse", 0) == 0
    (t,) = inspect_blob(blob).tensors
    assert t.mode == "dense" and t.encoded_bytes <= n * isz + 10 * math.ceil(n / 8192) + 5
    assert_same(apply_delta(old, blob), new)


def test_all_changed_by_one_ulp_uses_xor_and_is_small():
    old = {"w": (torch.randn(200_000) * 0.02).to(torch.bfloat16)}
    b = old["w"].view(torch.int16)
    new = {"w": (b + 1).view(torch.bfloat16)}
    blob, stats = encode_delta(old, new)
    assert stats.num_changed == 200_000
    assert stats.segments == {"dense_xor": 1}
    assert len(blob) < 0.25 * 400_000
    assert_same(apply_delta(old, blob), new)


def test_other_dtypes_round_trip():
    old = {
        "i64": torch.arange(1000, dtype=torch.int64),
        "b": torch.zeros(100, dtype=torch.bool),
        "u8": torch.arange(256, dtype=torch.uint8),
        "f64": torch.randn(10, dtype=torch.float64),
    }
    new = clone(old)
    new["i64"][7] = -1
    new["b"][3] = True
    new["u8"][0] = 9
    new["f64"][2] = float("-inf")
    blob, _ = encode_delta(old, new)
    assert_same(apply_delta(old, blob), new)
    full, _ = encode_full(new, compress=False)
    assert_same(decode_full(full), new)


def test_noncontiguous_and_grad_tensors():
    base = torch.randn(40, 30).to(torch.bfloat16)
    old = {"t": base.t(), "p": torch.nn.Parameter(torch.randn(10))}
    new = {"t": perturb({"x": base}, 0.3, 9)["x"].t(), "p": old["p"].detach() + 1}
    blob, _ = encode_delta(old, new)
    out = apply_delta(old, blob)
    assert_same(out, {k: v.detach() for k, v in new.items()})
    work = {"t": old["t"].clone(), "p": torch.nn.Parameter(old["p"].detach().clone())}
    apply_delta(work, blob, inplace=True)
    assert_same({k: v.detach() for k, v in work.items()}, {k: v.detach() for k, v in new.items()})


def test_mismatched_state_dicts_rejected():
    a = {"x": torch.zeros(3)}
    with pytest.raises(ValueError):
        encode_delta(a, {"y": torch.zeros(3)})
    with pytest.raises(ValueError):
        encode_delta(a, {"x": torch.zeros(4)})
    with pytest.raises(ValueError):
        encode_delta(a, {"x": torch.zeros(3, dtype=torch.float16)})


def test_wrong_base_raises_and_leaves_state_untouched():
    v0 = random_state(10)
    v1 = perturb(v0, 0.05, 11)
    v2 = perturb(v1, 0.05, 12)
    blob12, _ = encode_delta(v1, v2)
    work = clone(v0)
    with pytest.raises(BaseMismatchError):
        apply_delta(work, blob12, inplace=True)
    assert_same(work, v0)
    with pytest.raises(BaseMismatchError):
        apply_delta({"nope": torch.zeros(1)}, blob12)


def test_unknown_magic_and_version_rejected():
    old = random_state(13)
    blob, _ = encode_delta(old, perturb(old, 0.1, 14))
    with pytest.raises(UnsupportedFormatError, match="magic"):
        apply_delta(old, b"XXXX" + blob[4:])
    bad_version = blob[:4] + (99).to_bytes(2, "little") + blob[6:]
    with pytest.raises(UnsupportedFormatError, match="version 99"):
        apply_delta(old, bad_version)
    with pytest.raises(UnsupportedFormatError):
        inspect_blob(b"PK\x03\x04 not a blob at all")


def test_tampered_blob_never_half_applied():
    old = random_state(15)
    new = perturb(old, 0.1, 16)
    blob, _ = encode_delta(old, new, segment_elems=500)
    rng = random.Random(0)
    positions = sorted(rng.sample(range(len(blob)), min(300, len(blob))))
    errors = 0
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 1 << rng.randrange(8)
        work = clone(old)
        try:
            apply_delta(work, bytes(bad), inplace=True)
        except WeightsError:
            errors += 1
            assert_same(work, old)  # nothing written
        else:  # only possible for bytes that do not carry data (e.g. free-form header meta)
            assert_same(work, new)
    assert errors > 0.9 * len(positions)
    for cut in (0, 5, len(blob) // 2, len(blob) - 1):
        with pytest.raises(CorruptBlobError):
            apply_delta(clone(old), blob[:cut])
    with pytest.raises(CorruptBlobError, match="trailing"):
        apply_delta(clone(old), blob + b"\0")


def test_full_and_delta_kinds_not_confused():
    s = random_state(17)
    full, st = encode_full(s)
    assert st.kind == "full"
    delta, _ = encode_delta(s, perturb(s, 0.1, 18))
    with pytest.raises(WeightsError):
        apply_delta(s, full)
    with pytest.raises(WeightsError):
        decode_full(delta)
    assert_same(apply_blob(None, full), s)
    with pytest.raises(BaseMismatchError):
        apply_blob(None, delta)


def test_inspect_reports_modes():
    old = {"a": torch.zeros(1000, dtype=torch.bfloat16), "b": torch.zeros(10)}
    new = clone(old)
    new["a"][::10] = 1.0
    blob, stats = encode_delta(old, new, meta={"version": "3"})
    info = inspect_blob(blob)
    assert info.kind == "delta" and info.meta == {"version": "3"}
    assert [t.mode for t in info.tensors] == ["sparse", "unchanged"]
    assert info.num_changed == 100 == stats.num_changed
    assert info.total_bytes == len(blob)


def test_encoding_streams_in_pieces():
    old = random_state(19)
    new = perturb(old, 0.1, 20)
    pieces = list(iter_encode_delta(old, new, segment_elems=64))
    assert len(pieces) > 10
    assert_same(apply_delta(old, b"".join(pieces)), new)


# --------------------------------------------------------------------------- stores


def test_file_store_round_trip_and_corruption(tmp_path):
    store = open_store(tmp_path.as_uri() + "/blobs")
    assert isinstance(store, FileBlobStore)
    ref = store.put("a.v1", [b"hello ", memoryview(b"world")])
    assert ref.bytes == 11 and ref.uri.endswith("/a.v1")
    assert store.get(ref) == b"hello world"
    assert [b.blob_id for b in store.list()] == ["a.v1"]
    # corrupt one byte on disk
    path = tmp_path / "blobs" / "a.v1"
    path.write_bytes(b"hello wOrld")
    with pytest.raises(CorruptBlobError, match="sha256"):
        store.get(ref)
    path.write_bytes(b"hello")
    with pytest.raises(CorruptBlobError):
        store.get(ref)
    with pytest.raises(MissingBlobError):
        store.get(BlobRef(uri=store.uri + "/nope", bytes=1, sha256="0" * 64))
    with pytest.raises(ValueError):
        store.put("../escape", b"x")


def test_file_store_write_is_atomic(tmp_path):
    store = FileBlobStore(tmp_path)

    def failing():
        yield b"part one"
        raise RuntimeError("writer died")

    with pytest.raises(RuntimeError):
        store.put("blob", failing())
    assert list(tmp_path.iterdir()) == []
    ref = store.put("blob", b"v1")
    with pytest.raises(RuntimeError):
        store.put("blob", failing())
    assert store.get(ref) == b"v1"  # the old content survives a failed overwrite


# --------------------------------------------------------------------------- history


def chain(n: int, seed: int = 0):
    """n successive versions of a small model."""
    g = torch.Generator().manual_seed(seed)
    v = {
        "emb": (torch.randn(200, 64, generator=g) * 0.02).to(torch.bfloat16),
        "w": (torch.randn(64, 64, generator=g) * 0.02).to(torch.bfloat16),
        "norm": torch.ones(64, dtype=torch.float32),
        "scalar": torch.tensor(0.5, dtype=torch.float16),
    }
    out = [v]
    for i in range(1, n):
        out.append(perturb(out[-1], 0.02, seed * 1000 + i))
    return out


def publish_all(store, versions, anchor_interval, **kw):
    pub = WeightPublisher(store, "pol", anchor_interval=anchor_interval, threads=2, **kw)
    manifests = []
    for i, s in enumerate(versions):
        ms = pub.publish(s, trainer_step=i)
        assert [m.version for m in ms] == [i] * len(ms)
        manifests += ms
    return manifests


def test_chain_of_20_versions_from_the_anchor(tmp_path):
    versions = chain(20)
    store = FileBlobStore(tmp_path)
    manifests = publish_all(store, versions, anchor_interval=100)
    assert [m.kind for m in manifests] == ["full"] + ["delta"] * 19
    assert all(m.base_version == m.version - 1 for m in manifests[1:])
    f = WeightFollower(stores=[store])
    f.observe(manifests)
    plan = f.plan()
    assert [(m.kind, m.version) for m in plan] == [("full", 0)] + [
        ("delta", v) for v in range(1, 20)
    ]
    res = f.update()
    assert res.version == 19 and f.version == 19 and not res.failures
    assert_same(f.state, versions[19])
    # a follower in the middle takes only the deltas it needs
    g = WeightFollower(state=clone(versions[7]), version=7, stores=[store])
    g.observe(manifests)
    res = g.update(12)
    assert [m.version for m in res.applied] == [8, 9, 10, 11, 12]
    assert_same(g.state, versions[12])
    # deltas are small next to the full checkpoint
    full = manifests[0].encoded_bytes
    assert all(m.encoded_bytes < 0.25 * full for m in manifests[1:])
    assert manifests[3].num_changed > 0 and 0.9 < manifests[3].sparsity < 1.0


def test_anchors_and_fallback_on_corrupt_blob(tmp_path):
    versions = chain(10, seed=1)
    store = FileBlobStore(tmp_path)
    manifests = publish_all(store, versions, anchor_interval=4)
    assert [(m.version, m.kind) for m in manifests] == [
        (0, "full"),
        (1, "delta"),
        (2, "delta"),
        (3, "delta"),
        (4, "delta"),
        (4, "full"),
        (5, "delta"),
        (6, "delta"),
        (7, "delta"),
        (8, "delta"),
        (8, "full"),
        (9, "delta"),
    ]
    assert manifests[0].num_changed == manifests[0].num_params
    assert manifests[5].num_changed == manifests[4].num_changed > 0  # full v4 vs delta v4
    # corrupt the delta 4 -> 5 on disk
    bad = next(m for m in manifests if m.version == 5)
    path = tmp_path / bad.blobs[0].uri.rsplit("/", 1)[1]
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))

    f = WeightFollower(state=clone(versions[3]), version=3, stores=[store])
    f.observe(manifests)
    assert [m.version for m in f.plan(9)] == [4, 5, 6, 7, 8, 9]
    res = f.update(9)
    assert f.version == 9 and res.version == 9
    assert_same(f.state, versions[9])
    assert [(m.version, "sha256" in why) for m, why in res.failures] == [(5, True)]
    # delta 4 was fetched with the first plan but nothing was applied before the replan
    assert [(m.kind, m.version) for m in res.applied] == [("full", 8), ("delta", 9)]

    # a missing blob behaves the same way
    path.unlink()
    g = WeightFollower(state=clone(versions[2]), version=2, stores=[store])
    g.observe(manifests)
    res = g.update(9)
    assert g.version == 9
    assert_same(g.state, versions[9])
    assert [(m.version, "no such blob" in why) for m, why in res.failures] == [(5, True)]
    assert [(m.kind, m.version) for m in res.applied] == [("full", 8), ("delta", 9)]
    # and a target only reachable through the broken delta has no plan
    h = WeightFollower(state=clone(versions[4]), version=4, stores=[store])
    h.observe(manifests)
    with pytest.raises(NoPlanError):
        h.update(7)
    assert h.version == 4
    assert_same(h.state, versions[4])
    # update_reachable goes as far as the chain allows: a fresh follower reaches v4 (full)
    # when v7 needs the broken delta; one already at v4 has nothing newer to reach
    k = WeightFollower(stores=[store])
    k.observe(manifests)
    assert k.update_reachable(7).version == 4 and k.version == 4
    assert_same(k.state, versions[4])
    with pytest.raises(NoPlanError):
        h.update_reachable(7)
    assert h.update_reachable().version == 9  # the newest, through full v8


def test_follower_raises_when_nothing_usable(tmp_path):
    versions = chain(3, seed=2)
    store = FileBlobStore(tmp_path)
    manifests = publish_all(store, versions, anchor_interval=100)
    for p in tmp_path.iterdir():
        if ".full." in p.name:
            p.unlink()
    f = WeightFollower(stores=[store])
    f.observe(manifests)
    with pytest.raises(NoPlanError):
        f.update()
    assert f.state is None and f.version is None


def m_(version, kind, size, base=None, policy="p"):
    return WeightManifest(
        policy=policy,
        version=version,
        base_version=base if kind == "delta" else None,
        kind=kind,
        dtype="bfloat16",
        tensors=[],
        blobs=[BlobRef(f"file:///x/{kind}{version}", size, "0" * 64)],
        num_params=1000,
        num_changed=10,
        sparsity=0.99,
        encoded_bytes=size,
        trainer_step=version,
    )


def history(n=25, interval=10, full=1000, delta=15):
    ms = []
    for v in range(n):
        if v % interval == 0:
            ms.append(m_(v, "full", full))
        if v > 0:
            ms.append(m_(v, "delta", delta, base=v - 1))
    return ms


def kinds(plan):
    return [(m.kind, m.version) for m in plan]


def test_plan_picks_chains_and_anchors():
    ms = history()  # fulls at 0, 10, 20 (1000 bytes), deltas 1..24 (15 bytes)
    tail = [("delta", v) for v in (21, 22, 23, 24)]
    # nothing held: nearest anchor at or below the target, then deltas
    assert kinds(plan_update(None, 24, ms)) == [("full", 20)] + tail
    assert kinds(plan_update(None, 20, ms)) == [("full", 20)]
    assert kinds(plan_update(None, 13, ms)) == [
        ("full", 10),
        ("delta", 11),
        ("delta", 12),
        ("delta", 13),
    ]
    # one behind an anchor: the delta, not the anchor's full checkpoint
    assert kinds(plan_update(19, 20, ms)) == [("delta", 20)]
    # a chain cheaper than a full checkpoint is taken
    assert kinds(plan_update(5, 24, ms)) == [("delta", v) for v in range(6, 25)]
    # a chain dearer than anchor + deltas loses to them
    dear = history(delta=100)
    assert kinds(plan_update(5, 24, dear)) == [("full", 20)] + tail
    assert kinds(plan_update(5, 9, dear)) == [("delta", v) for v in range(6, 10)]
    # held == target: nothing to do; held ahead of the target: a full checkpoint
    assert plan_update(12, 12, ms) == []
    assert kinds(plan_update(23, 21, ms)) == [("full", 20), ("delta", 21)]
    # equal bytes: fewer steps wins
    tie = [
        m_(0, "full", 100),
        m_(1, "delta", 50, base=0),
        m_(2, "delta", 50, base=1),
        m_(2, "delta", 100, base=0),
    ]
    assert kinds(plan_update(0, 2, tie)) == [("delta", 2)]
    assert plan_update(0, 2, tie)[0].base_version == 0


def test_plan_routes_around_excluded_manifests():
    ms = history()

    def key(kind, version):
        return manifest_key(next(m for m in ms if m.kind == kind and m.version == version))

    # the anchor's delta is bad: take the anchor's full checkpoint
    assert kinds(plan_update(19, 20, ms, exclude={key("delta", 20)})) == [("full", 20)]
    # the newest anchor is bad: the one before it, then deltas
    plan = plan_update(None, 24, ms, exclude={key("full", 20)})
    assert kinds(plan) == [("full", 10)] + [("delta", v) for v in range(11, 25)]
    # a bad delta past the last anchor leaves no way to the target
    with pytest.raises(NoPlanError):
        plan_update(21, 24, ms, exclude={key("delta", 22)})
    with pytest.raises(NoPlanError):
        plan_update(None, 30, ms)
    with pytest.raises(NoPlanError):
        plan_update(3, 5, [m for m in ms if m.version != 4])


def test_retention_and_gc(tmp_path):
    versions = chain(12, seed=3)
    store = FileBlobStore(tmp_path / "blobs")
    manifests = publish_all(store, versions, anchor_interval=4)
    mdir = tmp_path / "manifests"
    for m in manifests:
        save_manifest(m, mdir)
    assert len(load_manifests(mdir)) == len(manifests)
    kept = retained_manifests(manifests, keep_last=3)  # versions 9..11 -> from the full at 8
    assert min(m.version for m in kept) == 8
    assert retained_manifests(manifests, None) == manifests
    all_ids = {b.blob_id for b in store.list()}
    assert len(all_ids) == len(manifests)

    dry = collect_garbage(store, kept, min_age_s=0, dry_run=True)
    assert dry.removed == [] and len(dry.unreachable) == len(manifests) - len(kept)
    young = collect_garbage(store, kept, min_age_s=3600)
    assert young.removed == [] and len(young.too_young) == len(dry.unreachable)
    res = collect_garbage(store, kept, min_age_s=0)
    assert sorted(res.removed) == sorted(dry.unreachable)
    assert {b.blob_id for b in store.list()} == {m.blobs[0].uri.rsplit("/", 1)[1] for m in kept}
    # the retained history still serves every kept version
    f = WeightFollower(stores=[store])
    f.observe(kept)
    f.update(9)
    assert_same(f.state, versions[9])
    f.update()
    assert_same(f.state, versions[11])


def test_cli_inspect_plan_and_gc(tmp_path, capsys):
    versions = chain(6, seed=4)
    store = FileBlobStore(tmp_path / "blobs")
    manifests = publish_all(store, versions, anchor_interval=3)
    mdir = tmp_path / "manifests"
    for m in manifests:
        save_manifest(m, mdir)
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command")
    wcli.register(sub)

    def run(*argv):
        args = parser.parse_args(["weights", *argv])
        return args.func(args)

    blob_file = tmp_path / "blobs" / manifests[1].blobs[0].uri.rsplit("/", 1)[1]
    assert run("inspect", str(blob_file), "--tensors") == 0
    out = capsys.readouterr().out
    assert "delta blob" in out and "emb" in out
    ref = manifests[1].blobs[0]
    assert f"sha256 {ref.sha256}" in out
    assert run("inspect", str(blob_file), "--sha256", ref.sha256) == 0
    assert "(as expected)" in capsys.readouterr().out
    assert run("inspect", str(blob_file), "--sha256", "0" * 64) == 1
    assert "does not match the expected" in capsys.readouterr().err
    assert run("plan", "--manifests", str(mdir), "--held", "1") == 0
    assert "v1 -> v5" in capsys.readouterr().out
    keep_dir = tmp_path / "keep"
    for m in retained_manifests(manifests, keep_last=1):
        save_manifest(m, keep_dir)
    assert run("gc", "--store", store.uri, "--manifests", str(keep_dir), "--min-age", "0") == 0
    out = capsys.readouterr().out
    assert "deleted" in out
    assert len(store.list()) == len(retained_manifests(manifests, keep_last=1))
    assert run("inspect", str(tmp_path / "missing")) == 2


def test_publisher_resume_and_versions(tmp_path):
    versions = chain(4, seed=5)
    store = FileBlobStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=10)
    m0 = pub.publish(versions[0])
    m1 = pub.publish(versions[1], trainer_step=7)
    assert [m.kind for m in m0] == ["full"] and [m.kind for m in m1] == ["delta"]
    assert m1[0].trainer_step == 7 and m1[0].base_version == 0
    with pytest.raises(ValueError):
        pub.publish(versions[2], version=1)
    # resume: a new publisher that knows v1 emits a delta for v2
    pub2 = WeightPublisher(store, "p", anchor_interval=10, version=1, state=versions[1])
    m2 = pub2.publish(versions[2])
    assert [(m.kind, m.version, m.base_version) for m in m2] == [("delta", 2, 1)]
    # without a base, the first publish is a full checkpoint whatever its number
    pub3 = WeightPublisher(store, "p", anchor_interval=10)
    assert [m.kind for m in pub3.publish(versions[3], version=3)] == ["full"]
    f = WeightFollower(stores=[store])
    f.observe(m0 + m1 + m2)
    f.update()
    assert_same(f.state, versions[2])


def test_bench_smoke(capsys):
    spec = importlib.util.spec_from_file_location("bench_weights", REPO / "bench" / "weights.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--params", "2e6", "--sparsity", "0.99", "--threads", "2"]) == 0
    out = capsys.readouterr().out
    assert "clustered" in out and "uniform" in out and "full checkpoint" in out


def test_bench_patterns_hit_their_sparsity():
    spec = importlib.util.spec_from_file_location("bench_weights", REPO / "bench" / "weights.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    old = mod.make_model(int(3e6), 0)
    for pattern in ("uniform", "clustered"):
        new = mod.perturb(old, 0.99, pattern, 2**-8, 1)
        _, stats = encode_delta(old, new)
        assert 0.985 < stats.sparsity < 0.995, (pattern, stats.sparsity)
