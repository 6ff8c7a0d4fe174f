"""vLLM applying LoRA versions: its own LoRA (a ``LoRARequest`` per version) against the
adapter merged into the base weights and reloaded, on the same model, in one run.

For each ``lora_mode`` a vLLM engine of the model (default SmolLM2-135M-Instruct, as
``astraflow model import smollm2`` writes it) takes ``--versions`` adapters of rank
``--rank`` on every attention and MLP projection, each followed by one greedy generation
of ``--prompts`` prompts x ``--tokens`` tokens. Reported per mode: the seconds to apply a
version (``load_state_dict``: for native, writing the peft directory and vLLM loading it;
for merge, computing ``W + alpha/rank * B @ A`` and reloading the weights), the seconds of
the generation after it, and their sum per version; the mean over the versions after the
first (the first includes one-off allocations), and whether the two modes generated the
same greedy tokens (merging rounds ``W + delta`` to the model's dtype; native LoRA adds
the adapter's product to the activations: equal up to that rounding).

    .venv-vllm/bin/python bench/vllm_lora.py [--model runs/smollm2/model] [--rank 16]
        [--versions 6] [--prompts 8] [--tokens 16] [--out FILE.json]

Needs vLLM (``bash scripts/vllm-env``). The JSON goes to ``bench/results/vllm_lora.json``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from report import run_meta, table  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def adapters(model_dir: Path, settings: dict[str, Any], n: int) -> list[dict]:
    """``n`` adapter versions as a LoRA trainer publishes them (bf16, peft's names), B
    drawn small so that each changes the greedy tokens a little."""
    import torch
    from transformers import AutoModelForCausalLM

    from astraflow.config.lora import LoraSpec
    from astraflow.models.lora import adapter_state, wrap

    model = wrap(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(),
                 LoraSpec.model_validate(settings))
    out = []
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=g) * 2e-3)
        out.append({k: v.to(torch.bfloat16).clone() for k, v in adapter_state(model).items()})
    return out


def run_mode(mode: str, model_dir: Path, settings: dict[str, Any], versions: list[dict],
             prompts: list[list[int]], tokens: int) -> dict[str, Any]:
    from astraflow.raas.engine import SamplingParams
    from astraflow.raas.vllm_engine import load_vllm_engine

    eng = load_vllm_engine(model_dir, "actor", lora=settings, lora_mode=mode, dtype="best",
                           max_model_len=512, kv_cache_gib=1)
    greedy = SamplingParams(max_new_tokens=tokens, temperature=0.0)
    apply_s, gen_s, outputs = [], [], []
    try:
        for v, state in enumerate(versions, start=1):
            t0 = time.perf_counter()
            eng.load_state_dict(state, v)
            t1 = time.perf_counter()
            out = eng.generate(prompts, greedy)
            t2 = time.perf_counter()
            apply_s.append(t1 - t0)
            gen_s.append(t2 - t1)
            outputs.append([o[0].token_ids for o in out])
    finally:
        eng.close()
    later = slice(1, None) if len(versions) > 1 else slice(None)
    return {"mode": mode, "start_s": eng.start_seconds,
            "apply_s": statistics.fmean(apply_s[later]),
            "generate_s": statistics.fmean(gen_s[later]),
            "per_version_s": statistics.fmean(a + g for a, g in zip(apply_s[later], gen_s[later])),
            "first_apply_s": apply_s[0], "tokens": outputs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, default=REPO / "runs" / "smollm2" / "model")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--versions", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "vllm_lora.json")
    args = ap.parse_args(argv)
    if not (args.model / "config.json").exists():
        ap.error(f"--model {args.model}: no model there (astraflow model import smollm2 DIR)")
    meta = run_meta("vllm_lora", ["python", *sys.argv] if argv is None
                    else ["python", "bench/vllm_lora.py", *argv])
    settings = {"rank": args.rank, "alpha": 2.0 * args.rank, "target_modules": TARGETS}
    versions = adapters(args.model, settings, args.versions)
    prompts = [[1, 330, 2000 + 37 * i, 28, 1017 + i, 30] for i in range(args.prompts)]
    rows = [run_mode(m, args.model, settings, versions, prompts, args.tokens)
            for m in ("native", "merge")]
    same = rows[0]["tokens"] == rows[1]["tokens"]
    text = table(["lora_mode", "engine start s", "apply s/version", "generate s/version",
                  "apply + generate s/version", "first apply s"],
                 [[r["mode"], r["start_s"], r["apply_s"], r["generate_s"], r["per_version_s"],
                   r["first_apply_s"]] for r in rows])
    print(text)
    print(f"the same greedy tokens in both modes: {same}")
    for r in rows:
        r.pop("tokens")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "bench": "vllm_lora", "rank": args.rank,
                                    "versions": args.versions, "prompts": args.prompts,
                                    "tokens": args.tokens, "same_tokens": same, "rows": rows,
                                    "table": text}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
