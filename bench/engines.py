"""Rollout engines side by side: TorchEngine and VLLMEngine on the same model, prompts and
sampling, in one run; and the time of a full weight sync into each.

Prompts: ``--prompts`` 2-digit additions ("What is 37+45? Answer with the number only."),
through the tokenizer's chat template when it has one, ``--n`` samples each, all in one
``generate`` call per engine; each length in ``--tokens`` is one round. Samples do not stop
at the end-of-sequence token, so both engines generate exactly prompts x n x tokens
tokens and do the same work. tokens/s = generated tokens / wall time of the call.

Weight sync: a new version of the model is made from the loaded one (a ``--changed``
share of the elements moved by about one bf16 step, as an optimizer step does), encoded
as a bf16 delta with ``astraflow.weights`` (trainer side, reported apart), then timed as
a RaaS node does it: apply the delta to the follower's copy of the state + load that
state into the engine.

Run under the vLLM environment (``bash scripts/vllm-env``)::

    .venv-vllm/bin/python bench/engines.py --model /path/to/smollm2

Engine start times (vLLM's includes its first-run compile) are printed too.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

try:
    import astraflow  # noqa: F401
except ImportError:  # running from a checkout without an install
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch

from astraflow.raas.engine import SamplingParams

if os.path.dirname(os.path.abspath(__file__)) not in sys.path:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)


def addition_prompts(tokenizer: Any, count: int, seed: int) -> list[list[int]]:
    """``count`` 2-digit addition prompts as token ids (chat template when there is one)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        text = f"What is {a}+{b}? Answer with the number only."
        if getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                                add_generation_prompt=True, tokenize=True)
            if not isinstance(ids, list):  # a BatchEncoding
                ids = ids["input_ids"]
        else:
            ids = tokenizer.encode(f"{a}+{b}=", add_special_tokens=False)
        out.append([int(t) for t in ids])
    return out


def rollout(engine: Any, prompts: list[list[int]], params: SamplingParams) -> dict[str, float]:
    """One ``generate`` call: tokens, seconds, tokens/s."""
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    dt = time.perf_counter() - t0
    n = sum(len(g.token_ids) for gs in out for g in gs)
    return {"tokens": float(n), "seconds": dt, "tokens_per_s": n / dt}


def new_version(state: dict[str, torch.Tensor], changed: float,
                seed: int) -> dict[str, torch.Tensor]:
    """``state`` with a ``changed`` share of each tensor's elements moved by ~1 bf16 ulp."""
    g = torch.Generator().manual_seed(seed)
    new = {}
    for k, v in state.items():
        mask = torch.rand(v.shape, generator=g) < changed
        step = torch.randn(v.shape, generator=g) * 2**-7
        new[k] = torch.where(mask, (v.float() * (1 + step)).to(v.dtype), v)
    return new


def sync(engine: Any, base: dict[str, torch.Tensor], blob: bytes, version: int
         ) -> dict[str, float]:
    """Apply ``blob`` to a copy of ``base`` and load the result into ``engine``; seconds."""
    from astraflow.weights import apply_delta

    state = {k: v.clone() for k, v in base.items()}
    t0 = time.perf_counter()
    state = apply_delta(state, blob, inplace=True)
    t1 = time.perf_counter()
    engine.load_state_dict(state, version)
    t2 = time.perf_counter()
    return {"apply_s": t1 - t0, "load_s": t2 - t1, "total_s": t2 - t0}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="DIR", help="local HF model directory")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--n", type=int, default=8, help="samples per prompt")
    p.add_argument("--tokens", default="8,64", help="comma-separated max_new_tokens rounds")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="bfloat16", help="both engines' dtype")
    p.add_argument("--cpus", default="all", help="vLLM's cores (VLLMEngineOptions.cpus)")
    p.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--changed", type=float, default=0.05,
                   help="share of elements a new version changes (weight sync)")
    p.add_argument("--engines", default="torch,vllm")
    p.add_argument("--out", type=Path, default=None,
                   help="write the start, rollout and weight-sync figures as JSON here")
    return p.parse_args(argv)


def start_engines(args: argparse.Namespace) -> dict[str, tuple[Any, float]]:
    """name -> (engine, start seconds), vLLM first (it binds the OpenMP threads)."""
    engines: dict[str, tuple[Any, float]] = {}
    names = [e.strip() for e in args.engines.split(",") if e.strip()]
    if "vllm" in names:
        from astraflow.raas.vllm_engine import load_vllm_engine

        t0 = time.perf_counter()
        eng = load_vllm_engine(args.model, "actor", dtype=args.dtype, cpus=args.cpus,
                               enforce_eager=args.enforce_eager,
                               max_model_len=args.max_model_len, seed=args.seed)
        engines["vllm"] = (eng, time.perf_counter() - t0)
    if "torch" in names:
        from astraflow.raas.engine import load_torch_engine

        t0 = time.perf_counter()
        eng = load_torch_engine(args.model, "actor", dtype=args.dtype)
        engines["torch"] = (eng, time.perf_counter() - t0)
    return engines


