"""fp32 against bf16 matmul time on this CPU, side by side: whether bf16 compute pays.

CPUs without bf16 matrix instructions (AVX512-BF16, AMX) run bf16 matmuls far slower
than fp32, so on them the engines and the trainer should compute in fp32 (the published
weights stay bf16). Shapes are SmolLM2-135M's MLP projection for a decode step of 64 rows
and a training pass of 512 rows.

    python bench/matmul_dtypes.py [--threads 1]
"""

from __future__ import annotations

import argparse
import time

import torch


def per_call_ms(rows: int, dtype: torch.dtype, calls: int) -> float:
    a = torch.randn(rows, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    for _ in range(3):
        a @ w.T
    t = time.perf_counter()
    for _ in range(calls):
        a @ w.T
    return (time.perf_counter() - t) / calls * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=100)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"| rows x 576 @ 576 x 1536, {args.threads} thread(s) | fp32 ms | bf16 ms "
          "| bf16 / fp32 |")
    print("|---|---|---|---|")
    for rows in (64, 512):
        f32 = per_call_ms(rows, torch.float32, args.calls)
        b16 = per_call_ms(rows, torch.bfloat16, args.calls)
        print(f"| {rows} | {f32:.2f} | {b16:.2f} | {b16 / f32:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
