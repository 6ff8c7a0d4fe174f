"""The trainer: loss maths, a step on a tiny model, and exact resume after SIGKILL on Kafka."""

from __future__ import annotations

import dataclasses
import math
import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.trainer.loss import group_advantages, policy_loss
from astraflow.trainer.trainer import _Row
from astraflow.wire.records import Batch, ComponentStatus, Sequence, TrajectoryGroup
from tests.conftest import REPO, wait_for

VOCAB = 64


# --------------------------------------------------------------------------- maths
def test_group_advantages():
    a, b, c = group_advantages([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0], [5.0]])
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)  # std 0.5
    assert torch.equal(b, torch.zeros(2)) and torch.equal(c, torch.zeros(1))
    (d,) = group_advantages([[3.0, 1.0]], normalize_std=False)
    assert torch.allclose(d, torch.tensor([1.0, -1.0]))
    (e,) = group_advantages([[0.0, 1.0, 2.0]], eps=0.0)
    assert torch.allclose(e, torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2 / 3))


def test_policy_loss_hand_computed():
    # ratios r = exp(new - behaviour); clip [0.8, 1.28]; tis cap 2.0
    r = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 3.0, 1.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0])
    behaviour = torch.full((7,), -1.0)
    new = (behaviour + torch.log(r)).requires_grad_(True)
    out = policy_loss(new, behaviour, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # per token objective:
    #  1.1*1 (inside) | 1.28*1 (high clip) | 0.5*1 (unclipped, below) | 0.8*-1 (low clip)
    #  1.5*-1 (open side, below cap) | 2.0*-2 (open side, truncated at the cap)
    expected = [1.1, 1.28, 0.5, -0.8, -1.5, -4.0]
    assert out.loss.item() == pytest.approx(-sum(expected) / 6, rel=1e-5)
    out.loss.backward()
    # d loss / d new_t = -(weight * A_t)/N with weight r (inside or unclipped), 0 (clipped),
    # min(r, cap) (truncated)
    grad = [-1.1 * 1, 0.0, -0.5 * 1, 0.0, -1.5 * -1, -2.0 * -2, 0.0]
    assert torch.allclose(new.grad, torch.tensor(grad) / 6, atol=1e-6)
    m = out.metrics
    assert m["clip_frac_high"] == pytest.approx(1 / 6)
    assert m["clip_frac_low"] == pytest.approx(1 / 6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["truncated_frac"] == pytest.approx(1 / 6)
    assert m["ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx(sum(r[:6].tolist()) / 6, rel=1e-5)
    kl = sum(x - 1 - math.log(x) for x in r[:6].tolist()) / 6
    assert m["approx_kl"] == pytest.approx(kl, rel=1e-5)
    # a global token count (micro-batching) only rescales
    out2 = policy_loss(new, behaviour, adv, mask, num_tokens=12)
    assert out2.loss.item() == pytest.approx(out.loss.item() / 2, rel=1e-5)
    with pytest.raises(ValueError):
        policy_loss(new, behaviour, adv, mask, clip_high=0.28, tis_cap=1.2)


# --------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


# no staleness bound in practice: the trainer tests' batches are all of version 0
NO_STALENESS_BOUND = 10**9


def service_options(model: str, state_dir: Path | str, *, max_staleness: int =
                    NO_STALENESS_BOUND, temperature: float = 1.0, **trainer):
    """The ``ServiceOptions`` of a test's trainer of policy ``actor``: its typed section
    (``trainer``: its ``trainer:`` keys over lr 1e-4 and 3 sequences per micro-batch) and
    a short poll."""
    from astraflow.config.sections import PolicySpec
    from astraflow.trainer.service import ServiceOptions

    section = {"lr": 1e-4, "micro_batch_size": 3, "state_dir": str(state_dir), **trainer}
    return ServiceOptions("actor", PolicySpec(
        model=model, trainer=section, max_staleness=max_staleness, temperature=temperature),
        poll_timeout_s=0.2)


def make_batch(i: int, groups: int = 2, samples: int = 4, seed: int = 0) -> Batch:
    rng = random.Random(seed * 1000 + i)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 6))]
        seqs = []
        for s in range(samples):
            gen = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))]
            n = len(prompt) + len(gen)
            seqs.append(
                Sequence(
                    policy="actor",
                    token_ids=prompt + gen,
                    loss_mask=[0] * len(prompt) + [1] * len(gen),
                    logprobs=[0.0] * len(prompt)
                    + [-math.log(VOCAB) + rng.uniform(-0.3, 0.3) for _ in gen],
                    versions=[-1] * len(prompt) + [max(0, i - 1)] * len(gen),
                    reward=float(rng.random() < 0.5) + 0.1 * s,
                    sample_index=s,
                    finish_reason="stop",
                )
            )
            assert len(seqs[-1].token_ids) == n
        out.append(
            TrajectoryGroup(
                group_id=f"b{i}g{g}",
                prompt_id=f"p{g}",
                task_id=f"t{g}",
                workflow="single_turn",
                source="test",
                raas_id="r",
                pool="p",
                sequences=seqs,
                rewards=[x.reward for x in seqs],
            )
        )
    return Batch(policy="actor", batch_id=f"batch-{i}", groups=out)


