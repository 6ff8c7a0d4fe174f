"""fp32 against bf16 matmul time on this CPU, side by side: whether bf16 compute pays.

CPUs without bf16 matrix instructions (AVX512-BF16, AMX) run bf16 matmuls far slower
than fp32, so on them the engines and the trainer should compute in fp32 (the published
weights stay bf16). Shapes are SmolLM2-135M's MLP projection for a decode step of 64 rows
and a training pass of 512 rows.

    python bench/matmul_dtypes.py [--threads 1]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)


def per_call_ms(rows: int, dtype: torch.dtype, calls: int) -> float:
    a = torch.randn(rows, 576, dtype=dtype)
    w = torch.randn(1536, 576, dtype=dtype)
    for _ in range(3):
        a @ w.T
    t = time.perf_counter()
    for _ in range(calls):
        a @ w.T
    return (time.perf_counter() - t) / calls * 1e3


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=100)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    meta = run_meta("matmul_dtypes", ["python", *sys.argv] if argv is None
                    else ["python", "bench/matmul_dtypes.py", *argv])
    torch.set_num_threads(args.threads)
    rows_out = []
    print(f"| rows x 576 @ 576 x 1536, {args.threads} thread(s) | fp32 ms | bf16 ms "
          "| bf16 / fp32 |")
    print("|---|---|---|---|")
    for rows in (64, 512):
        f32 = per_call_ms(rows, torch.float32, args.calls)
        b16 = per_call_ms(rows, torch.bfloat16, args.calls)
        print(f"| {rows} | {f32:.2f} | {b16:.2f} | {b16 / f32:.1f}x |")
        rows_out.append({"rows": rows, "fp32_ms": f32, "bf16_ms": b16, "bf16_over_fp32": b16 / f32})
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta, "threads": args.threads,
                                        "calls": args.calls, "rows": rows_out}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
