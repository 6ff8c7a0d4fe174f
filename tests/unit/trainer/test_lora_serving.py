"""A LoRA policy served as trained: early in training (one small step) the adapter moves
the trainer's log-probs by more than the tolerance of full fine-tuning (1e-5, the engine
against the trainer on published weights in test_trainer.py) while moving each weight by
far less than one bf16 step. The torch engine, configured in bf16, still serves the
trainer's log-probs within that tolerance (the adapter at forward time on an fp32 model);
vLLM's merge mode keeps the merged weights in fp32, which serve them too, where the merged
weights rounded to bf16 serve close to the base model."""

from __future__ import annotations

import pytest
import torch

from astraflow.config.lora import LoraSpec
from astraflow.config.sections import TrainerSpec
from astraflow.models import lora
from astraflow.trainer.trainer import Trainer

SETTINGS = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": ["q_proj", "v_proj"]}
TOL = 1e-5  # full fine-tuning's: test_trainer.py, the engine against the trainer
PROMPTS = [[5, 9, 14, 3, 22], [7, 30, 2], [11, 12, 13, 40]]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The tiny Llama (with a tokenizer, stored fp32) and a LoRA trainer one step in at a
    small learning rate: its published adapter is version 1."""
    from astraflow.models.tiny import init_model
    from tests.unit.trainer.test_trainer import make_batch

    path = str(init_model(tmp_path_factory.mktemp("tiny-llama")))
    torch.set_num_threads(1)
    tr = Trainer(path, TrainerSpec(lr=1e-5), "actor", lora=LoraSpec(**SETTINGS))
    tr.train_step(make_batch(0))
    return path, tr, tr.published_state()


def _trainer_logprobs(tr: Trainer, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return tr.token_logprobs(ids, torch.ones_like(ids))[:, 1:]


def _model_logprobs(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits.float()
    return torch.log_softmax(logits, -1)[:, :-1].gather(-1, ids[:, 1:, None])[..., 0]


def _ids() -> torch.Tensor:
    width = max(len(p) for p in PROMPTS)
    return torch.tensor([p + [p[-1]] * (width - len(p)) for p in PROMPTS])


def test_the_adapter_moves_the_policy_beyond_the_tolerance_but_below_a_bf16_step(trained):
    from transformers import AutoModelForCausalLM

    path, tr, adapter = trained
    base = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    ids = _ids()
    assert float((_trainer_logprobs(tr, ids) - _model_logprobs(base, ids)).abs().max()) > TOL
    s = LoraSpec(**SETTINGS)
    sd = base.state_dict()
    for name, w in lora.merged(sd, adapter, s).items():
        step = sd[name].abs() * 2.0 ** -8  # about one bf16 step of each weight
        # the typical weight moves by less than half a step: rounded to bf16, it stays
        assert float((w - sd[name]).abs().median()) < float(step.median()) / 2, name


def test_the_torch_engine_serves_the_trained_adapter_when_configured_bf16(trained):
    from astraflow.raas.engine import SamplingParams, load_torch_engine

    path, tr, adapter = trained
    engine = load_torch_engine(path, "actor", dtype="bfloat16", prefix_cache_bytes=0,
                               lora=SETTINGS)
    assert {p.dtype for p in engine.model.parameters()} == {torch.float32}
    engine.load_state_dict(adapter, 1)
    gens = engine.generate(PROMPTS, SamplingParams(max_new_tokens=6, temperature=1.0,
                                                   n=2, seed=0))
    worst = 0.0
    for per_prompt in gens:
        for g in per_prompt:
            ids = torch.tensor([g.prompt_ids + g.token_ids])
            mine = _trainer_logprobs(tr, ids)[0, len(g.prompt_ids) - 1:]
            worst = max(worst, float((mine - torch.tensor(g.logprobs)).abs().max()))
    assert worst < TOL


def test_merged_weights_kept_in_fp32_serve_the_trained_adapter(trained):
    """vLLM's merge mode, without vLLM: the base read from its files (here as a bf16
    checkpoint would give it, and fp32), the adapter merged, the model loaded with the
    result and run in fp32 (the dtype the engine then serves in)."""
    from transformers import AutoModelForCausalLM

    path, tr, adapter = trained
    s = LoraSpec(**SETTINGS)
    ids = _ids()
    want = _trainer_logprobs(tr, ids)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True).eval()
    base = {k: v.clone() for k, v in model.state_dict().items()}
    kept = lora.merged(base, adapter, s, dtype=torch.float32)
    model.load_state_dict({**base, **kept})
    assert float((_model_logprobs(model, ids) - want).abs().max()) < TOL
    as_bf16 = {k: v.to(torch.bfloat16) for k, v in base.items()}
    rounded = lora.merged(as_bf16, adapter, s)  # W's dtype: the rounding this avoids
    assert {v.dtype for v in rounded.values()} == {torch.bfloat16}
    model.load_state_dict({**base, **{k: v.float() for k, v in rounded.items()}})
    assert float((_model_logprobs(model, ids) - want).abs().max()) > TOL


def test_serving_dtype_is_fp32_and_says_why_it_overrides():
    assert lora.serving_dtype("float32") == ("float32", None)
    assert lora.serving_dtype("fp32") == ("float32", None)
    for asked in ("bfloat16", "float16", "auto", None):
        dtype, why = lora.serving_dtype(asked)
        assert dtype == "float32" and why is not None and "fp32" in why