def table(rows: list[tuple[str, dict[str, Any]]], keys: list[str]) -> str:
    """Rows side by side: one column per engine."""
    names = [n for n, _ in rows]
    lines = [f"{'':<22}" + "".join(f"{n:>14}" for n in names)]
    for k in keys:
        cells = []
        for _, r in rows:
            v = r.get(k)
            cells.append(f"{v:>14.3f}" if isinstance(v, float) else f"{v!s:>14}")
        lines.append(f"{k:<22}" + "".join(cells))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    meta = run_meta("engines", ["python", *sys.argv] if argv is None
                    else ["python", "bench/engines.py", *argv])  # before the run: its commit
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.model, local_files_only=True)
    prompts = addition_prompts(tok, args.prompts, args.seed)
    engines = start_engines(args)
    print(f"model {args.model}, {len(prompts)} prompts x n={args.n}, T={args.temperature}, "
          f"dtype {args.dtype}, torch threads {torch.get_num_threads()}, "
          f"prompt tokens mean {sum(map(len, prompts)) / len(prompts):.0f}")
    print(table([(n, {"start_s": s}) for n, (_, s) in engines.items()], ["start_s"]))
    out: dict[str, Any] = {"meta": meta, "settings": {k: str(v) for k, v in vars(args).items()},
                           "start_s": {n: s for n, (_, s) in engines.items()}, "rollout": []}
    for _, (eng, _) in engines.items():  # warm-up: first-call costs are not throughput
        eng.generate(prompts[:2], SamplingParams(max_new_tokens=4, n=2, seed=args.seed))
    for t in (int(x) for x in args.tokens.split(",")):
        params = SamplingParams(max_new_tokens=t, temperature=args.temperature, n=args.n,
                                seed=args.seed)
        rows = [(n, rollout(eng, prompts, params)) for n, (eng, _) in engines.items()]
        print(f"\nrollout, max_new_tokens={t}")
        print(table(rows, ["tokens", "seconds", "tokens_per_s"]))
        out["rollout"] += [{"engine": n, "max_new_tokens": t, **r} for n, r in rows]
    sync_rows: list[tuple[str, dict[str, Any]]] = []
    print(weight_sync(engines, args, sync_rows))
    out["weight_sync"] = [{"engine": n, **r} for n, r in sync_rows]
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    for eng, _ in engines.values():
        close = getattr(eng, "close", None)
        if callable(close):
            close()
    return 0


def weight_sync(engines: dict[str, tuple[Any, float]], args: argparse.Namespace,
                into: list[tuple[str, dict[str, Any]]] | None = None) -> str:
    """The weight-sync table: encode once (trainer side), then apply + load per engine;
    its rows are added to ``into`` too."""
    from astraflow.weights import encode_delta

    any_engine = next(iter(engines.values()))[0]
    base = _model_state(args.model, args.dtype)
    new = new_version(base, args.changed, args.seed)
    t0 = time.perf_counter()
    blob, _ = encode_delta(base, new)
    encode_s = time.perf_counter() - t0
    full = sum(v.numel() * v.element_size() for v in base.values())
    rows = [(n, sync(eng, base, blob, any_engine.version + 1)) for n, (eng, _) in engines.items()]
    if into is not None:
        into += [(n, {**r, "encode_s": encode_s, "delta_bytes": len(blob)}) for n, r in rows]
    head = (f"\nweight sync: {sum(v.numel() for v in base.values()) / 1e6:.0f}M parameters, "
            f"{args.changed:.0%} changed, delta {len(blob) / 2**20:.1f} MiB "
            f"({len(blob) / full:.1%} of {full / 2**20:.0f} MiB), encode {encode_s:.2f}s")
    return head + "\n" + table(rows, ["apply_s", "load_s", "total_s"])


def _model_state(path: str, dtype: str) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors in ``dtype`` (what a follower holds)."""
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(Path(path).glob("*.safetensors")):
        state.update(load_file(str(f)))
    return {k: v.to(getattr(torch, dtype)).contiguous() for k, v in state.items()}


if __name__ == "__main__":
    sys.exit(main())