def test_train_step_raises_logprob_of_positive_advantage_tokens(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerSpec(lr=3e-3, micro_batch_size=3), policy="actor")
    batch = make_batch(0)
    rows = tr._rows(batch)

    def seq_logprob() -> list[float]:
        with torch.no_grad():
            ids, attn, _, mask, _ = tr._tensors(rows)
            return (tr.token_logprobs(ids, attn) * mask).sum(1).tolist()

    before = seq_logprob()
    m = tr.train_step(batch, current_version=3)
    after = seq_logprob()
    for key in (
        "trainer/loss",
        "trainer/reward_mean",
        "trainer/clip_frac",
        "trainer/grad_norm",
        "trainer/step_seconds",
        "trainer/approx_kl",
        "trainer/staleness_mean",
    ):
        assert key in m and math.isfinite(m[key]), key
    assert m["trainer/staleness_mean"] == 3.0
    pos = [a - b for r, a, b in zip(rows, after, before) if r.advantage > 0]
    neg = [a - b for r, a, b in zip(rows, after, before) if r.advantage < 0]
    assert pos and neg
    assert sum(pos) / len(pos) > 0 > sum(neg) / len(neg)
    # micro-batching gives the same step as one full pass
    t1 = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=1), policy="actor")
    t8 = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=8), policy="actor")
    t1.train_step(batch)
    t8.train_step(batch)
    # Adam divides by |gradient|: where it is ~0 (the key biases) summation-order noise
    # shows as ~1e-6 of the lr-1e-3 update
    for (k, a), b in zip(t1.state_dict().items(), t8.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k


def test_adamw_runs_fused_where_torch_has_it_and_steps_as_foreach_does(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer, adam_kwargs

    assert adam_kwargs("auto", [torch.zeros(2)]) == {"fused": True}  # CPU has the kernel
    assert adam_kwargs("auto", [torch.zeros(2, dtype=torch.int64)]) == {}  # torch's default
    assert adam_kwargs("for-loop", [torch.zeros(2)]) == {"foreach": False}
    batch = make_batch(0)
    stepped = {}
    for impl in ("auto", "for-loop"):
        tr = Trainer(tiny_model, TrainerSpec(lr=1e-3, adam_impl=impl), policy="actor")
        assert tr.optimizer.defaults["fused"] is (True if impl == "auto" else None)
        tr.train_step(batch)
        stepped[impl] = tr.state_dict()
    for k, a in stepped["auto"].items():  # one algorithm: only the rounding differs
        assert torch.allclose(a, stepped["for-loop"][k], atol=1e-6), k


def test_each_step_trains_at_its_scheduled_rate(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainerSpec(lr=1e-3, lr_warmup_steps=2, lr_decay="linear", lr_final=0.0,
                        lr_decay_steps=2)
    tr = Trainer(tiny_model, cfg, policy="actor")
    seen = []
    for _ in range(5):
        before = {k: v.clone() for k, v in tr.state_dict().items()}
        seen.append(tr.train_step(make_batch(0))["trainer/lr"])
        assert tr.optimizer.param_groups[0]["lr"] == seen[-1]
        moved = any(not torch.equal(before[k], v) for k, v in tr.state_dict().items())
        assert moved is (seen[-1] > 0)
    assert seen == pytest.approx([5e-4, 1e-3, 1e-3, 5e-4, 0.0])


def test_zero_advantage_sequences_are_skipped_without_changing_the_update(tiny_model):

    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.loss import policy_loss
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(5, groups=3)
    # group 0 all right: no signal, so the trainer must not run it
    flat = dataclasses.replace(batch.groups[0], sequences=[
        dataclasses.replace(s, reward=1.0) for s in batch.groups[0].sequences])
    batch = dataclasses.replace(batch, groups=[flat, *batch.groups[1:]])
    # the reference steps the model's own parameters: no separate master copy
    cfg = TrainerSpec(lr=1e-3, micro_batch_size=4, share_prompt=False, forward_on="master")
    tr = Trainer(tiny_model, cfg, policy="actor")
    calls: list[int] = []
    real = tr.token_logprobs
    tr.token_logprobs = lambda ids, attn, **kw: calls.append(len(ids)) or real(ids, attn, **kw)
    m = tr.train_step(batch)
    assert sum(calls) == 8  # the 8 sequences of the two groups with signal, not 12
    assert m["trainer/zero_advantage_frac"] == pytest.approx(4 / 12)
    assert m["trainer/sequences"] == 12.0

    # the reference: one pass over every sequence, the loss divided by all their tokens
    ref = Trainer(tiny_model, cfg, policy="actor")
    rows = ref._rows(batch)
    ids, attn, behaviour, mask, adv = ref._tensors(rows)
    out = policy_loss(ref.token_logprobs(ids, attn), behaviour, adv, mask,
                      clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
    ref.optimizer.zero_grad()
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), cfg.max_grad_norm)
    ref.optimizer.step()
    assert m["trainer/loss"] == pytest.approx(out.loss.item(), rel=1e-4, abs=1e-7)
    for (k, a), b in zip(tr.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k

    # a batch without any signal still takes the optimizer step (Adam's momentum moves on)
    still = Trainer(tiny_model, cfg, policy="actor")
    still.train_step(batch)
    before = {k: v.clone() for k, v in still.state_dict().items()}
    calls.clear()
    still.token_logprobs = lambda ids, attn, **kw: calls.append(len(ids)) or real(ids, attn, **kw)
    m = still.train_step(dataclasses.replace(batch, groups=[flat]))
    assert calls == [] and m["trainer/zero_advantage_frac"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in still.state_dict().items())


def test_published_state_rounds_fp32_master_weights(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer
    from astraflow.weights.bits import state_bytes_equal

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerSpec(lr=1e-4, micro_batch_size=3), policy="actor")
    assert tr.spec.publish_dtype == "bf16" and tr.keeps_master  # the default
    tr.train_step(make_batch(0))
    master, published = tr.state_dict(), tr.published_state()
    assert {v.dtype for v in master.values()} == {torch.float32}
    assert {v.dtype for v in published.values()} == {torch.bfloat16}
    for k, v in published.items():
        assert torch.equal(v, master[k].to(torch.bfloat16)), k
    # the master weights round-trip bit for bit; loading them into a bf16 model is refused
    data = tr.master_bytes()
    other = Trainer(tiny_model, TrainerSpec(lr=1e-4, micro_batch_size=3), policy="actor")
    assert not state_bytes_equal(other.state_dict(), master)
    other.load_master_bytes(data)
    assert state_bytes_equal(other.state_dict(), master)
    half = Trainer(tiny_model, TrainerSpec(dtype="bf16"), policy="actor")
    assert not half.keeps_master  # trains in bf16: the published weights are the weights
    with pytest.raises(ValueError, match="--dtype"):
        half.load_master_bytes(data)
    same = Trainer(tiny_model, TrainerSpec(publish_dtype="same"), policy="actor")
    assert not same.keeps_master
    assert {v.dtype for v in same.published_state().values()} == {torch.float32}
    with pytest.raises(ValueError, match="publish_dtype"):
        Trainer(tiny_model, TrainerSpec(publish_dtype="int8"), policy="actor")


def _trainer_and_engine_logprobs(tr, engine, ids, attn) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's token log-probs of ``ids`` and a transformers model's own."""
    with torch.no_grad():
        mine = tr.token_logprobs(ids, attn)[:, 1:]
        ref = torch.log_softmax(engine(input_ids=ids, attention_mask=attn).logits.float(),
                                -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]
    return mine, ref


def test_forward_runs_on_the_published_weights_and_the_master_keeps_small_steps(tiny_model):
    """The trainer's log-probs are the published policy's (what the engines sample), while
    the optimizer's fp32 master keeps the steps the bf16 rounding drops."""
    from transformers import AutoModelForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainerSpec(lr=1e-5, micro_batch_size=4)
    tr = Trainer(tiny_model, cfg, policy="actor")
    master_run = Trainer(tiny_model, cfg.model_copy(update=dict(forward_on="master")),
                         policy="actor")
    engine = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).eval()
    rows = [_Row(s, 1.0) for g in make_batch(9).groups for s in g.sequences]
    ids, attn, *_ = tr._tensors(rows)
    for i in range(3):
        tr.train_step(make_batch(i))
        master_run.train_step(make_batch(i))
        published = tr.published_state()
        params = dict(tr.model.named_parameters())
        for k, v in published.items():  # the parameters hold the published values exactly
            if k in params:
                assert torch.equal(params[k].detach(), v.float()), k
        engine.load_state_dict(published, strict=False)
        assert torch.allclose(*_trainer_and_engine_logprobs(tr, engine, ids, attn),
                              atol=1e-5), i
    # the master keeps what the rounding dropped, and its update goes the way stepping the
    # fp32 weights themselves goes (the gradients differ only by where they were taken)
    ours, theirs = tr.state_dict(), master_run.state_dict()
    assert any(not torch.equal(ours[k], published[k].float()) for k in published)
    start = engine.__class__.from_pretrained(tiny_model, local_files_only=True).state_dict()
    a = torch.cat([(ours[k] - start[k]).flatten() for k in theirs])
    b = torch.cat([(theirs[k] - start[k]).flatten() for k in theirs])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9


def test_bf16_held_weights_compute_as_the_engine_and_step_the_fp32_master(tiny_model):
    """forward_dtype bf16: the parameters are the published bf16 weights themselves, so the
    trainer's log-probs are a bf16 engine's; every micro-batch's gradient is summed into
    the fp32 masters, whose update follows bf16 autocast's, and a resume is exact."""
    from transformers import AutoModelForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer
    from astraflow.weights.bits import state_bytes_equal

    torch.set_num_threads(1)
    cfg = TrainerSpec(lr=1e-4, micro_batch_size=3, forward_dtype="bf16")
    tr = Trainer(tiny_model, cfg, policy="actor")
    autocast = Trainer(tiny_model, cfg.model_copy(update=dict(forward_dtype="fp32",
                                                       autocast="bf16")), policy="actor")
    assert tr.autocast == "none" and tr.keeps_master
    assert {p.dtype for p in tr.model.parameters()} == {torch.bfloat16}
    engine = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True,
                                                  dtype=torch.bfloat16).eval()
    rows = [_Row(s, 1.0) for g in make_batch(9).groups for s in g.sequences]
    ids, attn, *_ = tr._tensors(rows)
    for i in range(3):
        m = tr.train_step(make_batch(i))
        autocast.train_step(make_batch(i))
        assert m["trainer/micro_batches"] > 1  # gradients of several passes summed
        master, published = tr.state_dict(), tr.published_state()
        assert {v.dtype for v in master.values()} == {torch.float32}
        params = dict(tr.model.named_parameters())
        for k, v in published.items():
            assert torch.equal(v, master[k].to(torch.bfloat16)), k
            if k in params:
                assert torch.equal(params[k].detach(), v), k
        assert all(p.grad is None for p in tr.model.parameters())
        engine.load_state_dict(published, strict=False)
        assert torch.allclose(*_trainer_and_engine_logprobs(tr, engine, ids, attn),
                              atol=1e-5), i
    start = AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True).state_dict()
    ours, theirs = tr.state_dict(), autocast.state_dict()
    a = torch.cat([(ours[k] - start[k]).flatten() for k in theirs])
    b = torch.cat([(theirs[k] - start[k]).flatten() for k in theirs])
    assert torch.nn.functional.cosine_similarity(a, b, dim=0) > 0.9
    # the fp32 masters round-trip bit for bit into a trainer holding bf16 weights
    other = Trainer(tiny_model, cfg, policy="actor")
    other.load_master_bytes(tr.master_bytes())
    other.load_optimizer_bytes(tr.optimizer_bytes())
    assert state_bytes_equal(other.state_dict(), ours)
    for k, v in other.model.named_parameters():
        assert torch.equal(v.detach(), dict(tr.model.named_parameters())[k].detach()), k
    tr.train_step(make_batch(3))
    other.train_step(make_batch(3))
    assert state_bytes_equal(other.state_dict(), tr.state_dict())


