"""Benchmark of the bf16 weight-delta codec (``astraflow.weights``).

Builds a synthetic transformer-shaped bf16 model (``--params``, default 1e9), derives a new
version from it at each sparsity and change pattern, and prints for each:

* encoded delta size as % of the full bf16 model, and the reference encoding's size
  (uint32 index when the model has < 2**32 elements else uint64, plus the 2-byte value,
  uncompressed);
* encode and decode throughput in GB of model (2 bytes per parameter) per second, with
  one thread and with ``--threads`` threads, best of ``--repeat`` runs; decode = sha256
  check of the blob + applying it in place (every CRC check included), and the result is
  compared bit for bit;
* peak extra memory of encode and decode, measured with tracemalloc in a separate, untimed
  run: numpy buffers and Python objects (zstd's own contexts, about 1 MB per thread, are
  not seen). Encode is measured streamed into a hashing sink, the way the blob stores
  consume it (``encode_delta``, which returns the blob as bytes, holds the blob on top);
  decode is ``apply_delta(..., inplace=True)``: the decoded changes of the whole blob are
  held until every check has passed, then written.

Change patterns:

``uniform``
    every element changes independently with probability 1 - sparsity.
``clustered``
    80 % of the changes sit in "hot" rows of each matrix (a few rows, each 30 % changed),
    in runs of consecutive elements (geometric lengths, mean 6), the way Adam updates on
    the embedding rows of the tokens in a batch or on a few attention heads look; the
    other 20 % are uniform background. Vectors use the uniform pattern.

Values: at each changed position ``new = bf16(old * (1 + d))`` with ``d ~ N(0, s)``,
``s = --perturb`` (default 2**-8, about one bf16 ulp), so bf16 rounding decides which
bits change; where rounding leaves the bits as they were, the value moves one ulp in the
direction of ``d`` so that exactly the drawn positions change.

Run: ``python bench/weights.py`` (1e9 parameters, needs about 10 GB of RAM) or
``python bench/weights.py --params 1e8`` for a quick run.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import math
import os
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

try:
    import astraflow.weights  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from astraflow.weights.apply import apply_delta, decode_full
from astraflow.weights.bits import state_bytes_equal
from astraflow.weights.encode import (
    EncodeStats,
    encode_delta,
    encode_full,
    iter_encode_delta,
    iter_encode_full,
)
from astraflow.weights.pipeline import default_threads

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

GB = 1e9


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- memory


def timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    """(result, seconds) of ``fn()``."""
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def peak_extra_memory(fn: Callable[[], Any]) -> int:
    """Peak bytes allocated during ``fn()`` beyond what was live before it (tracemalloc).

    Counts numpy buffers and Python objects (zstd output included); zstd's own contexts
    (about 1 MB per thread) and torch allocations are not seen, so callers add the size of
    any tensors they know the call creates.
    """
    tracemalloc.start()
    try:
        base, _ = tracemalloc.get_traced_memory()
        tracemalloc.reset_peak()
        out = fn()
        _, peak = tracemalloc.get_traced_memory()
        del out
    finally:
        tracemalloc.stop()
    return peak - base


# --------------------------------------------------------------------------- model


def model_shapes(params: int) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-like tensor shapes adding up to roughly ``params`` elements."""
    h = max(128, 128 * round(math.sqrt(params / 192) / 128))
    inter = 64 * round(2.75 * h / 64)
    vocab = max(256, min(32000, int(0.125 * params / h)))
    per_layer = 4 * h * h + 3 * h * inter + 2 * h
    layers = max(1, round((params - 2 * vocab * h - h) / per_layer))
    shapes: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (h, h)),
            (p + "self_attn.k_proj.weight", (h, h)),
            (p + "self_attn.v_proj.weight", (h, h)),
            (p + "self_attn.o_proj.weight", (h, h)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (vocab, h))]
    return shapes


