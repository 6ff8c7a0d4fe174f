"""The engine's prefix cache: prompts that continue an earlier call's rows reuse their keys
and values, and generate exactly what a fresh prefill would."""

from __future__ import annotations

import pytest
import torch

from astraflow.raas.engine import SamplingParams, TorchEngine
from astraflow.raas.prefix_cache import PrefixCache
from tests.unit.raas.test_engine import teacher_forced, tiny_model, tiny_tokenizer


def engine(prefix_cache_bytes: int) -> TorchEngine:
    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor",
                       prefix_cache_bytes=prefix_cache_bytes)


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


def second_turn(eng: TorchEngine, firsts, extra: str) -> list[list[int]]:
    """Each first-turn row (prompt and completion) with ``extra`` appended."""
    return [g.prompt_ids + g.token_ids + eng.encode(extra) for gs in firsts for g in gs]


def test_second_turn_reuses_first_turn_and_matches_a_fresh_prefill():
    cached, fresh = engine(2**26), engine(0)
    assert fresh.prefix_cache is None
    prompts = [cached.encode(p) for p in ("1+1=", "what is 12*7?", "9")]
    first = SamplingParams(max_new_tokens=6, temperature=1.0, n=3, seed=5)
    firsts = cached.generate(prompts, first)
    assert len(cached.prefix_cache) == 1 and cached.prefix_cache.hits == 0

    greedy = SamplingParams(max_new_tokens=8, temperature=0.0)
    turn2 = second_turn(cached, firsts, "?") + [cached.encode("2*(3+4)=")]  # the last: a miss
    a, b = cached.generate(turn2, greedy), fresh.generate(turn2, greedy)
    pc = cached.prefix_cache
    # every continued row found its first turn: all but the last generated token (never fed)
    assert pc.hits == 9
    assert pc.tokens_reused == sum(len(g.prompt_ids) + len(g.token_ids) - 1
                                   for gs in firsts for g in gs)
    for (ga,), (gb,) in zip(a, b):
        assert ga.token_ids == gb.token_ids
        assert max_diff(ga.logprobs, gb.logprobs) < 1e-5
        assert max_diff(ga.logprobs, teacher_forced(cached.model, ga, 1.0)) < 1e-4


def test_partial_prefixes_and_sampled_rows_keep_exact_logprobs():
    eng = engine(2**26)
    firsts = eng.generate([eng.encode("12+34=")], SamplingParams(max_new_tokens=4, n=2, seed=1))
    row = firsts[0][0].prompt_ids + firsts[0][0].token_ids
    prompts = [
        row[:3] + eng.encode("9*9="),          # shares only "12+"
        row + eng.encode("?n 12+34="),         # a retry after a rejection
        eng.encode("12+34="),                  # the first prompt again (prefix of a row)
        eng.encode("7-2="),                    # nothing in common
    ]
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.95, n=3, seed=2)
    out = eng.generate(prompts, params)
    pc = eng.prefix_cache
    assert pc.hits == 3
    for prompt, samples in zip(prompts, out):
        for g in samples:
            assert g.prompt_ids == prompt
            assert max_diff(g.logprobs, teacher_forced(eng.model, g, 0.8, 0.95)) < 1e-4


def test_new_weights_clear_the_cache():
    eng = engine(2**26)
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=0)
    (g,), = eng.generate([eng.encode("5+5=")], params)
    new = {k: v + 0.05 * torch.randn_like(v) for k, v in eng.model.state_dict().items()}
    eng.load_state_dict(new, version=3)
    assert len(eng.prefix_cache) == 0 and eng.prefix_cache.version == 3
    (h,), = eng.generate([g.prompt_ids + g.token_ids + eng.encode("?")], params)
    assert eng.prefix_cache.hits == 0  # keys of version 0 are not keys of version 3
    assert h.versions == [3] * len(h.token_ids)
    assert max_diff(h.logprobs, teacher_forced(eng.model, h, 1.0)) < 1e-4


def kv(rows: int, tokens: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(rows, 2, tokens, 4), torch.randn(rows, 2, tokens, 4))]


def test_lookup_finds_the_longest_prefix_but_never_the_whole_prompt():
    pc = PrefixCache(2**20)
    pc.add(kv(2, 5), [[1, 2, 3, 4, 5], [1, 2, 9]])
    assert pc.lookup([7, 1, 2]) is None
    hit = pc.lookup([1, 2, 3, 4, 5, 6])
    assert (hit.length, hit.row) == (5, 0)
    assert pc.lookup([1, 2, 9, 9]).length == 3
    assert pc.lookup([1, 2, 3]).length == 2  # the last prompt token is always fed
    assert pc.lookup([1]) is None


def test_gather_right_aligns_each_rows_prefix():
    pc = PrefixCache(2**20)
    layers = kv(2, 4)
    pc.add(layers, [[1, 2, 3, 4], [5, 6, 7]])
    hits = [pc.lookup([5, 6, 7, 8]), None, pc.lookup([1, 2, 0])]
    ((k, v),) = pc.gather(hits, width=3)
    assert k.shape == (3, 2, 3, 4)
    assert torch.equal(k[0], layers[0][0][1, :, :3]) and torch.equal(v[0], layers[0][1][1, :, :3])
    assert torch.equal(k[2, :, 1:], layers[0][0][0, :, :2])  # 2 tokens in the last 2 columns


def test_oldest_blocks_go_first_past_the_byte_budget():
    block_bytes = 2 * 2 * 2 * 5 * 4 * 4
    pc = PrefixCache(2 * block_bytes)
    pc.add(kv(2, 5), [[1, 1], [1, 2]])
    pc.add(kv(2, 5), [[2, 1], [2, 2]])
    pc.add(kv(2, 5), [[3, 1], [3, 2]])
    assert len(pc) == 2 and pc.bytes == 2 * block_bytes
    assert pc.lookup([1, 1, 0]) is None and pc.lookup([3, 1, 0]) is not None
    pc.add(kv(5, 5), [[4]] * 5)  # larger than the whole budget: not kept
    assert len(pc) == 2 and pc.lookup([4, 0]) is None
    with pytest.raises(ValueError):
        PrefixCache(-1)
