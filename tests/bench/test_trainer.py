"""bench/trainer.py on a tiny model: every phase is timed and every version measured."""

from __future__ import annotations

import argparse
import math
import random

import pytest
import torch

from tests.conftest import load_bench

VOCAB = 64


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    # a Llama: the megatron backend maps it too
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=128)
    path = tmp_path_factory.mktemp("tiny-llama-bench")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def megatron_usable() -> bool:
    """Whether the megatron trainer backend runs here (megatron-core, pinned release)."""
    from astraflow.trainer.megatron_shims import MegatronUnavailable, check_megatron

    try:
        check_megatron(cpu=True)
    except MegatronUnavailable:
        return False
    return True


def _pool(prompts: int, samples: int):
    from astraflow.raas.engine import Generation

    rng = random.Random(0)
    out = []
    for _ in range(prompts):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(8, 12))]
        gens = []
        for _ in range(samples):
            toks = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 6))]
            gens.append(Generation(prompt_ids=prompt, token_ids=toks,
                                   logprobs=[-math.log(VOCAB)] * len(toks),
                                   finish_reason="stop", versions=[0] * len(toks)))
        out.append((prompt, gens))
    return out


def test_bench_trainer_times_every_phase(tiny_model, tmp_path, capsys):
    bench = load_bench("trainer")
    torch.set_num_threads(1)
    pool = _pool(4, 4)
    batches = [bench.make_batch(pool, v, groups=2) for v in range(3)]
    assert [len(b.groups) for b in batches] == [2, 2, 2]
    assert batches[0].groups[0].prompt_id != batches[1].groups[0].prompt_id  # rotating
    args = argparse.Namespace(lr=1e-4, threads=1, state_interval=2, device="cpu")
    runs = [("fp32", "torch"), ("bf16-tokens", "torch")]
    if megatron_usable():  # else tests/test_megatron skips
        runs.append(("fp32", "megatron"))
    settings = [bench.open_setting(tiny_model, name, backend, args, str(tmp_path))
                for name, backend in runs]
    for v, batch in enumerate(batches, start=1):
        for st in settings:
            bench.step(st, v, batch, args)
    for st in settings:
        assert st.row.mean("saved_mb") > 0
    for st in settings:
        bench.finish(st, 3)
    for st in settings:
        r = st.row
        assert len(r.deltas) == 3 and all(0.0 <= s <= 1.0 for _, s in r.deltas)
        for key in ("fwd_bwd", "optim", "cast", "encode", "put", "state_main", "wall"):
            assert len(r.steps[key]) == 3, key
        assert len(r.writes) == 1  # version 2's, in the background
        assert r.sync_write > 0 and r.state_bytes > 0
        # every measured blob was deleted again
        folder = tmp_path / f"{r.name}-{r.backend}"
        assert not [p for p in folder.iterdir() if not p.name.startswith(".")]
    bench.report([st.row for st in settings], 2)
    out = capsys.readouterr().out
    assert "| fp32 | torch |" in out and "| bf16-tokens | torch |" in out and "v3:" in out
    assert len(runs) == 2 or "| fp32 | megatron |" in out