def test_forward_dtype_settings_are_checked_and_best_says_why(monkeypatch):
    from astraflow.config.sections import PolicySpec, TrainerSpec
    from astraflow.trainer import trainer as mod
    from astraflow.trainer.trainer import chosen_forward_dtype

    for bad, named in (({"forward_on": "master"}, "forward_on"),
                       ({"publish_dtype": "same"}, "publish_dtype"),
                       ({"dtype": "bf16"}, "dtype"), ({"backend": "megatron"}, "backend"),
                       ({"parallel": {"processes": 2}}, "process group")):
        with pytest.raises(ValueError, match=f"forward_dtype: .*{named}"):
            TrainerSpec(forward_dtype="bf16", **bad)
        grouped = "parallel" in bad
        spec = TrainerSpec(forward_dtype="best", **bad)
        assert chosen_forward_dtype(spec, grouped=grouped)[0] == "fp32"
    with pytest.raises(ValueError, match="trainer.forward_dtype: .*lora"):
        PolicySpec(model="m", lora={"rank": 4}, trainer={"forward_dtype": "bf16"})
    spec = TrainerSpec(forward_dtype="best")
    assert chosen_forward_dtype(spec, lora=True) == ("fp32", "bf16 needs no LoRA (lora: "
                                                     "trains adapters)")
    with pytest.raises(ValueError, match="forward_dtype"):
        TrainerSpec(forward_dtype="fp16")

    class Native:
        bf16, reason = True, "CPU has amx_bf16"

    class Not:
        bf16, reason = False, "CPU has no bf16 instructions"

    monkeypatch.setattr(mod, "best_precision", lambda device: Native)
    assert chosen_forward_dtype(spec) == ("bf16", "CPU has amx_bf16")
    monkeypatch.setattr(mod, "best_precision", lambda device: Not)
    assert chosen_forward_dtype(spec) == ("fp32", "CPU has no bf16 instructions")
    assert chosen_forward_dtype(TrainerSpec(forward_dtype="fp32"))[0] == "fp32"


def test_engine_computes_in_its_own_dtype_with_bf16_published_weights(tiny_model):
    """A RaaS engine (fp32 model) loads the published bf16 state: values cast, dtype kept."""
    from transformers import AutoModelForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.raas.engine import SamplingParams, TorchEngine
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=3), policy="actor")
    tr.train_step(make_batch(0))
    published = tr.published_state()
    engine = TorchEngine(
        AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True), None
    )
    engine.load_state_dict(published, 1)
    held = engine.state_dict()
    assert engine.version == 1 and {v.dtype for v in held.values()} == {torch.float32}
    for k, v in published.items():
        assert torch.equal(held[k], v.float()), k
    (gens,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0))
    assert len(gens[0].token_ids) == 3


def _grads(tr) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in tr.model.named_parameters() if p.grad is not None}


def _backward(tr, batch: Batch) -> float:
    """The batch's loss through the trainer's micro-batches, gradients left in place."""
    rows = [r for r in tr._rows(batch) if r.advantage != 0.0]
    total = sum(sum(1 for m in r.seq.loss_mask[1:] if m) for r in tr._rows(batch))
    tr.optimizer.zero_grad(set_to_none=True)
    return tr._accumulate(rows, total)["loss"]


def test_behaviour_logprobs_of_the_engine_equal_the_trainers_at_the_same_sampling(
    tiny_model,
):
    """TorchEngine records the log-prob of the distribution it sampled from (temperature,
    top-p nucleus renormalised); the trainer recomputes it on the same weights, and a
    trainer at another temperature or top-p does not."""
    from transformers import AutoModelForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.raas.engine import SamplingParams, TorchEngine
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    engine = TorchEngine(
        AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True), None,
        prefix_cache_bytes=0,
    )
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [11, 12, 13, 14]]
    for temp, top_p in ((1.0, 1.0), (1.0, 0.9), (0.7, 1.0), (0.7, 0.9), (0.0, 1.0)):
        gens = engine.generate(prompts, SamplingParams(max_new_tokens=6, temperature=temp,
                                                       top_p=top_p, n=2, seed=1))
        seqs = [
            Sequence(policy="actor", token_ids=g.prompt_ids + g.token_ids,
                     loss_mask=[0] * len(g.prompt_ids) + [1] * len(g.token_ids),
                     logprobs=[0.0] * len(g.prompt_ids) + g.logprobs,
                     versions=[-1] * len(g.prompt_ids) + g.versions, reward=0.0,
                     sample_index=0, finish_reason=g.finish_reason)
            for per_prompt in gens for g in per_prompt
        ]
        other_p = 0.9 if top_p == 1.0 else 1.0
        for trained, same in (((temp, top_p), True), ((1.3, top_p), False),
                              ((temp, other_p), False)):
            # the engine runs the fp32 model itself: the trainer computes on it unrounded
            tr = Trainer(tiny_model, TrainerSpec(publish_dtype="same"), policy="actor",
                         temperature=trained[0], top_p=trained[1])
            rows = [_Row(s, 1.0) for s in seqs]
            ids, attn, behaviour, mask, _ = tr._tensors(rows)
            with torch.no_grad():
                start = int(mask.any(0).nonzero()[0]) - 1
                new = tr.token_logprobs(ids, attn, start=start)
            diff = float(((new - behaviour).abs() * mask).max())
            if same:  # greedy (0) reports, and the trainer computes, temperature 1
                assert diff < 1e-4, (temp, top_p, trained, diff)
            else:
                assert diff > 1e-2, (temp, top_p, trained, diff)


def test_micro_batches_by_token_budget_give_the_full_batch_update(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(3, groups=3, samples=4)
    budget = 30
    tr = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_tokens=budget, share_prompt=False),
                 policy="actor")
    rows = tr._rows(batch)
    parts = tr.micro_batches(rows)
    assert sorted(id(r) for p in parts for r in p) == sorted(id(r) for r in rows)
    lengths = [len(r.seq.token_ids) for p in parts for r in p]
    assert lengths == sorted(lengths, reverse=True)  # longest first: little padding
    for p in parts:
        width = max(len(r.seq.token_ids) for r in p)
        assert len(p) * width <= budget or len(p) == 1, [len(r.seq.token_ids) for r in p]
    assert len(parts) > 2
    alone = Trainer(tiny_model, TrainerSpec(micro_batch_tokens=1), policy="actor")
    assert [len(p) for p in alone.micro_batches(rows)] == [1] * len(rows)

    one = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=100), policy="actor")
    assert len(one.micro_batches(rows)) == 1
    assert _backward(tr, batch) == pytest.approx(_backward(one, batch), rel=1e-5)
    g_parts, g_one = _grads(tr), _grads(one)
    assert g_parts.keys() == g_one.keys()
    for k, g in g_one.items():
        assert torch.allclose(g_parts[k], g, rtol=1e-4, atol=1e-7), k
    m = tr.train_step(batch)
    one.train_step(batch)
    assert m["trainer/micro_batches"] == float(len(parts))
    # Adam divides by |gradient|: where it is ~1e-9 (eps) summation-order noise shows
    # as ~1e-6 of the lr-1e-3 update, so 1 % of the step size
    for (k, a), b in zip(tr.state_dict().items(), one.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-5), k


