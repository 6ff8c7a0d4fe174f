"""Deltas found with torch on the tensors' device (sum64 checksums), and publishing split
into prepare() and write() (no broker needed). The same code runs on CPU tensors here; the
CUDA variant runs where a GPU is present."""

from __future__ import annotations

import json
import random
import threading

import numpy as np
import pytest
import torch

from astraflow.weights import (
    BaseMismatchError,
    FileBlobStore,
    WeightFollower,
    WeightPublisher,
    WeightsError,
    apply_blob,
    apply_delta,
    encode_delta,
    extract,
    extract_delta,
    inspect_blob,
    iter_encode_extracted,
)
from astraflow.weights.bits import state_bytes_equal
from astraflow.weights.checksums import _SUM_MULT, _SUM_MULT_I64, _sum64, _torch_weighted
from tests.conftest import load_bench

DTYPES = {
    "bf16": [torch.bfloat16],
    "fp32": [torch.float32],
    "mixed": [torch.bfloat16, torch.float32, torch.float16, torch.float64, torch.uint8],
}
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


def model(seed: int, dtypes, device="cpu") -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shapes = [(64, 48), (1000,), (3, 5, 7), (1,), (), (0, 4), (130, 9)]
    out = {}
    for i, shape in enumerate(shapes):
        dt = dtypes[i % len(dtypes)]
        t = torch.randn(shape, generator=g) * 0.02
        out[f"t{i}"] = (t.abs() * 5000).to(dt) if dt == torch.uint8 else t.to(dt)
    return {k: v.to(device) for k, v in out.items()}


def step(state, seed: int, frac: float):
    g = torch.Generator().manual_seed(seed)
    out = {}
    for k, t in state.items():
        mask = (torch.rand(t.shape, generator=g) < frac).to(t.device)
        if t.dtype == torch.uint8:
            out[k] = torch.where(mask, t + 1, t)
        else:
            out[k] = torch.where(mask, (t.double() * 1.02 + 1e-4).to(t.dtype), t)
    return out


def chain(n: int, dtypes, device="cpu", seed: int = 0):
    """Versions with a very sparse, a sparse and an all-changed step among them."""
    out = [model(seed, dtypes, device)]
    for i in range(1, n):
        out.append(step(out[-1], seed * 100 + i, (0.01, 0.2, 1.0)[i % 3]))
    return out


def cpu(state):
    return {k: t.cpu() for k, t in state.items()}


# --------------------------------------------------------------------------- sum64


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
def test_int64_arithmetic_wraps_like_uint64(device):
    """sum64 relies on torch's int64 products and sums wrapping mod 2**64."""
    rng = np.random.default_rng(0)
    a = rng.integers(0, 2**64, size=10_000, dtype=np.uint64)
    b = rng.integers(0, 2**64, size=10_000, dtype=np.uint64)
    ta = torch.from_numpy(a.view(np.int64)).to(device)
    tb = torch.from_numpy(b.view(np.int64)).to(device)
    prod = (ta * tb).cpu().numpy().view(np.uint64)
    assert np.array_equal(prod, a * b)
    assert int(torch.cumsum(ta * tb, 0)[-1].item()) % 2**64 == int((a * b).sum(dtype=np.uint64))
    assert int((ta * _SUM_MULT_I64).sum().item()) % 2**64 == int(
        (a * np.uint64(_SUM_MULT)).sum(dtype=np.uint64))
    assert torch.tensor([2**62], dtype=torch.int64, device=device).mul(4).item() == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=CUDA)])
@pytest.mark.parametrize("size", [1, 2, 4, 8])
def test_device_and_numpy_sum64_agree(device, size):
    rng = np.random.default_rng(size)
    unsigned = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[size]
    bits = rng.integers(0, 2 ** (8 * size), size=5000, dtype=unsigned)
    pos = np.sort(rng.choice(1 << 22, size=5000, replace=False))
    # the views extract_delta compares: uint8, else signed integers of the element's size
    signed = torch.from_numpy((bits if size == 1 else bits.view(f"<i{size}")).copy()).to(device)
    w = _torch_weighted(signed, torch.from_numpy(pos).to(device))
    assert int(w.sum().item()) % 2**64 == _sum64(bits, pos)


