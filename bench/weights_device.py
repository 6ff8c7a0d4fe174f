"""Per-version publish time of a bf16 state: the CPU path against the device path.

``cpu path``
    ``WeightPublisher(device_delta=False).publish``: the previous version kept on the CPU,
    the new state copied to the CPU tensor by tensor, every element compared with numpy,
    CRC-32 of each segment, zstd (``iter_encode_delta``).
``device path``
    ``WeightPublisher(device_delta=True).prepare(...)`` then ``.write()``: the previous
    version kept on ``--device``, changed positions and XORs found there with torch and
    copied to the host (``extract_s``), then packed, zstd-compressed and stored on the CPU
    (``encode_s``; in the trainer this half overlaps the next step).

Both publish the same versions into the same store: a sink that computes the sha256 every
store computes and keeps nothing, so disk speed does not count. The model is bf16 matrices
of 2048 columns (``--params`` million elements in all) plus a few vectors; each version
moves a random ``--changed`` fraction of the elements by one bf16 ulp. Version 0 (a full
checkpoint) is timed apart (``prepare`` then ``write``; on the CPU path ``prepare`` copies
the state to the CPU); then ``--versions`` deltas are timed. Timings are wall-clock
seconds of this machine, one run: compare only numbers from the same run.

Run: ``python bench/weights_device.py`` (20M parameters on the CPU, well under a minute)
or ``python bench/weights_device.py --params 1700 --device cuda`` on a GPU.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Iterable
from typing import Any

import torch

try:
    import astraflow.weights  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.weights.pipeline import default_threads
from astraflow.weights.publisher import WeightPublisher
from astraflow.weights.stores.base import pieces
from astraflow.wire.records import BlobRef

COLS = 2048


class HashingSink:
    """A blob store that hashes what it is given (as every store does) and keeps nothing."""

    uri = "sink://"

    def put(self, blob_id: str, data: Any) -> BlobRef:
        h = hashlib.sha256()
        n = 0
        for p in pieces(data):
            h.update(p)
            n += len(p)
        return BlobRef(uri=f"sink://{blob_id}", bytes=n, sha256=h.hexdigest())


def make_state(params: int, device: str, seed: int = 0) -> dict[str, torch.Tensor]:
    """bf16 matrices of ``COLS`` columns (at most 4096 rows each) and a few norm vectors."""
    g = torch.Generator(device=device).manual_seed(seed)
    state: dict[str, torch.Tensor] = {}
    left, i = params, 0
    while left >= COLS:
        rows = min(4096, left // COLS)
        state[f"layer{i}.weight"] = (torch.randn(rows, COLS, generator=g, device=device)
                                     * 0.02).to(torch.bfloat16)
        state[f"layer{i}.norm"] = torch.ones(COLS, dtype=torch.bfloat16, device=device)
        left -= rows * COLS + COLS
        i += 1
    if left > 0:
        state["tail"] = torch.zeros(left, dtype=torch.bfloat16, device=device)
    return state


def next_version(state: dict[str, torch.Tensor], changed: float, seed: int
                 ) -> dict[str, torch.Tensor]:
    """A ``changed`` fraction of the elements, drawn at random, moved by one ulp."""
    out = {}
    for j, (name, t) in enumerate(state.items()):
        g = torch.Generator(device=t.device).manual_seed(seed * 100_003 + j)
        mask = torch.rand(t.shape, generator=g, device=t.device) < changed
        out[name] = (t.view(torch.int16) + mask.to(torch.int16)).view(torch.bfloat16)
    return out


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(params: int, changed: float, device: str, versions: int, threads: int
        ) -> dict[str, Any]:
    states = [make_state(params, device)]
    for v in range(1, versions + 1):
        states.append(next_version(states[-1], changed, v))
    sync(device)
    n = sum(t.numel() for t in states[0].values())
    rows: dict[str, list[dict[str, float]]] = {"cpu path": [], "device path": []}
    anchors: dict[str, dict[str, float]] = {}
    for path, on_device in (("cpu path", False), ("device path", True)):
        pub = WeightPublisher(HashingSink(), "bench", anchor_interval=0, threads=threads,
                              device_delta=on_device)
        sync(device)
        t0 = time.perf_counter()
        prepared = pub.prepare(states[0])
        t1 = time.perf_counter()
        (m,) = prepared.write()
        anchors[path] = {"extract_s": t1 - t0, "encode_s": time.perf_counter() - t1,
                         "bytes": m.encoded_bytes}
        for v in range(1, versions + 1):
            sync(device)
            t0 = time.perf_counter()
            if on_device:
                prepared = pub.prepare(states[v])
                t1 = time.perf_counter()
                (m,) = prepared.write()
            else:
                (m,) = pub.publish(states[v])
                t1 = t0
            t2 = time.perf_counter()
            rows[path].append({"version": v, "extract_s": t1 - t0, "encode_s": t2 - t1,
                               "total_s": t2 - t0, "bytes": m.encoded_bytes,
                               "changed": m.num_changed})
        del pub
    return {"params": n, "rows": rows, "full": anchors}


def summarize(rows: Iterable[dict[str, float]]) -> dict[str, float]:
    rs = list(rows)
    return {k: statistics.median(r[k] for r in rs)
            for k in ("extract_s", "encode_s", "total_s", "bytes")}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", type=float, default=20, help="million elements (default 20)")
    ap.add_argument("--changed", type=float, default=0.015,
                    help="fraction of elements changed per version (default 0.015)")
    ap.add_argument("--device", default="cpu", help="where the state lives (default cpu)")
    ap.add_argument("--versions", type=int, default=3, help="timed deltas per path")
    ap.add_argument("--threads", type=int, default=default_threads(),
                    help="encoder threads (default min(4, cores))")
    ap.add_argument("--out", help="also write the results as JSON here")
    a = ap.parse_args(argv)
    if not 0 < a.changed <= 1 or a.params <= 0 or a.versions < 1:
        ap.error("need --params > 0, 0 < --changed <= 1, --versions >= 1")
    res = run(int(a.params * 1e6), a.changed, a.device, a.versions, a.threads)
    dev = torch.cuda.get_device_name() if a.device.startswith("cuda") else platform.processor()
    print(f"{res['params'] / 1e6:.1f}M bf16 parameters on {a.device} ({dev or 'cpu'}), "
          f"{a.changed:.2%} changed per version, {a.threads} encoder threads")
    print(f"{'path':<12} {'version':>7} {'extract_s':>10} {'encode_s':>9} {'total_s':>8} "
          f"{'bytes':>12} {'changed':>10}")
    for path, rs in res["rows"].items():
        for r in rs:
            print(f"{path:<12} {r['version']:>7} {r['extract_s']:>10.3f} {r['encode_s']:>9.3f} "
                  f"{r['total_s']:>8.3f} {r['bytes']:>12,} {r['changed']:>10,}")
    cpu_s, dev_s = (summarize(res["rows"][p]) for p in ("cpu path", "device path"))
    print(f"median per version: cpu path {cpu_s['total_s']:.3f} s on the publishing thread; "
          f"device path {dev_s['extract_s']:.3f} s there (prepare) + {dev_s['encode_s']:.3f} s "
          f"in write(); blobs {cpu_s['bytes']:,.0f} vs {dev_s['bytes']:,.0f} bytes")
    for path, r in res["full"].items():
        print(f"version 0 (full checkpoint), {path}: prepare {r['extract_s']:.3f} s + write "
              f"{r['encode_s']:.3f} s, {r['bytes']:,} bytes")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"meta": run_meta("weights_device", ["python", *sys.argv]),
                       "settings": {"params": res["params"], "changed": a.changed,
                                    "device": a.device, "device_name": dev,
                                    "threads": a.threads, "versions": a.versions},
                       "rows": res["rows"], "full": res["full"], "median": {"cpu path": cpu_s,
                                                       "device path": dev_s}}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