@pytest.mark.parametrize("loss", ["decoupled_ppo", "m2po"])
def test_off_policy_objectives_give_the_full_batch_update_in_micro_batches(tiny_model, loss):
    """m2po's mask is taken over the whole batch (a no-grad pass first), so micro-batching
    changes nothing; decoupled_ppo needs no extra pass (one step per batch)."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(5, groups=3, samples=4)
    extra = {"m2_threshold": 0.005} if loss == "m2po" else {}
    small, one = (Trainer(tiny_model, TrainerSpec(lr=1e-3, loss=loss, micro_batch_size=n,
                                                    share_prompt=False, **extra),
                          policy="actor") for n in (1, 100))
    assert _backward(small, batch) == pytest.approx(_backward(one, batch), rel=1e-5)
    g_small, g_one = _grads(small), _grads(one)
    for k, g in g_one.items():
        assert torch.allclose(g_small[k], g, rtol=1e-4, atol=1e-7), k
    m = small.train_step(batch)
    assert m["trainer/grad_norm"] > 0 and math.isfinite(m["trainer/loss"])
    masked = m["trainer/m2_masked_frac"]
    assert (0 < masked < 1) if loss == "m2po" else masked == 0.0
    assert m["trainer/m2"] > 0 and m["trainer/outside_nucleus_frac"] == 0.0


def test_minibatches_step_each_part_against_the_proximal_policy_of_the_batch(tiny_model):
    """minibatches=2: the batch's groups cut in two parts, one AdamW step each, each loss
    divided by its own part's tokens; decoupled_ppo's second step is clipped around the
    policy before the first (its log-probs taken before any step), not around its own."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.loss import decoupled_ppo_loss
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(7, groups=3, samples=4)
    cfg = TrainerSpec(lr=3e-2, loss="decoupled_ppo", minibatches=2, share_prompt=False,
                        forward_on="master")
    tr = Trainer(tiny_model, cfg, policy="actor")
    parts = tr.minibatches(tr._rows(batch))
    assert [sorted({r.group for r in p}) for p in parts] == [[0], [1, 2]]
    m = tr.train_step(batch)
    assert m["trainer/minibatches"] == 2.0
    losses: list[float] = []

    ref = Trainer(tiny_model, cfg.model_copy(update=dict(minibatches=1)), policy="actor")
    rows = ref._rows(batch)
    first, second = [r for r in rows if r.group == 0], [r for r in rows if r.group > 0]
    ids, attn, behaviour, mask, adv = ref._tensors(second)
    with torch.no_grad():
        prox = ref.token_logprobs(ids, attn)
    for part in (first, second):
        tokens = int(sum(sum(r.seq.loss_mask[1:]) for r in part))
        ref.optimizer.zero_grad(set_to_none=True)
        if part is first:
            losses.append(ref._accumulate(part, tokens)["loss"])
        else:
            out = decoupled_ppo_loss(ref.token_logprobs(ids, attn), behaviour, adv, mask,
                                     num_tokens=tokens, logprobs_proximal=prox)
            out.loss.backward()
            losses.append(float(out.loss))
            assert out.sums["clip_frac"] > 0  # the clip binds: the policy moved in step 1
        ref._optimizer_step(tokens)
    for (k, a), b in zip(tr.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k
    assert m["trainer/clip_frac"] > 0
    assert m["trainer/loss"] == pytest.approx(sum(losses) / 2, rel=1e-5)

    # a loss without a proximal policy takes no extra forward pass
    calls: list[int] = []
    plain = Trainer(tiny_model, cfg.model_copy(update=dict(loss="clipped_tis")), policy="actor")
    real = plain.token_logprobs
    plain.token_logprobs = lambda i, a, **kw: calls.append(len(i)) or real(i, a, **kw)
    plain.train_step(batch)
    assert sum(calls) == len([r for r in rows if r.advantage != 0.0])
    with pytest.raises(ValueError, match=r"minibatches\n.*greater than or equal to 1"):
        TrainerSpec(minibatches=0)


def test_tokens_outside_the_trainers_nucleus_keep_the_loss_finite(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(4)  # random tokens: many outside a top-0.3 nucleus
    for loss in ("clipped_tis", "decoupled_ppo", "m2po"):
        tr = Trainer(tiny_model, TrainerSpec(lr=1e-3, loss=loss), policy="actor", top_p=0.3)
        m = tr.train_step(batch)
        assert 0 < m["trainer/outside_nucleus_frac"] < 1, loss
        assert all(math.isfinite(v) for v in m.values()), (loss, m)


@pytest.fixture(scope="module")
def tiny_dropout_model(tmp_path_factory) -> str:
    """The tiny model with attention dropout 0.5: in train mode two passes would differ."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(1)
    cfg = Qwen2Config(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                      max_position_embeddings=128, attention_dropout=0.5)
    cfg._attn_implementation = "eager"  # the dropout is applied in the eager attention
    path = tmp_path_factory.mktemp("tiny-qwen2-dropout")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_gradient_checkpointing_recomputes_layers_and_keeps_the_gradients(tiny_dropout_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(4)
    plain = Trainer(tiny_dropout_model, TrainerSpec(micro_batch_size=3, share_prompt=False),
                    policy="actor")
    ckpt = Trainer(tiny_dropout_model,
                   TrainerSpec(micro_batch_size=3, gradient_checkpointing=True),
                   policy="actor")
    assert not ckpt.model.model.layers[0].self_attn.training  # no dropout
    calls: list[str] = []
    for tr, name in ((plain, "plain"), (ckpt, "ckpt")):
        tr.model.model.layers[0].mlp.register_forward_pre_hook(lambda *a, n=name: calls.append(n))
    loss_plain = _backward(plain, batch)
    loss_ckpt = _backward(ckpt, batch)
    micro = len(plain.micro_batches([r for r in plain._rows(batch) if r.advantage]))
    # the checkpointed layer runs again in the backward pass (a pre-hook: the recompute
    # stops as soon as it has what the backward needs, inside the mlp)
    assert calls.count("plain") == micro and calls.count("ckpt") == 2 * micro
    assert loss_ckpt == loss_plain
    g_plain, g_ckpt = _grads(plain), _grads(ckpt)
    assert g_plain.keys() == g_ckpt.keys()
    for k, g in g_plain.items():
        assert torch.allclose(g_ckpt[k], g, rtol=1e-6, atol=1e-9), k
    # eval mode holds: the dropout of the model's config does not act
    assert _backward(ckpt, batch) == loss_ckpt


def test_bf16_autocast_keeps_fp32_master_weights_and_loss(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer
    from astraflow.weights.bits import state_bytes_equal

    torch.set_num_threads(1)
    batch = make_batch(2)
    cfg = TrainerSpec(lr=1e-4, micro_batch_size=3)
    fp32 = Trainer(tiny_model, cfg, policy="actor")
    bf16 = Trainer(tiny_model, cfg.model_copy(update=dict(autocast="bf16")), policy="actor")
    rows = bf16._rows(batch)
    ids, attn, _, mask, _ = bf16._tensors(rows)
    with torch.no_grad():
        lp16, lp32 = bf16.token_logprobs(ids, attn), fp32.token_logprobs(ids, attn)
    assert lp16.dtype == torch.float32
    err = float(((lp16 - lp32).abs() * mask).max())
    assert 0 < err < 0.1, err  # computed in bf16 (not bit-equal), close to fp32
    _backward(bf16, batch)
    assert {g.dtype for g in _grads(bf16).values()} == {torch.float32}
    m = bf16.train_step(batch)
    assert math.isfinite(m["trainer/loss"]) and m["trainer/grad_norm"] > 0
    master, published = bf16.state_dict(), bf16.published_state()
    assert {v.dtype for v in master.values()} == {torch.float32}
    for k, v in published.items():
        assert torch.equal(v, master[k].to(torch.bfloat16)), k
    # the state snapshot restores exactly, while training goes on after it
    snap = bf16.snapshot(1)
    before = {k: v.clone() for k, v in master.items()}
    bf16.train_step(make_batch(3))
    other = Trainer(tiny_model, cfg.model_copy(update=dict(autocast="bf16")), policy="actor")
    other.load_master_bytes(b"".join(snap.master_bytes()))
    other.load_optimizer_bytes(b"".join(snap.optimizer_bytes()))
    assert state_bytes_equal(other.state_dict(), before)
    other.train_step(make_batch(3))
    assert state_bytes_equal(other.state_dict(), bf16.state_dict())
    assert _optimizer_states_equal(other.optimizer.state_dict(), bf16.optimizer.state_dict())


def test_a_registered_loss_is_picked_by_name(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.loss import LOSSES, LossOutput, get_loss, register_loss
    from astraflow.trainer.trainer import Trainer

    assert get_loss("clipped_tis") is policy_loss
    with pytest.raises(ValueError, match="clipped_tis"):
        get_loss("nope")
    with pytest.raises(ValueError, match=r"loss\n.*unknown loss 'nope'"):
        TrainerSpec(loss="nope")
    calls = []

    @register_loss("test_reinforce")
    def reinforce(logprobs_new, logprobs_behaviour, advantages, loss_mask, *, num_tokens=None,
                  **hyper):
        calls.append(sorted(hyper))
        mask = loss_mask.to(logprobs_new.dtype)
        adv = torch.broadcast_to(advantages.to(logprobs_new.dtype), logprobs_new.shape)
        loss = -(logprobs_new * adv * mask).sum() / max(float(num_tokens or mask.sum()), 1.0)
        return LossOutput(loss=loss, tokens=int(mask.sum()), sums={"pg_tokens": float(mask.sum())})

    try:
        torch.set_num_threads(1)
        # a loss registered in code, not a topology's: set on a built spec
        spec = TrainerSpec(lr=1e-3).model_copy(update={"loss": "test_reinforce"})
        tr = Trainer(tiny_model, spec, policy="actor")
        m = tr.train_step(make_batch(2))
        assert calls and calls[0] == ["clip_high", "clip_low", "m2_threshold", "tis_cap",
                                     "tis_mask"]
        assert m["trainer/grad_norm"] > 0 and m["trainer/pg_tokens"] == 1.0
        assert m["trainer/clip_frac"] == 0.0  # the default loss's figures stay reported
    finally:
        del LOSSES["test_reinforce"]


def test_a_policys_trainer_takes_its_typed_sections(tiny_model):
    """``Trainer.for_policy``: the policy's ``trainer:`` section itself, and its sampling,
    staleness bound and LoRA adapters; left out of a hand-built trainer, they change
    nothing."""
    from astraflow.config.sections import PolicySpec, TrainerSpec
    from astraflow.trainer.trainer import Trainer

    spec = PolicySpec(model=tiny_model, temperature=0.7, top_p=0.9, max_staleness=2,
                      trainer={"lr": 1e-3, "adam_beta2": 0.99, "std_normalize": False},
                      lora={"rank": 4})
    tr = Trainer.for_policy(spec, "actor")
    assert tr.spec is spec.trainer and tr.optimizer.defaults["betas"] == (0.9, 0.99)
    assert (tr.temperature, tr.top_p, tr.max_staleness) == (0.7, 0.9, 2)
    assert tr.lora is not None and tr.lora.rank == 4
    plain = Trainer(tiny_model, TrainerSpec(), "actor", temperature=0.0)
    assert (plain.temperature, plain.top_p, plain.max_staleness, plain.lora) == (
        1.0, 1.0, None, None)  # greedy's log-probs are at temperature 1


def test_config_errors_name_the_key(tiny_model):
    """The trainer's settings are checked where they are declared (``TrainerSpec``, the
    policy's ``PolicySpec``): a bad one fails naming its key, and ``trainer run`` names
    its flag."""
    from pydantic import ValidationError

    from astraflow.config.components import trainer_spec
    from astraflow.config.sections import PolicySpec, TrainerSpec
    from astraflow.config.topology import parse_topology

    bad_trainer = [
        ({"micro_batch_tokens": 0}, "micro_batch_tokens"),
        ({"micro_batch_size": 0}, "micro_batch_size"),
        ({"m2_threshold": 0.0, "loss": "m2po"}, "m2_threshold"),
        ({"tis_cap": 1.2}, "tis_cap"),
        ({"loss": "decoupled_ppo", "tis_cap": 0.0}, "tis_cap"),
        ({"autocast": "fp16"}, "autocast"),
        ({"adam_impl": "apex"}, "adam_impl"),
        ({"lr": 0.0}, "lr"),
        ({"max_grad_norm": 0.0}, "max_grad_norm"),
        ({"dtype": "int8"}, "dtype"),
        ({"backend": "jax"}, "backend"),
    ]
    for kw, key in bad_trainer:
        with pytest.raises(ValidationError, match=rf"(^|\.|\n){key}(\n|:)"):
            TrainerSpec(**kw)
    for kw, key in (({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
                    ({"top_p": 1.5}, "top_p"), ({"max_staleness": -1}, "max_staleness")):
        with pytest.raises(ValidationError, match=rf"\n{key}\n"):
            PolicySpec(model="m", **kw)
    topo = parse_topology({"run": "r", "policies": {"a": {"model": "m"}}})
    for key in ("state_interval", "keep_optimizer", "state_max_lag"):
        with pytest.raises(ValidationError, match=rf"\n{key}\n"):
            TrainerSpec(**{key: 0})
        flag = "--" + key.replace("_", "-")
        with pytest.raises(ValueError, match=rf"^{flag}: Input should be greater than or "
                           "equal to 1"):
            trainer_spec(topo, "a", {key: 0})
    TrainerSpec(micro_batch_tokens=1)
    TrainerSpec(loss="decoupled_ppo", tis_cap=1.2)  # no clip-higher bound there
    cli = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "trainer", "run", "--topology",
         str(REPO / "topology" / "default.yaml"), "--policy", "actor", "--model", tiny_model,
         "--micro-batch-tokens", "0"],
        capture_output=True, text=True, cwd=REPO, timeout=120,
    )
    assert cli.returncode == 2 and "--micro-batch-tokens" in cli.stderr, cli.stderr


class _SlowStore:
    """A blob store whose writes wait for ``release`` (or fail when ``fail`` is set)."""

    uri = "memory://slow"

    def __init__(self, fail: bool = False):
        import threading

        self.release = threading.Event()
        self.fail = fail
        self.blobs: dict[str, bytes] = {}

    def put(self, blob_id, data):
        import hashlib

        from astraflow.wire.records import BlobRef

        self.release.wait(30)
        if self.fail:
            raise OSError("disk full")
        from astraflow.weights.stores.base import pieces

        raw = b"".join(bytes(p) for p in pieces(data))
        self.blobs[blob_id] = raw
        return BlobRef(uri=f"{self.uri}/{blob_id}", bytes=len(raw),
                       sha256=hashlib.sha256(raw).hexdigest())


def test_state_writer_writes_in_the_background_one_at_a_time(tiny_model):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.state import StateWriter, recorded_state_version
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerSpec(lr=1e-4, micro_batch_size=3), policy="actor")
    tr.train_step(make_batch(0))
    store = _SlowStore()
    writer = StateWriter(store, "actor", tr)
    assert writer.start(1) >= 0  # the snapshot's seconds, on this thread
    assert writer.in_flight == 1 and writer.poll() is None  # still writing
    with pytest.raises(RuntimeError, match="version 1 is still being written"):
        writer.start(1)
    tr.train_step(make_batch(1))  # training goes on meanwhile
    store.release.set()
    done = writer.wait()
    assert done is not None and done.version == 1 and writer.in_flight is None
    assert writer.poll() is None and writer.wait() is None  # collected once
    assert sorted(k.split(".")[2] for k in store.blobs) == ["master", "optim"]
    assert recorded_state_version(7, done.meta) == 1
    assert recorded_state_version(7, {"optimizer_uri": "x"}) == 7  # before: its own version
    assert recorded_state_version(7, {}) is None

    # the state streams in chunks, the same bytes torch.save writes into a file; a reader
    # that stops early stops the serializing thread
    import io

    from astraflow.trainer import state as state_mod

    snap = tr.snapshot(3)
    buf = io.BytesIO()
    torch.save(snap.optimizer, buf)
    chunk, state_mod._CHUNK = state_mod._CHUNK, 4096
    try:
        parts = list(snap.optimizer_bytes())
        assert len(parts) > 2 and b"".join(parts) == buf.getvalue()
        stream = snap.master_bytes()
        next(stream)
        stream.close()  # joins the serializer: it must not hang on the full queue
    finally:
        state_mod._CHUNK = chunk

    failing = _SlowStore(fail=True)
    failing.release.set()
    writer = StateWriter(failing, "actor", tr)
    writer.start(2)
    with pytest.raises(RuntimeError, match="state of version 2 failed: OSError: disk full"):
        writer.wait()
    assert writer.in_flight is None


def test_the_state_writers_share_one_interface(tmp_path):
    """The service tells its state writer apart by nothing: both formats are
    ``TrainerStateWriter``s, and a DCP directory is removed by its owner (rank 0) alone."""
    from astraflow.trainer.checkpoint_writer import CheckpointWriter, state_path
    from astraflow.trainer.state import StateWriter, TrainerStateWriter

    members = {n for n in dir(TrainerStateWriter) if not n.startswith("_")}
    assert members == {"in_flight", "start", "poll", "wait", "remove"}
    for cls in (StateWriter, CheckpointWriter):
        assert members <= set(dir(cls)), cls
    where = state_path(tmp_path, "actor", 3)
    where.mkdir(parents=True)
    CheckpointWriter(None, tmp_path, "actor", owner=False).remove(3)
    assert where.exists()  # another rank's view of the group's directory
    CheckpointWriter(None, tmp_path, "actor").remove(3)
    assert not where.exists()


def test_a_follower_does_what_rank_0_says_in_typed_records():
    """A rank > 0 trains, flushes and stops on rank 0's typed records, in order, and
    fails at once on anything else."""
    from types import SimpleNamespace

    from astraflow.trainer.commands import Flush, Stop, TrainStep
    from astraflow.trainer.service import TrainerService

    step = TrainStep(make_batch(0), "r.batches.actor", 0, 5, final=True)
    done: list = []

    def follower(commands):
        said = iter(commands)
        return SimpleNamespace(
            rank=1, dist=SimpleNamespace(wait_for_all=lambda: None,
                                         command=lambda obj: next(said)),
            _open=lambda: None, _restore=lambda: done.append("restore"),
            _step=lambda s, cp: done.append((s, cp)),
            flush=lambda cp: done.append(("flush", cp)), close=lambda: done.append("close"))

    TrainerService._follow(follower([step, Flush(), Stop(), step]))
    assert done == ["restore", (step, None), ("flush", None), "close"]
    done.clear()
    with pytest.raises(RuntimeError, match=r"rank 0 sent \('step',\), not a RankCommand"):
        TrainerService._follow(follower([("step",)]))
    assert done == ["restore", "close"]


def _optimizer_states_equal(a: dict, b: dict) -> bool:
    """Bit-identical optimizer ``state_dict()``s (tensors compared by their bytes)."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i, sa in a["state"].items():
        sb = b["state"][i]
        if sa.keys() != sb.keys():
            return False
        for k, x in sa.items():
            y = sb[k]
            if isinstance(x, torch.Tensor):
                if not (
                    isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype
                    and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                ):
                    return False
            elif x != y:
                return False
    return True


# --------------------------------------------------------------------------- on Kafka
def _crash_then_resume(kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, *,
                       n: int, crash_at: int, args: list[str]):
    """``astraflow trainer run`` over ``n`` batches: SIGKILLed with version ``crash_at``'s
    transaction open (blobs written, manifests and offsets sent, no commit), then restarted
    until version ``n`` and stopped with SIGTERM. Returns the batches sent, the manifests
    after the crash and at the end, and the log."""
    from astraflow.weights.stores.kafka import read_manifests

    batches_topic = topo.full_name("batches.actor")
    weights_topic = topo.full_name("weights.actor")
    producer = RecordProducer(kafka_config)
    for i in range(n):
        producer.produce(batches_topic, make_batch(i), key="actor")
    producer.flush()
    sent = read_all(kafka_config, batches_topic, idle_s=1.0, expect=Batch)
    assert len(sent) == n
    log = tmp_path / "trainer.log"
    cmd = [sys.executable, "-m", "astraflow.cli.main", "trainer", "run", "--topology", str(path),
           "--policy", "actor", "--model", tiny_model, "--state-dir", str(tmp_path / "state"),
           "--anchor-interval", "4", "--threads", "1", "--instance", "0", *args]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env={**env, "ASTRAFLOW_TRAINER_CRASH_AT": str(crash_at)},
                             stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert p.wait(180) == -signal.SIGKILL, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    before = read_manifests(kafka_config, weights_topic)
    assert sorted({m.version for m in before}) == list(range(crash_at))

    def newest() -> int:
        return max((m.version for m in read_manifests(kafka_config, weights_topic)), default=-1)

    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: newest() >= n, 180, f"version {n}", step=1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    return sent, before, read_manifests(kafka_config, weights_topic), log.read_text()


def _reference(tiny_model, sent, spec, **policy) -> dict[str, dict]:
    """The uninterrupted run over the same (decoded) batches: per version its master
    weights, published weights and optimizer state (``policy``: the Trainer's keywords)."""
    import copy

    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    ref = Trainer(tiny_model, spec, policy="actor", **policy)
    out: dict[str, dict] = {"master": {}, "published": {}, "optimizer": {}}

    def keep(v: int) -> None:
        out["master"][v] = {k: t.clone() for k, t in ref.state_dict().items()}
        out["published"][v] = {k: t.clone() for k, t in ref.published_state().items()}
        out["optimizer"][v] = copy.deepcopy(ref.optimizer.state_dict())

    keep(0)
    for v, r in enumerate(sent, start=1):
        ref.train_step(r.record)
        keep(v)
    return out


def _check_history(kafka_config, manifests, sent, ref, batches_topic: str) -> None:
    """Versions 1..n contiguous, version v trained on batch v-1 (each batch once), and
    every published version equal to the uninterrupted run's bit for bit."""
    from astraflow.weights.bits import state_bytes_equal
    from astraflow.weights.follower import WeightFollower

    n = len(sent)
    assert sorted(m.version for m in manifests if m.kind == "delta") == list(range(1, n + 1))
    for m in manifests:
        if m.version == 0:
            assert m.consumed_offsets == []
            continue
        (po,) = m.consumed_offsets
        assert (po.topic, po.partition) == (batches_topic, 0)
        assert po.offset == sent[m.version - 1].offset + 1
        assert m.meta["batch_id"] == f"batch-{m.version - 1}"
        assert int(m.meta["batch_offset"]) == sent[m.version - 1].offset
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    for target in range(n + 1):
        follower.update(target)
        assert state_bytes_equal(follower.state, ref["published"][target]), target


def _recorded(manifests) -> dict[int, object]:
    """state version -> the manifest that records it."""
    from astraflow.trainer.state import recorded_state_version

    out = {}
    for m in sorted(manifests, key=lambda m: m.version):
        v = recorded_state_version(m.version, m.meta)
        if v is not None:
            assert v not in out or out[v].meta["optimizer_uri"] == m.meta["optimizer_uri"]
            out.setdefault(v, m)
    return out


def _check_state_blobs(store, manifest, ref, version: int, master: bool) -> None:
    """The state blobs a manifest records equal the uninterrupted run's at ``version``."""
    import io

    from astraflow.weights.bits import state_bytes_equal

    opt = torch.load(io.BytesIO(store.get(_meta_ref(manifest.meta, "optimizer"))),
                     weights_only=True)
    assert _optimizer_states_equal(opt, ref["optimizer"][version]), version
    assert ("master_uri" in manifest.meta) == master
    if master:
        weights = torch.load(io.BytesIO(store.get(_meta_ref(manifest.meta, "master"))),
                             weights_only=True)
        assert state_bytes_equal(weights, ref["master"][version]), version


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("publish,overlap", [(None, "off"), ("same", "off"), (None, "on")],
                         ids=["publish-bf16-default", "publish-same", "publish-overlap"])
def test_trainer_resumes_exactly_after_sigkill(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, publish, overlap
):
    """State written every version. Default: fp32 master weights, bf16 published; ``same``:
    fp32 published. ``publish-overlap``: each version is written while the next batch
    trains and committed with the next step (its batch's offset held back until then):
    the SIGKILL then comes with batch 4 trained and version 3's transaction open."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.weights.stores import FileBlobStore

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    n = 6
    lr = "1e-4"  # the tiny random model's weights are ~0.02: larger rates move every bf16
    sent, before, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, n=n, crash_at=3,
        args=["--lr", lr, "--micro-batch-size", "3", "--state-interval", "1",
              "--publish-overlap", overlap,
              *(["--publish-dtype", publish] if publish else [])])
    # every version's state is recorded by the next version's manifest (lag <= interval):
    # version 1's by version 2's; version 2's was to go with the crashed version 3
    assert sorted(_recorded(before)) == [1]
    assert "resumed at version 2 from the state of version 1" in text, text[-3000:]
    assert "recomputed versions 2..2" in text, text[-3000:]
    assert "matches version 2's manifest" in text, text[-3000:]
    master_log = "master weights loaded" if publish is None else "master weights the published"
    assert master_log in text, text[-3000:]

    statuses = [
        r.record
        for r in read_all(
            kafka_config, topo.full_name("status"), idle_s=1.0, expect=ComponentStatus
        )
    ]
    mine = [s for s in statuses if s.kind == "trainer" and s.policy == "actor"]
    assert mine and max(s.weight_versions["actor"] for s in mine) >= 3
    assert all("trainer/wait_fraction" in s.metrics for s in mine)

    assert sorted(m.version for m in manifests if m.kind == "full") == [0, 4]
    cfg = TrainerSpec(lr=float(lr), micro_batch_size=3, publish_dtype=publish or "bf16")
    ref = _reference(tiny_model, sent, cfg)
    _check_history(kafka_config, manifests, sent, ref, topo.full_name("batches.actor"))
    dtype = "float32" if publish == "same" else "bfloat16"
    assert {m.dtype for m in manifests} == {dtype}
    # version v's state is recorded by version v+1. Version 2's went with the crashed
    # transaction (its blobs are garbage) and the resumed trainer recomputed version 2
    # without writing it; the write after the last version is recorded by none and deleted
    # at the stop
    recorded = _recorded(manifests)
    assert sorted(recorded) == [1, *range(3, n)], sorted(recorded)
    assert all(m.version == v + 1 for v, m in recorded.items())
    store = FileBlobStore(tmp_path / "state" / "blobs", create=False)
    for v in (n - 1,):  # the resumed trainer's state equals the uninterrupted run's
        _check_state_blobs(store, recorded[v], ref, v, master=publish is None)
    # the newest 3 recorded states are kept (--keep-optimizer); older ones are deleted, and
    # so is the one written after the last version
    kept = {".".join(b.blob_id.split(".")[1:3]) for b in store.list()}
    kinds = ["optim", "master"] if publish is None else ["optim"]
    for v in range(n - 3, n):
        assert {f"v{v:08d}.{k}" for k in kinds} <= kept, (v, kept)
    for v in (1, n):
        assert not {f"v{v:08d}.{k}" for k in kinds} & kept, (v, kept)

    # delta sparsity: AdamW moves every fp32 weight each step, but only some of them cross
    # a bf16 rounding step (at this lr about 0.3-0.5 of the bf16 weights stay unchanged)
    masters = ref["master"]
    deltas = {m.version: m for m in manifests if m.kind == "delta"}
    fp32_unchanged = [
        sum(int((masters[v][k] == masters[v - 1][k]).sum()) for k in masters[v])
        / sum(t.numel() for t in masters[v].values())
        for v in range(1, n + 1)
    ]
    assert max(fp32_unchanged) < 0.05, fp32_unchanged
    if publish is None:
        sparsity = [deltas[v].sparsity for v in range(1, n + 1)]
        assert min(sparsity[2:]) > 0.25 and max(fp32_unchanged) + 0.2 < min(sparsity[2:]), (
            sparsity
        )
    else:
        assert max(deltas[v].sparsity for v in range(1, n + 1)) < 0.05


@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_recomputes_the_versions_after_the_newest_state_on_resume(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path
):
    """State every 3 versions, crash between state writes (version 6's transaction open):
    the restart loads the state of version 3, recomputes 4 and 5 without publishing
    (checked against the published ones), then trains on. The real-model settings (bf16
    autocast, gradient checkpointing, token-budget micro-batches) and a learning-rate
    schedule that changes every step resume exactly too."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.weights.stores import FileBlobStore

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    n = 8
    sent, before, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, n=n, crash_at=6,
        args=["--lr", "1e-4", "--micro-batch-tokens", "40", "--autocast", "bf16",
              "--gradient-checkpointing", "--state-interval", "3", "--state-max-lag", "1",
              "--lr-warmup-steps", "2", "--lr-decay", "cosine", "--lr-final", "2e-5",
              "--lr-decay-steps", "5"])
    recorded_before = _recorded(before)
    assert sorted(recorded_before) == [3] and recorded_before[3].version == 4
    assert "resumed at version 5 from the state of version 3" in text, text[-3000:]
    assert "recomputed versions 4..5" in text, text[-3000:]
    assert "recomputed version 4 from batch batch-3" in text, text[-3000:]
    cfg = TrainerSpec(lr=1e-4, micro_batch_tokens=40, autocast="bf16",
                        gradient_checkpointing=True, lr_warmup_steps=2, lr_decay="cosine",
                        lr_final=2e-5, lr_decay_steps=5)
    ref = _reference(tiny_model, sent, cfg)
    _check_history(kafka_config, manifests, sent, ref, topo.full_name("batches.actor"))
    recorded = _recorded(manifests)
    assert {v: m.version for v, m in recorded.items()} == {3: 4, 6: 7}
    store = FileBlobStore(tmp_path / "state" / "blobs", create=False)
    for v, m in recorded.items():
        _check_state_blobs(store, m, ref, v, master=True)
    states = {".".join(b.blob_id.split(".")[1:3]) for b in store.list()
              if b.blob_id.split(".")[2] in ("optim", "master")}
    assert {s.split(".")[0] for s in states} == {"v00000003", "v00000006"}, states


def _meta_ref(meta: dict[str, str], kind: str):
    from astraflow.wire.records import BlobRef

    return BlobRef(
        uri=meta[f"{kind}_uri"], bytes=int(meta[f"{kind}_bytes"]), sha256=meta[f"{kind}_sha256"]
    )


def test_group_staleness_guard_drops_old_groups():
    from astraflow.trainer.trainer import _group_staleness
    from astraflow.wire.records import Sequence, TrajectoryGroup

    def grp(versions):
        s = Sequence(policy="actor", token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                     logprobs=[0.0, -1.0, -1.0], versions=versions, reward=1.0, sample_index=0,
                     finish_reason="stop")
        return TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="w",
                               source="s", raas_id="r", pool="p", sequences=[s], rewards=[1.0])

    assert _group_staleness(grp([-1, 3, 5]), "actor", 7) == 4
    assert _group_staleness(grp([-1, -1, -1]), "actor", 7) == 0
    assert _group_staleness(grp([-1, 3, 5]), "other", 7) == 0


@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_state_is_written_in_the_background_and_restores_exactly(
    kafka_config, make_topology, tiny_model, tmp_path
):
    """In process, state every 2 versions: a write is recorded by a later manifest, at the
    latest by the next state's version; a restart recomputes the versions after the newest
    state and then equals the trainer that wrote them; a master blob whose bytes changed
    (sha256) is refused; other settings are published as a rebase version."""
    from astraflow.trainer.service import TrainerService
    from astraflow.weights.bits import state_bytes_equal
    from astraflow.weights.stores.kafka import read_manifests

    topo, _ = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    producer = RecordProducer(kafka_config)
    for i in range(4):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def options(temperature: float = 1.0, **kw):
        return service_options(tiny_model, tmp_path / "state", temperature=temperature,
                               state_interval=2, **kw)

    def restored(**kw) -> TrainerService:
        svc = TrainerService(topo, options(**kw), config=kafka_config)
        svc._open()
        try:
            svc._restore()
        finally:
            svc.store.close()
        return svc

    # no state yet after version 1: the next run starts from version 0 (the model
    # directory) and recomputes version 1
    TrainerService(topo, options(max_steps=1), config=kafka_config).run()
    first = TrainerService(topo, options(max_steps=3), config=kafka_config)
    first.run()
    assert first.resumed_from == 1 and first.version == 4
    manifests = read_manifests(kafka_config, topo.full_name("weights.actor"))
    recorded = _recorded(manifests)
    assert list(recorded) == [2] and recorded[2].version in (3, 4), recorded
    assert first.state_version == 2
    blobs = [b.blob_id for b in first.store.list()]
    assert not [b for b in blobs if ".v00000004.optim" in b or ".v00000004.master" in b]

    second = restored()
    assert second.resumed_from == 4
    assert second.trainer.state_dict()["model.norm.weight"].dtype == torch.float32
    assert state_bytes_equal(second.trainer.state_dict(), first.trainer.state_dict())
    assert _optimizer_states_equal(
        second.trainer.optimizer.state_dict(), first.trainer.optimizer.state_dict()
    )
    assert state_bytes_equal(second.publishing.publisher._prev, first.publishing.publisher._prev)
    assert second.positions == first.positions

    assert recorded[2].dtype == "bfloat16"
    blob = tmp_path / "state" / "blobs" / recorded[2].meta["master_uri"].rsplit("/", 1)[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    blob.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="master state of version 2.*sha256"):
        restored()
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))

    # other settings recompute other weights: published as a rebase (version 5), not
    # refused (tests/integration/trainer/test_trainer_resume.py follows one through)
    rebased = TrainerService(topo, options(temperature=0.9), config=kafka_config)
    rebased.stop()  # start (restore, rebase), then stop at once
    rebased.run()
    assert rebased.resumed_from == 4 and rebased.version == 5
    assert max(m.version for m in read_manifests(
        kafka_config, topo.full_name("weights.actor"))) == 5