# --------------------------------------------------------------------------- codec


@pytest.mark.parametrize("dtypes", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("segment_elems", [1 << 22, 100, 7])
def test_extracted_delta_applies_like_the_crc_delta(dtypes, segment_elems):
    vs = chain(5, DTYPES[dtypes])
    for a, b in zip(vs, vs[1:], strict=False):
        ext = extract_delta(a, b, segment_elems=segment_elems)
        blob = b"".join(iter_encode_extracted(ext, threads=2))
        crc, stats = encode_delta(a, b, segment_elems=segment_elems)
        assert ext.num_changed == stats.num_changed
        assert state_bytes_equal(apply_delta(a, blob), b)
        assert state_bytes_equal(apply_delta(a, blob), apply_delta(a, crc))
        info = inspect_blob(blob)
        assert (info.format_version, info.checksum) == (2, "sum64")
        assert info.num_changed <= info.num_params and info.total_bytes == len(blob)
        assert inspect_blob(crc).checksum == "crc32"


@pytest.mark.parametrize("pass_elems", [1, 256, 5000])
def test_passes_of_any_size_give_the_same_blob(monkeypatch, pass_elems):
    """Tensors split over several passes, and several tensors in one pass."""
    vs = chain(3, DTYPES["mixed"])
    want = {seg: b"".join(iter_encode_extracted(extract_delta(vs[1], vs[2], segment_elems=seg)))
            for seg in (100, 7)}
    monkeypatch.setattr(extract, "_DEVICE_CHUNK", pass_elems)
    for seg, blob in want.items():
        ext = extract_delta(vs[1], vs[2], segment_elems=seg)
        assert b"".join(iter_encode_extracted(ext)) == blob
        assert state_bytes_equal(apply_delta(vs[1], blob), vs[2])


def test_a_wrong_base_is_refused_by_sum64_and_nothing_is_written():
    vs = chain(4, DTYPES["mixed"])
    for seg in (1 << 22, 50):
        blob = b"".join(iter_encode_extracted(extract_delta(vs[1], vs[2], segment_elems=seg)))
        for base in (vs[0], vs[3]):
            work = {k: t.clone() for k, t in base.items()}
            with pytest.raises(BaseMismatchError):
                apply_delta(work, blob, inplace=True)
            assert state_bytes_equal(work, base)
    # one changed element with a base that differs only there
    old = {"w": torch.zeros(1000, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][500] = 1.0
    blob = b"".join(iter_encode_extracted(extract_delta(old, new)))
    wrong = {"w": old["w"].clone()}
    wrong["w"][500] = 2.0
    with pytest.raises(BaseMismatchError):
        apply_delta(wrong, blob)


def test_a_tampered_sum64_blob_is_never_half_applied():
    vs = chain(3, DTYPES["mixed"])
    old, new = vs[0], vs[1]
    blob = b"".join(iter_encode_extracted(extract_delta(old, new, segment_elems=300)))
    rng = random.Random(0)
    errors = 0
    positions = sorted(rng.sample(range(len(blob)), 200))
    for pos in positions:
        bad = bytearray(blob)
        bad[pos] ^= 1 << rng.randrange(8)
        work = {k: t.clone() for k, t in old.items()}
        try:
            apply_delta(work, bytes(bad), inplace=True)
        except WeightsError:
            errors += 1
            assert state_bytes_equal(work, old)
        else:  # bytes that carry no data (free-form header meta)
            assert state_bytes_equal(work, new)
    assert errors > 0.9 * len(positions)


def test_extraction_holds_only_the_changes():
    old = {"w": torch.zeros(1 << 20, dtype=torch.bfloat16)}
    new = {"w": old["w"].clone()}
    new["w"][::1000] = 1.0
    ext = extract_delta(old, new)
    assert ext.num_changed == 1049
    # positions (4 bytes) and XORs (2 bytes) of the changes, plus per-segment figures
    assert ext.host_bytes < 1049 * 6 + 100
    unchanged = extract_delta(old, old)
    assert unchanged.num_changed == 0 and unchanged.host_bytes == 0


# --------------------------------------------------------------------------- publishing


def follow_both(tmp_path, vs, use_prepare=True):
    """Publish ``vs`` with the CRC path and the device path; follow each; compare."""
    store = FileBlobStore(tmp_path)
    crc_pub = WeightPublisher(store, "crc", anchor_interval=3, device_delta=False, threads=2)
    dev_pub = WeightPublisher(store, "dev", anchor_interval=3, device_delta=True, threads=2)
    crc_f = WeightFollower(stores=[store], policy="crc")
    dev_f = WeightFollower(stores=[store], policy="dev", inplace=False)
    for v, s in enumerate(vs):
        crc_f.observe(crc_pub.publish(s))
        if use_prepare:
            pv = dev_pub.prepare(s)
            ms = pv.write()
        else:
            ms = dev_pub.publish(s)
        assert [m.kind for m in ms] == (["full"] if v == 0 else ["delta", "full"] if v % 3 == 0
                                        else ["delta"])
        for m in ms:
            assert float(m.meta["extract_s"]) >= 0 and float(m.meta["encode_s"]) >= 0
            with store.open(m.blobs[0]) as f:
                info = inspect_blob(f)
            assert info.checksum == ("sum64" if m.kind == "delta" else "crc32")
        dev_f.observe(ms)
        crc_f.update()
        dev_f.update()
        assert state_bytes_equal(dev_f.state, cpu(s)), f"v{v}"
        assert state_bytes_equal(dev_f.state, crc_f.state)
    return dev_pub


@pytest.mark.parametrize("dtypes", list(DTYPES), ids=list(DTYPES))
def test_device_path_publishes_what_the_crc_path_does(tmp_path, dtypes):
    pub = follow_both(tmp_path, chain(8, DTYPES[dtypes]))
    assert state_bytes_equal(pub._prev, chain(8, DTYPES[dtypes])[-1])


def test_publish_equals_prepare_then_write(tmp_path):
    # publish() on the device path: every version followed bit for bit, as prepare().write()
    # and the CRC path give it (follow_both checks each version)
    published = follow_both(tmp_path / "publish", chain(5, DTYPES["bf16"]), use_prepare=False)
    prepared = follow_both(tmp_path / "prepare", chain(5, DTYPES["bf16"]), use_prepare=True)
    assert state_bytes_equal(published._prev, prepared._prev)
    assert state_bytes_equal(published._prev, chain(5, DTYPES["bf16"])[-1])


@pytest.mark.parametrize("device_delta", [False, True])
def test_prepare_lets_the_caller_change_the_state(tmp_path, device_delta):
    vs = chain(4, DTYPES["mixed"])
    store = FileBlobStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=2, device_delta=device_delta)
    f = WeightFollower(stores=[store])
    work = {k: t.clone() for k, t in vs[0].items()}
    for v in range(len(vs)):
        for k in work:
            work[k].copy_(vs[v][k])
        pv = pub.prepare(work, trainer_step=v)
        for t in work.values():  # the next training step starts at once
            t.zero_()
        f.observe(pv.write())
        f.update()
        assert state_bytes_equal(f.state, vs[v]), f"v{v}"


def test_prepare_finishes_the_previous_write_and_write_runs_once(tmp_path):
    vs = chain(4, DTYPES["bf16"])
    store = FileBlobStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=10, device_delta=True)
    first = pub.prepare(vs[0])
    second = pub.prepare(vs[1])  # nobody wrote v0 yet: prepare does it
    assert first.done and not second.done
    got: list = []
    writer = threading.Thread(target=lambda: got.append(second.write()))
    writer.start()
    writer.join()
    assert [m.uri for m in got[0][0].blobs] == [m.uri for m in second.write()[0].blobs]
    assert len(store.list()) == 2  # written once each
    f = WeightFollower(stores=[store])
    f.observe(first.write() + got[0])
    f.update()
    assert state_bytes_equal(f.state, vs[1])