def make_model(params: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    state = {}
    chunk = 1 << 24
    for name, shape in model_shapes(params):
        t = torch.empty(shape, dtype=torch.bfloat16)
        flat = t.view(-1)
        for s in range(0, flat.numel(), chunk):
            e = min(flat.numel(), s + chunk)
            x = torch.randn(e - s, generator=gen)
            if len(shape) == 1:
                x.mul_(0.05).add_(1.0)
            else:
                x.mul_(0.02)
            flat[s:e] = x
        state[name] = t
    return state


def _bernoulli_positions(rng: np.random.Generator, n: int, p: float) -> np.ndarray:
    """Positions of a Bernoulli(p) process over [0, n), drawn as geometric gaps (O(k))."""
    if p <= 0 or n == 0:
        return np.empty(0, dtype=np.int64)
    parts = []
    start = -1
    while True:
        m = int(n * p * 1.05) + 64
        pos = start + np.cumsum(rng.geometric(p, size=m))
        parts.append(pos[pos < n])
        if pos[-1] >= n:
            break
        start = int(pos[-1])
    return np.concatenate(parts)


def change_mask(
    rng: np.random.Generator, shape: tuple[int, ...], density: float, pattern: str
) -> np.ndarray:
    n = math.prod(shape)
    mask = np.zeros(n, dtype=bool)
    if pattern == "uniform" or len(shape) < 2:
        mask[_bernoulli_positions(rng, n, density)] = True
        return mask
    rows, cols = shape[0], n // shape[0]
    mask[_bernoulli_positions(rng, n, 0.2 * density)] = True
    hot_density, mean_run = 0.3, 6.0
    n_hot = min(rows, max(1, round(rows * 0.8 * density / hot_density)))
    hot = np.sort(rng.choice(rows, n_hot, replace=False))
    starts = _bernoulli_positions(rng, n_hot * cols, hot_density / mean_run)
    lengths = rng.geometric(1 / mean_run, size=starts.size)
    offs = np.arange(int(lengths.sum())) - np.repeat(np.cumsum(lengths) - lengths, lengths)
    idx = np.repeat(starts, lengths) + offs
    idx = idx[idx < n_hot * cols]
    mask[hot[idx // cols] * cols + idx % cols] = True
    return mask


def perturb(
    old: dict[str, torch.Tensor], sparsity: float, pattern: str, scale: float, seed: int
) -> dict[str, torch.Tensor]:
    """New version of ``old``: about ``1 - sparsity`` of the elements change (see module doc)."""
    rng = np.random.default_rng(seed)
    gen = torch.Generator().manual_seed(seed)
    new = {}
    for name, t in old.items():
        mask = torch.from_numpy(change_mask(rng, tuple(t.shape), 1 - sparsity, pattern))
        flat = t.reshape(-1)
        ob = flat.view(torch.int16)[mask]
        x = flat[mask].float()
        d = torch.randn(x.numel(), generator=gen) * scale
        nb = (x * (1 + d)).to(torch.bfloat16).view(torch.int16)
        same = nb == ob
        mag = ob & 0x7FFF
        up = (d > 0) | (mag == 0)
        step = torch.where(up, 1, -1).to(torch.int16)
        nb = torch.where(same, ob + step, nb)
        out = t.clone()
        out.view(-1).view(torch.int16)[mask] = nb
        new[name] = out
    return new


# --------------------------------------------------------------------------- bench


def clone_state(s: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in s.items()}


def run_delta(old, new, threads: int, level: int, repeat: int) -> dict[str, Any]:
    def encode():
        return encode_delta(old, new, threads=threads, level=level)

    def encode_streamed():
        # what a blob store does with the stream: hash and write each piece, keep none
        h = hashlib.sha256()
        for piece in iter_encode_delta(old, new, threads=threads, level=level):
            h.update(piece)
        return h.hexdigest()

    enc_s = math.inf
    for _ in range(repeat):
        (blob, stats), dt = timed(encode)
        enc_s = min(enc_s, dt)
    enc_mem = peak_extra_memory(encode_streamed)
    sha = hashlib.sha256(blob).hexdigest()

    def decode(work):
        if hashlib.sha256(blob).hexdigest() != sha:
            raise AssertionError("sha mismatch")
        return apply_delta(work, blob, inplace=True, threads=threads)

    dec_s = math.inf
    for _ in range(repeat):
        work = clone_state(old)
        out, dt = timed(functools.partial(decode, work))
        dec_s = min(dec_s, dt)
    if not state_bytes_equal(out, new):
        raise AssertionError("decoded state differs from the new version")
    del out
    work = clone_state(old)
    dec_mem = peak_extra_memory(functools.partial(decode, work))
    return dict(
        blob=len(blob),
        stats=stats,
        enc_s=enc_s,
        enc_mem=enc_mem,
        dec_s=dec_s,
        dec_mem=dec_mem,
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1e9, help="model size (default 1e9)")
    ap.add_argument("--sparsity", type=float, nargs="+", default=[0.97, 0.99, 0.996])
    ap.add_argument(
        "--patterns", nargs="+", default=["clustered", "uniform"], choices=["clustered", "uniform"]
    )
    ap.add_argument(
        "--threads",
        type=int,
        default=default_threads(),
        help="threads for the multi-threaded figures (one-thread figures always)",
    )
    ap.add_argument("--level", type=int, default=1, help="zstd level (default 1)")
    ap.add_argument(
        "--perturb",
        type=float,
        default=2**-8,
        help="relative std of the value perturbation (default 2**-8)",
    )
    ap.add_argument("--repeat", type=int, default=3, help="timed runs, best kept (default 3)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-checkpoint row")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=None, metavar="FILE",
                    help="write the rows as JSON here (with the run's meta block)")
    args = ap.parse_args(argv)
    meta = run_meta("weights", ["python", *(sys.argv if argv is None else
                                            ["bench/weights.py", *argv])])
    torch.set_num_threads(max(1, args.threads))
    load_before = os.getloadavg()[0]
    log(f"building a synthetic bf16 model of about {args.params:.3g} parameters")
    old = make_model(int(args.params), args.seed)
    n = sum(t.numel() for t in old.values())
    full_bytes = 2 * n
    idx_bytes = 4 if n < 2**32 else 8
    gbm = full_bytes / GB
    log(
        f"model: {len(old)} tensors, {n:,} parameters, {full_bytes / 1e6:,.0f} MB bf16; "
        f"largest tensor {max(t.numel() for t in old.values()):,} elements"
    )
    thread_set = [1] if args.threads <= 1 else [1, args.threads]

    rows = []
    for pattern in args.patterns:
        for sp in args.sparsity:
            log(f"{pattern} sparsity {sp}: generating the new version")
            new = perturb(old, sp, pattern, args.perturb, args.seed + 1)
            res = {}
            for th in thread_set:
                log(f"{pattern} sparsity {sp}: encode/decode with {th} thread(s)")
                res[th] = run_delta(old, new, th, args.level, args.repeat)
            st = res[1]["stats"]
            rows.append((pattern, sp, st, res))
            log(
                f"  changed {st.num_changed:,} ({1 - st.sparsity:.4%}), blob "
                f"{res[1]['blob'] / 1e6:.2f} MB = {res[1]['blob'] / full_bytes:.3%} of full"
            )
            del new

    full_rows = []
    if not args.no_full:
        for th in thread_set:
            log(f"full checkpoint, {th} thread(s)")

            def enc_full(th=th):
                # Streamed into a byte counter, the way a blob store consumes it.
                stats = EncodeStats("full")
                size = 0
                for piece in iter_encode_full(old, threads=th, level=args.level, stats=stats):
                    size += len(piece)
                return size

            size, enc_s = timed(enc_full)
            enc_mem = peak_extra_memory(enc_full)
            blob, _ = encode_full(old, threads=th, level=args.level)
            out, dec_s = timed(lambda th=th, blob=blob: decode_full(blob, threads=th))
            dec_mem = peak_extra_memory(lambda th=th, blob=blob: decode_full(blob, threads=th))
            if not state_bytes_equal(out, old):
                raise AssertionError("full checkpoint does not round-trip")
            full_rows.append((th, len(blob), enc_s, enc_mem, dec_s, dec_mem))
            del blob, out

    mb = 1e6
    print()
    print(
        f"model: {n:,} bf16 parameters = {full_bytes / mb:,.0f} MB; reference index "
        f"{idx_bytes} B + value 2 B; zstd level {args.level}; perturb {args.perturb:.3g}; "
        f"threads N = {args.threads}; host {os.cpu_count()} CPUs, load average "
        f"{load_before:.2f} before / {os.getloadavg()[0]:.2f} after (1 min)"
    )
    hdr = (
        f"{'pattern':<10} {'sparsity':>8} {'measured':>8} {'changed':>12} {'delta MB':>9} "
        f"{'delta %':>8} {'ref %':>7} {'enc GB/s':>9} {'enc GB/s':>9} {'dec GB/s':>9} "
        f"{'dec GB/s':>9} {'enc peak':>9} {'enc peak':>9} {'dec peak':>9}"
    )
    sub = (
        f"{'':<10} {'target':>8} {'':>8} {'':>12} {'':>9} {'of full':>8} {'of full':>7} "
        f"{'1 thr':>9} {f'{args.threads} thr':>9} {'1 thr':>9} {f'{args.threads} thr':>9} "
        f"{'1 thr MB':>9} {f'{args.threads} thr MB':>9} {'1 thr MB':>9}"
    )
    print(hdr)
    print(sub)
    for pattern, sp, st, res in rows:
        r1, rn = res[1], res[thread_set[-1]]
        ref = st.num_changed * (idx_bytes + 2)
        print(
            f"{pattern:<10} {sp:>8.3f} {st.sparsity:>8.4f} {st.num_changed:>12,} "
            f"{r1['blob'] / mb:>9.2f} {r1['blob'] / full_bytes:>8.3%} {ref / full_bytes:>7.2%} "
            f"{gbm / r1['enc_s']:>9.2f} {gbm / rn['enc_s']:>9.2f} {gbm / r1['dec_s']:>9.2f} "
            f"{gbm / rn['dec_s']:>9.2f} {r1['enc_mem'] / mb:>9.1f} {rn['enc_mem'] / mb:>9.1f} "
            f"{r1['dec_mem'] / mb:>9.1f}"
        )
    for th, size, enc_s, enc_mem, dec_s, dec_mem in full_rows:
        print(
            f"full checkpoint (zstd {args.level}), {th} thread(s): {size / mb:,.1f} MB = "
            f"{size / full_bytes:.1%} of raw bf16; encode {gbm / enc_s:.2f} GB/s, decode "
            f"{gbm / dec_s:.2f} GB/s; peak extra memory encode {enc_mem / mb:,.1f} MB "
            f"(streamed), decode {dec_mem / mb:,.1f} MB + the new state ({full_bytes / mb:,.0f} MB)"
        )
    if args.out:
        write_out(args, meta, n, rows, full_rows, thread_set, load_before)
    return 0


def write_out(args: argparse.Namespace, meta: dict[str, Any], n: int, rows: list,
              full_rows: list, thread_set: list[int], load_before: float) -> None:
    """``--out``: every row's sizes, GB/s and peak memory (1 thread and N threads)."""
    full_bytes, gbm = 2 * n, 2 * n / GB
    out = {"meta": meta, "params": n, "level": args.level, "perturb": args.perturb,
           "threads": args.threads, "load_before": round(load_before, 2), "rows": [], "full": []}
    for pattern, sp, st, res in rows:
        row: dict[str, Any] = {"pattern": pattern, "sparsity_target": sp,
                               "sparsity": round(st.sparsity, 5), "changed": st.num_changed,
                               "delta_bytes": res[1]["blob"],
                               "delta_of_full": res[1]["blob"] / full_bytes}
        for th in thread_set:
            r = res[th]
            row[f"enc_gb_s_{th}thr"] = gbm / r["enc_s"]
            row[f"dec_gb_s_{th}thr"] = gbm / r["dec_s"]
            row[f"enc_peak_mb_{th}thr"] = r["enc_mem"] / 1e6
            row[f"dec_peak_mb_{th}thr"] = r["dec_mem"] / 1e6
        out["rows"].append(row)
    for th, size, enc_s, enc_mem, dec_s, dec_mem in full_rows:
        out["full"].append({"threads": th, "bytes": size, "of_raw": size / full_bytes,
                            "enc_gb_s": gbm / enc_s, "dec_gb_s": gbm / dec_s,
                            "enc_peak_mb": enc_mem / 1e6, "dec_peak_mb": dec_mem / 1e6})
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    sys.exit(main())