@pytest.mark.parametrize("size, passes", [(4, [4, 4, 4]), (12, [12]), (5, [5, 5, 2])])
def test_shared_prompt_pass_gives_the_logprobs_and_gradients_of_separate_passes(
        tiny_model, size, passes):
    """A pass runs each of its prompts once, their keys/values repeated for their samples:
    one prompt a pass, several (of unequal lengths), or groups cut across passes, the
    log-probs, the loss and every gradient equal those of one pass per sequence."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    batch = make_batch(7, groups=3, samples=4)
    prompts = {len(g.sequences[0].token_ids) - sum(g.sequences[0].loss_mask)
               for g in batch.groups}
    assert len(prompts) > 1  # of unequal lengths: padded in the shared pass
    shared = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=size),
                     policy="actor")
    plain = Trainer(tiny_model, TrainerSpec(lr=1e-3, share_prompt=False), policy="actor")
    got = shared.passes(shared._rows(batch))
    assert [len(p) for _, p in got] == passes and all(s for s, _ in got)
    for _, part in got:
        ids, attn, _, mask, _ = shared._tensors(part)
        lens = [s.seq.loss_mask.index(1) for s in part]
        with torch.no_grad():
            a = shared.shared_prompt_logprobs(ids, attn, lens)
            b = plain.token_logprobs(ids, attn)
        assert float(((a - b).abs() * mask).max()) < 1e-5
        assert all(not a[i, :n].any() for i, n in enumerate(lens))  # prompts: none
    assert not any(s for s, _ in plain.passes(plain._rows(batch)))
    assert _backward(shared, batch) == pytest.approx(_backward(plain, batch), rel=1e-5)
    g_shared, g_plain = _grads(shared), _grads(plain)
    assert g_shared.keys() == g_plain.keys()
    for k, g in g_plain.items():
        assert torch.allclose(g_shared[k], g, rtol=1e-4, atol=1e-7), k
    # a prompt is at least one token and leaves at least one
    with pytest.raises(ValueError, match="prompt lengths"):
        shared.shared_prompt_logprobs(ids, attn, [int(attn[0].sum())] * len(part))


@pytest.mark.kafka
@pytest.mark.slow
def test_a_dead_letter_behind_a_held_version_is_not_written_twice_after_a_crash(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path
):
    """publish_overlap on: version 1 (batch 0) is still being written when batch 1 turns out
    bad. Its dead letter commits together with version 1 and the offsets past batch 1, so
    a SIGKILL before that commit loses both and the restart writes the letter once."""
    from astraflow.weights.stores.kafka import read_manifests
    from astraflow.wire.records import DeadLetter

    topo, path = make_topology(topics={"batches.actor": {"partitions": 1},
                                       "weights.actor": {"partitions": 1}, "dlq": {}})
    bad = make_batch(1)
    seq = bad.groups[0].sequences[0]
    bad.groups[0].sequences[0] = dataclasses.replace(seq, logprobs=seq.logprobs[:-1])
    producer = RecordProducer(kafka_config)
    for b in (make_batch(0), bad, make_batch(2)):
        producer.produce(topo.full_name("batches.actor"), b, key="actor")
    producer.flush()
    cmd = [sys.executable, "-m", "astraflow.cli.main", "trainer", "run", "--topology", str(path),
           "--policy", "actor", "--model", tiny_model, "--state-dir", str(tmp_path / "state"),
           "--threads", "1", "--lr", "1e-4", "--micro-batch-size", "3",
           "--publish-overlap", "on"]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "trainer.log"
    with open(log, "ab") as out:
        code = subprocess.run(cmd, env={**env, "ASTRAFLOW_TRAINER_CRASH_AT": "1"}, stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO, timeout=180).returncode
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    with open(log, "ab") as out:
        code = subprocess.run([*cmd, "--max-steps", "2"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO, timeout=180).returncode
    assert code == 0, log.read_text()[-3000:]
    manifests = read_manifests(kafka_config, topo.full_name("weights.actor"))
    assert sorted(m.version for m in manifests if m.kind == "delta") == [1, 2]
    assert {m.meta["batch_id"] for m in manifests if m.version} == {"batch-0", "batch-2"}
    letters = read_all(kafka_config, topo.full_name("dlq"), idle_s=1.0, expect=DeadLetter)
    assert len(letters) == 1, [r.record.error for r in letters]


@pytest.mark.kafka
def test_trainer_dead_letters_a_batch_that_decodes_but_makes_no_sense(
    kafka_config, make_topology, tiny_model, tmp_path
):
    """A group whose sequence fields differ in length, a NaN reward, or a token of a version
    not yet published goes to dlq with the reason; the trainer trains the good batches
    around them instead of crash-looping."""
    from astraflow.trainer.service import TrainerService
    from astraflow.wire.records import DeadLetter

    topo, _ = make_topology(topics={"batches.actor": {"partitions": 1},
                                    "weights.actor": {"partitions": 1}, "dlq": {}})
    good = make_batch(0)
    short = make_batch(1)
    seq = short.groups[0].sequences[0]
    short.groups[0].sequences[0] = dataclasses.replace(seq, logprobs=seq.logprobs[:-1])
    nan = make_batch(2)
    nan.groups[1].sequences[2] = dataclasses.replace(nan.groups[1].sequences[2],
                                                     reward=float("nan"))
    future = make_batch(1, seed=2)  # generated by version 7, which does not exist yet
    future.groups[0].sequences[1] = dataclasses.replace(
        future.groups[0].sequences[1],
        versions=[v if v < 0 else 7 for v in future.groups[0].sequences[1].versions])
    producer = RecordProducer(kafka_config)
    for b in (good, short, nan, future, make_batch(1, seed=3)):
        producer.produce(topo.full_name("batches.actor"), b, key="actor")
    producer.flush()
    torch.set_num_threads(1)
    svc = TrainerService(topo, service_options(tiny_model, tmp_path / "state", max_steps=2),
                         config=kafka_config)
    svc.run()
    assert svc.version == 2 and svc.counters.dead_lettered == 3
    dead = [r.record for r in read_all(kafka_config, topo.full_name("dlq"), expect=DeadLetter)]
    assert len(dead) == 3
    assert "generated by version 7, newer than the newest published (1)" in dead[2].error
    assert "logprobs (" in dead[0].error and "differ in length" in dead[0].error
    assert "InvalidRecord: Batch: group" in dead[0].error
    assert "reward is nan" in dead[1].error


@pytest.mark.kafka
@pytest.mark.parametrize("store", ["kafka", "file"])
def test_trainer_prunes_blobs_older_than_the_kept_versions(kafka_config, make_topology,
                                                          tiny_model, tmp_path, store):
    """With full checkpoints every 2 versions and 2 versions kept, the blobs of the old
    versions go (Kafka: DeleteRecords on weights.blobs; file: deleted), and a new reader
    still reaches the newest version; with keep_versions 0 everything stays."""

    from astraflow.trainer.service import TrainerService
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    topics = {"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    if store == "kafka":
        topics["weights.blobs"] = {"partitions": 1, "max_message_bytes": 16_777_216}
    topo, _ = make_topology(topics=topics)
    producer = RecordProducer(kafka_config)
    for i in range(8):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def train(keep: int, steps: int) -> TrainerService:
        svc = TrainerService(topo, service_options(
            tiny_model, tmp_path / "state", max_steps=steps, anchor_interval=2,
            keep_versions=keep, state_interval=100), config=kafka_config)
        svc.run()
        return svc

    svc = train(keep=0, steps=3)
    assert svc.blob_uri.startswith("kafka://" if store == "kafka" else "file://")
    before = _oldest_blob(svc, kafka_config)
    assert before == 0  # keep_versions 0: everything stays
    svc = train(keep=2, steps=4)  # versions 4..7; full checkpoints at 4 and 6
    assert svc.version == 7
    # kept: from the newest full checkpoint at or below version 7 - 2 + 1 = 6, seen when
    # version 6 (a full one) was committed: 4
    assert _oldest_blob(svc, kafka_config) == (4 if store == "file" else
                                               _first_offset_of(svc, 4))
    manifests = [m for m in read_manifests(kafka_config, topo.full_name("weights.actor"))]
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    assert follower.update().version == 7
    assert follower.state is not None


def _oldest_blob(svc, kafka_config) -> int:
    """The blob topic's low watermark, or the oldest version with a weight blob file."""
    from confluent_kafka import Consumer, TopicPartition

    if svc.blob_uri.startswith("kafka://"):
        c = Consumer(kafka_config.consumer_conf("x"))
        try:
            return c.get_watermark_offsets(TopicPartition(svc.blob_uri[8:], 0), timeout=10)[0]
        finally:
            c.close()
    names = [p.name for p in Path(svc.blob_uri[7:]).iterdir() if ".optim" not in p.name
             and ".master" not in p.name and not p.name.startswith(".")]
    return min(int(n.split(".v")[1][:8]) for n in names)


