"""Keyed sampling seeds: each sample drawn from its own stream of (seed, task key, sample
index, weight version), so a task's samples do not depend on the batch it shares, and the
inverse-CDF draw behind it samples the engine's distribution."""

from __future__ import annotations

import pytest
import torch

from astraflow.models.sampling import sampling_logprobs
from astraflow.raas.engine import SamplingParams, TorchEngine, _pick, sample_seed
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer

PARAMS = {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7}


@pytest.fixture(scope="module")
def engine() -> TorchEngine:
    return TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", prefix_cache_bytes=0)


def tokens(gens) -> list[list[list[int]]]:
    return [[g.token_ids for g in gs] for gs in gens]


def test_a_sample_seed_is_a_stable_hash_of_its_four_parts():
    base = sample_seed(7, "task-1", 0, 3)
    assert base == sample_seed(7, "task-1", 0, 3)
    assert 0 <= base < 2**63
    others = {sample_seed(8, "task-1", 0, 3), sample_seed(7, "task-2", 0, 3),
              sample_seed(7, "task-1", 1, 3), sample_seed(7, "task-1", 0, 4)}
    assert base not in others and len(others) == 4
    # fixed across processes and machines (not Python's salted hash)
    assert sample_seed(0, "a", 0, 0) == 0x630DC732B5EA758


def test_a_keyed_task_samples_the_same_alone_or_beside_others(engine):
    a, b = engine.encode("12+34="), engine.encode("56+78=")  # same length: no padding
    alone = engine.generate([a], SamplingParams(**PARAMS, keys=("task-a",)))
    batched = engine.generate([b, a], SamplingParams(**PARAMS, keys=("task-b", "task-a")))
    assert tokens(alone)[0] == tokens(batched)[1]
    # the three samples of one task differ from each other (each has its own stream)
    assert len({tuple(t) for t in tokens(alone)[0]}) == 3


def test_keyed_samples_change_with_the_weight_version_and_the_seed(engine):
    a = engine.encode("12+34=")
    first = tokens(engine.generate([a], SamplingParams(**PARAMS, keys=("task-a",))))
    assert first == tokens(engine.generate([a], SamplingParams(**PARAMS, keys=("task-a",))))
    reseeded = tokens(engine.generate([a], SamplingParams(**{**PARAMS, "seed": 8},
                                                          keys=("task-a",))))
    version = engine.version
    try:
        engine.version = version + 1
        later = tokens(engine.generate([a], SamplingParams(**PARAMS, keys=("task-a",))))
    finally:
        engine.version = version
    assert first != reseeded and first != later


def test_keys_must_name_every_prompt(engine):
    with pytest.raises(ValueError, match="1 sampling keys for 2 prompts"):
        engine.generate([engine.encode("1"), engine.encode("2")],
                        SamplingParams(**PARAMS, keys=("only-one",)))


def test_inverse_cdf_draws_follow_the_nucleus_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0, -3.0]])
    top_p = 0.9
    want = sampling_logprobs(logits, 1.0, top_p).exp()[0]
    n = 20000
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    tok, lp = _pick(logits.expand(n, -1), 1.0, top_p, u)
    freq = torch.bincount(tok, minlength=5).double() / n
    assert freq.sub(want.double()).abs().max() < 0.015, (freq, want)
    assert (freq[want == 0] == 0).all()  # cut by top-p: never drawn
    assert torch.equal(lp, sampling_logprobs(logits, 1.0, top_p)[0][tok])