class FlakyStore(FileBlobStore):
    """A file store whose next ``put`` fails when ``fail`` is set."""

    fail = False

    def put(self, blob_id, data):
        if self.fail:
            self.fail = False
            raise OSError("disk full")
        return super().put(blob_id, data)


@pytest.mark.parametrize("device_delta", [False, True])
def test_a_failed_write_makes_the_next_version_a_full_checkpoint(tmp_path, device_delta):
    vs = chain(4, DTYPES["bf16"])
    store = FlakyStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=10, device_delta=device_delta)
    f = WeightFollower(stores=[store])
    f.observe(pub.prepare(vs[0]).write())
    pv = pub.prepare(vs[1])
    store.fail = True
    with pytest.raises(OSError, match="disk full"):
        pv.write()
    with pytest.raises(OSError, match="disk full"):  # the same outcome again
        pv.write()
    assert pub.version == 0
    ms = pub.prepare(vs[2], version=1).write()  # its number may be used again
    assert [(m.kind, m.version) for m in ms] == [("full", 1)]
    ms += pub.prepare(vs[3]).write()
    assert [(m.kind, m.version, m.base_version) for m in ms[1:]] == [("delta", 2, 1)]
    f.observe(ms)
    f.update()
    assert state_bytes_equal(f.state, vs[3])


