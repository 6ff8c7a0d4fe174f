"""The trainer on sequences whose tokens span several weight versions (a generation the
engine updated twice, ``TorchEngine.follow_inflight``): each token's behaviour log-prob is
the one its own version sampled with, staleness is counted per token, and the guard judges
the oldest token."""

from __future__ import annotations

import pytest
import torch

from astraflow.config.sections import TrainerSpec
from astraflow.raas.engine import SamplingParams, TorchEngine
from astraflow.trainer.trainer import Trainer, _Row
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
from tests.unit.raas.test_inflight import Offers, perturbed

EXPECTED = [0] * 4 + [1] * 8 + [2] * 4  # versions of a 16-token generation, chunks of 4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny-inflight")
    tiny_model().save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def spanning(model_dir) -> TrajectoryGroup:
    """A group of 4 samples generated while versions 1 and 2 arrived (chunks of 4)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, local_files_only=True)
    engine = TorchEngine(model, tiny_tokenizer(), prefix_cache_bytes=0)
    v0 = {k: v.clone() for k, v in model.state_dict().items()}
    engine.follow_inflight(Offers({1: perturbed(v0, 1), 2: perturbed(v0, 2)}, at=(1, 3)), 4)
    (gens,) = engine.generate([engine.encode("7*8=")],
                              SamplingParams(max_new_tokens=16, temperature=1.0, n=4, seed=3))
    seqs = [Sequence(policy="actor", token_ids=g.prompt_ids + g.token_ids,
                     loss_mask=[0] * len(g.prompt_ids) + [1] * len(g.token_ids),
                     logprobs=[0.0] * len(g.prompt_ids) + g.logprobs,
                     versions=[-1] * len(g.prompt_ids) + g.versions, reward=float(i % 2),
                     sample_index=i, finish_reason=g.finish_reason)
            for i, g in enumerate(gens)]
    assert all(s.versions[-16:] == EXPECTED for s in seqs)
    return TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="single_turn",
                           source="test", raas_id="r", pool="p", sequences=seqs,
                           rewards=[s.reward for s in seqs])


def test_each_tokens_behaviour_logprob_is_its_own_versions(model_dir, spanning):
    """The trainer on version 0's weights recomputes the first chunk's log-probs exactly
    and not the later chunks': the ratio of each token is taken to the version that
    sampled it, not to one version for the sequence."""
    tr = Trainer(model_dir, TrainerSpec(publish_dtype="same"), policy="actor")
    rows = [_Row(s, 1.0) for s in spanning.sequences]
    ids, attn, behaviour, mask, _ = tr._tensors(rows)
    with torch.no_grad():
        start = int(mask.any(0).nonzero()[0]) - 1
        new = tr.token_logprobs(ids, attn, start=start)
    diff = ((new - behaviour).abs() * mask)[:, -16:]
    assert float(diff[:, :4].max()) < 1e-4  # version 0's tokens
    assert float(diff[:, 4:].max(dim=1).values.min()) > 1e-2  # versions 1 and 2's


def test_staleness_is_counted_per_token_and_the_guard_judges_the_oldest(model_dir, spanning):
    batch = Batch(policy="actor", batch_id="b", groups=[spanning])
    tr = Trainer(model_dir, TrainerSpec(lr=1e-4), policy="actor")
    m = tr.train_step(batch, current_version=3)
    # per token: 4 tokens 3 behind, 8 tokens 2 behind, 4 tokens 1 behind (a per-sequence
    # version would say 3, the oldest, or 1, the newest)
    assert m["trainer/staleness_mean"] == pytest.approx((4 * 3 + 8 * 2 + 4 * 1) / 16)
    assert m["trainer/staleness_max"] == 3.0
    assert m["trainer/loss_tokens"] == 4 * 16 and m["trainer/stale_dropped_groups"] == 0
    # the bound holds for every token: a group whose oldest token is past it is dropped
    strict = Trainer(model_dir, TrainerSpec(lr=1e-4), policy="actor", max_staleness=2)
    m = strict.train_step(batch, current_version=3)
    assert m["trainer/stale_dropped_groups"] == 1 and m["trainer/sequences"] == 0