def _first_offset_of(svc, version: int) -> int:
    """The offset of the first chunk of ``version``'s first blob (from its uri)."""
    from astraflow.weights.stores.kafka import read_manifests

    ms = [m for m in read_manifests(svc.config, svc.weights_topic) if m.version == version]
    return min(int(ref.uri.split("offset=")[1]) for m in ms for ref in m.blobs)


@pytest.mark.kafka
def test_a_reader_without_the_model_builds_it_from_the_weight_stream(kafka_config,
                                                                     make_topology,
                                                                     tiny_model, tmp_path):
    """The trainer names the model's other files in every full checkpoint; a component
    whose model directory is missing builds it from Kafka alone: those files plus the
    weights of the newest version, bit for bit what the trainer published."""
    from safetensors.torch import load_file

    from astraflow.models.share import ensure_model, fetch_model, pack_model_files
    from astraflow.trainer.service import TrainerService

    topo, _ = make_topology(topics={"batches.actor": {"partitions": 1},
                                    "weights.actor": {"partitions": 1},
                                    "weights.blobs": {"partitions": 1}})
    (Path(tiny_model) / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    producer = RecordProducer(kafka_config)
    for i in range(3):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)
    svc = TrainerService(topo, service_options(tiny_model, tmp_path / "state", max_steps=3,
                                               anchor_interval=2), config=kafka_config)
    svc.run()
    assert svc.version == 3

    dest = tmp_path / "elsewhere" / "model"
    assert ensure_model(dest, kafka_config, topo, "actor") == dest
    files = sorted(p.name for p in dest.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer_config.json"], files
    assert (dest / "config.json").read_bytes() == (Path(tiny_model) / "config.json").read_bytes()
    fetched = load_file(dest / "model.safetensors")
    published = svc.trainer.published_state()
    assert fetched.keys() == published.keys()
    assert all(torch.equal(fetched[k], published[k]) for k in published)
    assert b"model.safetensors" not in pack_model_files(tiny_model)
    assert ensure_model(dest, kafka_config, topo, "actor") == dest  # there now: kept

    empty, _ = make_topology(topics={"weights.actor": {"partitions": 1}})
    with pytest.raises(Exception, match="no model for policy actor .* after 1s"):
        fetch_model(kafka_config, empty.full_name("weights.actor"), "actor",
                    tmp_path / "never", wait_s=1)
