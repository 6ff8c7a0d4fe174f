"""The trainer without a broker: loss maths and a step on a tiny model (its exact resume after
SIGKILL on Kafka: ``tests/integration/trainer/test_trainer.py``)."""

from __future__ import annotations

import dataclasses
import math
import random
import subprocess
import sys

import pytest
import torch

from astraflow.trainer.loss import group_advantages, policy_loss
from astraflow.trainer.trainer import _Row
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup
from tests.conftest import REPO

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