def test_publish_keeps_its_old_behaviour_when_a_put_fails(tmp_path):
    vs = chain(3, DTYPES["bf16"])
    store = FlakyStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=10)
    pub.publish(vs[0])
    store.fail = True
    with pytest.raises(OSError):
        pub.publish(vs[1], version=1)
    ms = pub.publish(vs[1], version=1)  # retried: still a delta against v0
    assert [(m.kind, m.base_version) for m in ms] == [("delta", 0)]


def test_device_delta_defaults_to_the_states_device(tmp_path):
    pub = WeightPublisher(FileBlobStore(tmp_path), "p")
    pub.publish(chain(1, DTYPES["bf16"])[0])
    assert all(t.device.type == "cpu" for t in pub._prev.values())
    ms = pub.publish(chain(2, DTYPES["bf16"])[1])
    with pub.store.open(ms[0].blobs[0]) as f:
        assert inspect_blob(f).checksum == "crc32"  # CPU state: the CPU path


@CUDA
@pytest.mark.parametrize("dtypes", list(DTYPES), ids=list(DTYPES))
def test_device_path_on_cuda(tmp_path, dtypes):
    vs = chain(7, DTYPES[dtypes], device="cuda")
    store = FileBlobStore(tmp_path)
    pub = WeightPublisher(store, "p", anchor_interval=3)  # device_delta: on for CUDA
    f = WeightFollower(stores=[store])
    for v, s in enumerate(vs):
        ms = pub.prepare(s).write()
        assert all(t.device.type == "cuda" for t in pub._prev.values())
        for m in ms:
            with store.open(m.blobs[0]) as blob:
                assert inspect_blob(blob).checksum == ("sum64" if m.kind == "delta" else "crc32")
        f.observe(ms)
        f.update()
        assert state_bytes_equal(f.state, cpu(s)), f"v{v}"
    # the blob made on the GPU is the one made from the same states on the CPU
    a, b = cpu(vs[1]), cpu(vs[2])
    on_gpu = b"".join(iter_encode_extracted(extract_delta(vs[1], vs[2], segment_elems=100)))
    on_cpu = b"".join(iter_encode_extracted(extract_delta(a, b, segment_elems=100)))
    assert on_gpu == on_cpu
    assert state_bytes_equal(apply_blob(a, on_gpu), b)


def test_bench_smoke(capsys, tmp_path):
    bench = load_bench("weights_device")
    out = tmp_path / "r.json"
    assert bench.main(["--params", "0.3", "--versions", "1", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "cpu path" in text and "device path" in text and "extract_s" in text
    rows = json.loads(out.read_text())["rows"]
    # both paths saw the same change
    assert rows["cpu path"][0]["changed"] == rows["device path"][0]["changed"] > 0
