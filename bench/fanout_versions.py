"""Successive SmolLM2 versions from real AdamW steps, for ``bench/fanout.py``.

Loads SmolLM2-135M-Instruct (``astraflow model import smollm2 DIR``) in fp32 (the
trainer's master weights), takes one AdamW step per version on batches of next-token
prediction over the project's own docs, and keeps each version as the bf16 cast the
trainer would publish. Versions are stored once, under ``runs/fanout/``, as the base bf16
state (safetensors) and one delta blob a version, encoded with the project's codec
(``astraflow.weights.encode``): later runs only read them.

The learning rate decides the sparsity: an fp32 step of about ``lr`` per element moves a
bf16 value only when it crosses a rounding boundary; ``lr`` 1e-6 to 3e-6 gives the
0.989-0.996 the reference reports. The measured sparsity is written next to each blob.
"""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]


def cache_dir(root: Path, model_dir: Path, lr: float, seed: int) -> Path:
    """Where the versions made with these settings live (one folder per setting)."""
    key = json.dumps([str(model_dir.resolve()), lr, seed]).encode()
    return root / f"versions-{hashlib.sha256(key).hexdigest()[:12]}"


def _batches(tokenizer, batch: int, seq: int, seed: int):
    """Endless batches of ``batch`` x ``seq`` tokens of the docs, shuffled by ``seed``."""
    text = "\n\n".join(p.read_text() for p in sorted((REPO / "docs").glob("*.md")))
    ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    n = ids.numel() // seq
    windows = ids[: n * seq].view(n, seq)
    gen = torch.Generator().manual_seed(seed)
    while True:
        for idx in torch.randperm(n, generator=gen).split(batch):
            if idx.numel() == batch:
                yield windows[idx]


def _bf16_state(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().to(torch.bfloat16).contiguous().clone()
            for k, v in model.state_dict().items()}


def make_versions(model_dir: Path, out: Path, versions: int, lr: float, seed: int,
                  log=print) -> dict:
    """Write ``base.safetensors`` and ``delta-v<k>.afwb`` (k = 1..versions) into ``out``
    unless they are there; returns the run record (``versions.json``)."""
    record_path = out / "versions.json"
    if record_path.exists():
        record = json.loads(record_path.read_text())
        if len(record["versions"]) >= versions:
            return record
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from astraflow.weights.encode import encode_delta

    torch.manual_seed(seed)
    out.mkdir(parents=True, exist_ok=True)
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    model.train()
    tok = AutoTokenizer.from_pretrained(model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    prev = _bf16_state(model)
    save_file(prev, str(out / "base.safetensors"))
    batches = _batches(tok, batch=2, seq=128, seed=seed)
    rows = []
    for v in range(1, versions + 1):
        t0 = time.perf_counter()
        x = next(batches)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        loss = loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        new = _bf16_state(model)
        blob, stats = encode_delta(prev, new)
        (out / f"delta-v{v}.afwb").write_bytes(blob)
        rows.append({"version": v, "loss": float(loss), "bytes": len(blob),
                     "sparsity": stats.sparsity, "changed": stats.num_changed})
        log(f"version {v}: loss {float(loss):.3f}, sparsity {stats.sparsity:.4f}, "
            f"delta {len(blob) / 1e6:.2f} MB ({time.perf_counter() - t0:.1f}s)")
        prev = new
    record = {"model": str(model_dir), "lr": lr, "seed": seed, "optimizer": "AdamW",
              "batch": "2 x 128 tokens of docs/*.md", "params": stats.num_params,
              "versions": rows}
    record_path.write_text(json.dumps(record, indent=1))
    return record
