"""The torch engine without a broker: log-probs equal to a teacher-forced forward, versions
stamped across a weight swap, a batch of 8 in one call; the tiny model and tokenizer the RaaS
tests share (the node on a real broker: tests/integration/raas/test_raas.py)."""

from __future__ import annotations

import math
import string

import pytest
import torch

from astraflow.raas.engine import Generation, SamplingParams, TorchEngine

CHARS = string.digits + "+-*/()=.?<> " + string.ascii_lowercase


def tiny_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *CHARS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def tiny_model(seed: int = 0):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen2Config(
        vocab_size=64,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=1,
    )
    return Qwen2ForCausalLM(cfg).eval()


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0, device="cpu")


def nucleus_logprob(logits: list[float], token: int, temperature: float, top_p: float) -> float:
    """By hand: the log-probability of ``token`` under softmax(logits / T) renormalised over
    the smallest set of most likely tokens whose probability reaches ``top_p``."""
    scaled = [x / temperature for x in logits]
    top = max(scaled)
    weights = [math.exp(x - top) for x in scaled]
    total = sum(weights)
    probs = [w / total for w in weights]
    kept, mass = set(), 0.0
    for i in sorted(range(len(probs)), key=lambda i: -probs[i]):
        if mass >= top_p:
            break
        kept.add(i)
        mass += probs[i]
    assert token in kept, "a sampled token is always in the nucleus"
    return math.log(probs[token] / sum(probs[i] for i in kept))


def teacher_forced(model, g: Generation, temperature: float, top_p: float = 1.0) -> list[float]:
    ids = torch.tensor([g.prompt_ids + g.token_ids])
    with torch.no_grad():
        logits = model(ids).logits[0].double()
    p = len(g.prompt_ids)
    return [nucleus_logprob(logits[p - 1 + i].tolist(), t, temperature, top_p)
            for i, t in enumerate(g.token_ids)]


# --- engine ------------------------------------------------------------------------------
def test_engine_logprobs_equal_teacher_forced_forward(engine):
    prompts = [engine.encode("1+1="), engine.encode("what is 12*7?"), engine.encode("9")]
    params = SamplingParams(max_new_tokens=24, temperature=0.7, top_p=0.9, n=3, seed=3)
    out = engine.generate(prompts, params)
    assert [len(o) for o in out] == [3, 3, 3]
    for prompt, samples in zip(prompts, out):
        for g in samples:
            assert g.prompt_ids == prompt
            assert len(g.token_ids) == len(g.logprobs) == len(g.versions) >= 1
            assert g.finish_reason in ("stop", "length")
            if g.finish_reason == "length":
                assert len(g.token_ids) == 24
            # the distribution sampled from: tempered, renormalised over the top-0.9 nucleus
            ref = teacher_forced(engine.model, g, 0.7, top_p=0.9)
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < 1e-4
            untruncated = teacher_forced(engine.model, g, 0.7)
            assert min(a - b for a, b in zip(g.logprobs, untruncated)) > 1e-3
    # the same seed gives the same samples
    again = engine.generate(prompts, params)
    assert [[g.token_ids for g in o] for o in again] == [[g.token_ids for g in o] for o in out]


def test_engine_stamps_versions_across_weight_swap(engine):
    prompt = [engine.encode("2*3=")]
    params = SamplingParams(max_new_tokens=8, temperature=1.0, n=2, seed=0)
    first = engine.generate(prompt, params)[0]
    assert all(v == 0 for g in first for v in g.versions)
    old = {k: v.clone() for k, v in engine.model.state_dict().items()}
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in old.items()}
    try:
        engine.load_state_dict(new, version=5)
        assert engine.version == 5
        second = engine.generate(prompt, params)[0]
        assert all(v == 5 for g in second for v in g.versions)
        for g in second:  # behaviour log-probs come from the new weights
            ref = teacher_forced(engine.model, g, 1.0)
            assert max(abs(a - b) for a, b in zip(ref, g.logprobs)) < 1e-4
        with pytest.raises(ValueError, match="does not fit"):
            engine.load_state_dict({"nope": torch.zeros(1)}, version=6)
        assert engine.version == 5
    finally:
        engine.load_state_dict(old, version=0)


def test_engine_samples_a_batch_of_8_in_one_call_to_the_token_limit(engine):
    """Eight independent samples of one prompt, each running to ``max_new_tokens`` (no stop
    token asked for). Tokens per second is a bench: ``bench/engines.py``."""
    prompt = engine.encode("what is 12*7?")
    params = SamplingParams(max_new_tokens=64, temperature=1.0, n=8, seed=1)
    out = engine.generate([prompt], params)
    assert len(out) == 1 and len(out[0]) == 8
    for g in out[0]:
        assert g.prompt_ids == prompt and g.finish_reason == "length"
        assert len(g.token_ids) == len(g.logprobs) == len(g.versions) == 64
        assert all(lp <= 0.0 for lp in g.logprobs) and set(g.versions) == {0}
    # independent draws, not one sample copied eight times
    assert len({tuple(g.token_ids) for g in out[0]}) == 8

