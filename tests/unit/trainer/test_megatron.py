"""The megatron-core trainer backend on a CPU: the HF Llama <-> megatron mapping (logits
parity, bit-exact round trip), the errors that name a fix, and one training step under
both backends. Skipped, naming the fix, when megatron-core is not installed (or, on this
CPU, is not the pinned release)."""

from __future__ import annotations

import sys
import time

import pytest
import torch

from astraflow.trainer.megatron_shims import PINNED_VERSION, MegatronUnavailable, check_megatron

try:
    check_megatron(cpu=True)
except MegatronUnavailable as _e:
    pytest.skip(str(_e), allow_module_level=True)

LOGITS_ATOL = 1e-4  # fp32 logits, HF vs megatron (measured: ~2e-7)


def _llama_config(**kw):
    from transformers import LlamaConfig

    base = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                tie_word_embeddings=True, rms_norm_eps=1e-5,
                rope_parameters={"rope_type": "default", "rope_theta": 5000.0})
    base.update(kw)
    return LlamaConfig(**base)


def _hf_and_megatron(cfg, seed: int = 0):
    from transformers import LlamaForCausalLM

    from astraflow.trainer import megatron_model as mm

    torch.manual_seed(seed)
    hf = LlamaForCausalLM(cfg).eval()
    mg = mm.build_model(cfg)
    mm.load_hf_state(mg, hf.state_dict(), cfg)
    return hf, mg.eval()


@pytest.fixture(autouse=True)
def _one_thread():
    old = torch.get_num_threads()
    torch.set_num_threads(1)  # the box is shared
    yield
    torch.set_num_threads(old)


@pytest.mark.parametrize("tied", [True, False])
def test_logits_parity_random_llama(tied):
    from astraflow.trainer import megatron_model as mm

    cfg = _llama_config(tie_word_embeddings=tied)
    hf, mg = _hf_and_megatron(cfg)
    ids = torch.randint(0, cfg.vocab_size, (3, 17), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = mm.logits(mg, ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < LOGITS_ATOL
    with torch.no_grad():  # only the last columns through the output layer
        tail = mm.logits(mg, ids, start=12)
    assert tail.shape == (3, 5, cfg.vocab_size)
    assert (tail - want[:, 12:]).abs().max().item() < LOGITS_ATOL


def test_round_trip_bit_exact():
    from transformers import LlamaForCausalLM

    from astraflow.trainer import megatron_model as mm

    for tied in (True, False):
        cfg = _llama_config(tie_word_embeddings=tied, num_key_value_heads=1)
        torch.manual_seed(3)
        hf_state = LlamaForCausalLM(cfg).state_dict()
        back = mm.megatron_to_hf(mm.hf_to_megatron(hf_state, cfg), cfg)
        assert list(back) == list(hf_state)  # the same names, in transformers' order
        for k, v in hf_state.items():
            assert back[k].shape == v.shape and back[k].dtype == v.dtype
            assert torch.equal(back[k].view(torch.int32), v.view(torch.int32)), k


def test_round_trip_through_the_model_bf16():
    from transformers import LlamaForCausalLM

    from astraflow.trainer import megatron_model as mm

    cfg = _llama_config()
    torch.manual_seed(4)
    hf_state = LlamaForCausalLM(cfg).to(torch.bfloat16).state_dict()
    mg = mm.build_model(cfg, dtype=torch.bfloat16)
    mm.load_hf_state(mg, hf_state, cfg)
    back = mm.megatron_to_hf(mm.weight_state(mg), cfg)
    assert all(torch.equal(back[k].view(torch.int16), v.view(torch.int16))
               for k, v in hf_state.items())


def test_unsupported_architecture_names_the_fix():
    from transformers import Qwen2Config

    from astraflow.trainer.megatron_model import UnsupportedArchitecture, check_supported

    with pytest.raises(UnsupportedArchitecture, match="trainer.backend: torch"):
        check_supported(Qwen2Config(hidden_size=64, num_attention_heads=4))
    with pytest.raises(UnsupportedArchitecture, match="attention_bias"):
        check_supported(_llama_config(attention_bias=True))
    with pytest.raises(UnsupportedArchitecture, match="RoPE type 'llama3'"):
        check_supported(_llama_config(rope_parameters={
            "rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))


def test_missing_or_wrong_megatron_and_old_python_name_the_fix(monkeypatch):
    from astraflow.trainer import megatron_shims as ms

    monkeypatch.setattr(ms, "installed_version", lambda: None)
    with pytest.raises(ms.MegatronUnavailable, match=r"not installed; pip install"):
        ms.check_megatron()
    monkeypatch.setattr(ms, "installed_version", lambda: "0.99.0")
    with pytest.raises(ms.MegatronUnavailable, match=f"megatron-core=={PINNED_VERSION}"):
        ms.check_megatron(cpu=True)
    assert ms.check_megatron(cpu=False) == "0.99.0"  # no shims on a GPU
    monkeypatch.setattr(ms, "MIN_PYTHON", (sys.version_info.major, sys.version_info.minor + 1))
    with pytest.raises(ms.MegatronUnavailable, match="needs Python >="):
        ms.check_megatron()


def test_cpu_rng_tracker_forks_the_cpu_generator():
    from astraflow.trainer.megatron_shims import CpuRNGStatesTracker

    tr = CpuRNGStatesTracker()
    tr.add("a", 7)
    before = torch.get_rng_state()
    with tr.fork("a"):
        x = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)  # the default stream is untouched
    assert torch.equal(x, torch.rand(3, generator=torch.Generator().manual_seed(7)))
    with pytest.raises(ValueError):
        tr.add("b", 7)


@pytest.mark.slow
def test_logits_parity_smollm2(smollm2_dir):
    from transformers import AutoConfig, AutoModelForCausalLM

    from astraflow.trainer import megatron_model as mm

    t0 = time.perf_counter()
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    hf = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    mg = mm.build_model(cfg)
    mm.load_hf_state(mg, hf.state_dict(), cfg)
    ids = torch.randint(0, cfg.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        diff = (mm.logits(mg.eval(), ids) - hf(input_ids=ids).logits).abs().max().item()
    assert diff < LOGITS_ATOL, diff
    back = mm.megatron_to_hf(mm.weight_state(mg), cfg)
    assert all(torch.equal(back[k], v) for k, v in hf.state_dict().items())
    print(f"smollm2 parity {diff:.2e} in {time.perf_counter() - t0:.1f}s")


# --------------------------------------------------------------------------- the trainer
# One step on the same batch under both backends (fp32 masters, lr 1e-3). The loss and
# gradient norm agree to float rounding (measured: 1e-7 relative). AdamW's first step is
# lr * g / (|g| + eps), so an element whose gradient is near eps moves by a visible part
# of lr on a float-rounding difference of g: measured, 99.9% of the elements' updates
# agree within 4e-6 * lr and the worst one within 1.3% of lr (3 of 82k elements differ by
# more than 1e-3 * lr). Stated tolerances: loss and gradient norm 1e-5 relative; 99.9% of
# the updates within 1e-3 * lr; every update within 5% of lr.
STEP_LR = 1e-3
STEP_RTOL = 1e-5
UPDATE_BULK_ATOL = 1e-3 * STEP_LR
UPDATE_MAX_ATOL = 0.05 * STEP_LR


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory) -> str:
    from transformers import LlamaForCausalLM

    cfg = _llama_config(vocab_size=64, max_position_embeddings=128)
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama")
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def _trainer(path: str, backend: str, **kw):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    cfg = TrainerSpec(lr=STEP_LR, micro_batch_size=3, backend=backend, **kw)
    return Trainer(path, cfg, policy="actor")


@pytest.mark.parametrize("forward_on", ["published", "master"])
def test_one_step_same_loss_and_updates_under_both_backends(llama_dir, forward_on):
    from tests.unit.trainer.test_trainer import make_batch

    batch = make_batch(1)
    out = {}
    for backend in ("torch", "megatron"):
        tr = _trainer(llama_dir, backend, forward_on=forward_on)
        before = {k: v.clone() for k, v in tr.state_dict().items()}
        metrics = tr.train_step(batch)
        after = tr.state_dict()
        out[backend] = (metrics, {k: after[k] - before[k] for k in before},
                        tr.published_state())
    (mt, dt, pt), (mm, dm, pm) = out["torch"], out["megatron"]
    assert mt["trainer/loss_tokens"] == mm["trainer/loss_tokens"] > 0
    assert mm["trainer/loss"] == pytest.approx(mt["trainer/loss"], rel=STEP_RTOL)
    assert mm["trainer/grad_norm"] == pytest.approx(mt["trainer/grad_norm"], rel=STEP_RTOL)
    assert list(pm) == list(pt)  # the published state: HF names, order, shapes, dtypes
    assert all(pm[k].shape == pt[k].shape and pm[k].dtype == pt[k].dtype for k in pt)
    diff = torch.cat([(dt[k] - dm[k]).abs().flatten() for k in dt])
    assert float(torch.quantile(diff, 0.999)) <= UPDATE_BULK_ATOL
    assert float(diff.max()) <= UPDATE_MAX_ATOL
    assert max(float(d.abs().max()) for d in dm.values()) > 0.5 * STEP_LR  # it moved


def test_megatron_trainer_from_a_transformers_model(llama_dir):
    from transformers import LlamaForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.backend import MegatronPolicy
    from astraflow.trainer.trainer import Trainer

    hf = LlamaForCausalLM.from_pretrained(llama_dir)
    tr = Trainer("", TrainerSpec(backend="megatron", publish_dtype="same"), model=hf)
    assert isinstance(tr.backend, MegatronPolicy)
    assert all(torch.equal(tr.state_dict()[k], v) for k, v in hf.state_dict().items())


def test_megatron_gradient_checkpointing_recomputes_layers_same_step(llama_dir):
    from tests.unit.trainer.test_trainer import make_batch

    batch = make_batch(2)
    plain, ckpt = _trainer(llama_dir, "megatron"), _trainer(
        llama_dir, "megatron", gradient_checkpointing=True)
    calls: list[str] = []
    for tr, name in ((plain, "plain"), (ckpt, "ckpt")):
        tr.model.decoder.layers[0].mlp.register_forward_pre_hook(
            lambda *a, n=name: calls.append(n))
    saved = {}
    for tr, name in ((plain, "plain"), (ckpt, "ckpt")):
        count = [0]
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t, c=count: (c.__setitem__(0, c[0] + t.numel()), t)[1], lambda t: t):
            saved[name] = (tr.train_step(batch), count[0])
    (mp, sp), (mc, sc) = saved["plain"], saved["ckpt"]
    assert calls.count("ckpt") == 2 * calls.count("plain") > 0  # recomputed in backward
    assert sc < sp / 2, (sc, sp)  # the layers' activations are not kept
    assert mc["trainer/loss"] == mp["trainer/loss"]
    assert mc["trainer/grad_norm"] == pytest.approx(mp["trainer/grad_norm"], rel=1e-6)
    a, b = plain.state_dict(), ckpt.state_dict()
    assert max(float((a[k] - b[k]).abs().max()) for k in a) <= 1e-3 * STEP_LR


def test_megatron_trains_bf16_weights_on_cpu(llama_dir):
    """``dtype="bf16"`` (weights, gradients and optimizer in bf16, megatron's
    ``bf16`` config) runs on a CPU, where autocast does not: the loss is the torch
    backend's within bf16 precision (measured 6e-4 relative)."""
    from tests.unit.trainer.test_trainer import make_batch

    batch = make_batch(1)
    losses, published = {}, {}
    for backend in ("torch", "megatron"):
        tr = _trainer(llama_dir, backend, dtype="bf16")
        losses[backend] = tr.train_step(batch)["trainer/loss"]
        published[backend] = tr.published_state()
    assert losses["megatron"] == pytest.approx(losses["torch"], rel=1e-2)
    assert {k: (v.shape, v.dtype) for k, v in published["megatron"].items()} == {
        k: (v.shape, v.dtype) for k, v in published["torch"].items()}


def test_megatron_trainer_resumes_bit_exactly(llama_dir):
    from astraflow.weights.bits import state_bytes_equal
    from tests.unit.trainer.test_trainer import make_batch

    a = _trainer(llama_dir, "megatron")
    a.train_step(make_batch(1))
    master, optim = a.master_bytes(), a.optimizer_bytes()
    a.train_step(make_batch(2))
    b = _trainer(llama_dir, "megatron")
    b.load_master_bytes(master)
    b.load_optimizer_bytes(optim)
    b.train_step(make_batch(2))
    assert state_bytes_equal(a.published_state(), b.published_state())
    assert state_bytes_equal(a.state_dict(), b.state_dict())


def test_megatron_trainer_loads_published_weights(llama_dir):
    from transformers import LlamaForCausalLM

    from tests.unit.trainer.test_trainer import make_batch

    tr = _trainer(llama_dir, "megatron")
    tr.train_step(make_batch(3))
    published = tr.published_state()
    # the torch engines apply it unchanged: a transformers model loads it strictly
    hf = LlamaForCausalLM.from_pretrained(llama_dir)
    hf.load_state_dict({k: v.float() for k, v in published.items()}, strict=True)
    other = _trainer(llama_dir, "megatron")
    other.load_weights({k: v.float() for k, v in published.items()})
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with torch.no_grad():
        want = hf(input_ids=ids).logits
        got = other.backend.logits(ids, torch.ones_like(ids), 0)
    assert (got - want).abs().max().item() < LOGITS_ATOL


def test_megatron_backend_errors_at_start(llama_dir, tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.backend import preflight
    from astraflow.trainer.megatron_model import UnsupportedArchitecture

    preflight("megatron", llama_dir)  # fine
    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32)
                     ).save_pretrained(tmp_path)
    with pytest.raises(UnsupportedArchitecture, match="model_type 'qwen2'"):
        preflight("megatron", str(tmp_path))
    with pytest.raises(ValueError, match="backend"):
        TrainerSpec(backend="jax")
    with pytest.raises(ValueError, match="autocast: bf16 with backend megatron needs a GPU"):
        TrainerSpec(backend="megatron", autocast="bf16")
    TrainerSpec(backend="megatron", autocast="bf16", device="cuda")


# --------------------------------------------------------------------------- astraflow up
def test_trainer_run_refuses_an_unsupported_model_before_kafka(tmp_path, capsys):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from astraflow.cli.main import main
    from tests.conftest import REPO

    Qwen2ForCausalLM(Qwen2Config(vocab_size=32, hidden_size=16, num_hidden_layers=1,
                                 num_attention_heads=2, intermediate_size=32)
                     ).save_pretrained(tmp_path)
    capsys.readouterr()  # the save's progress bar
    rc = main(["trainer", "run", "--topology", str(REPO / "topology" / "default.yaml"),
               "--policy", "actor", "--model", str(tmp_path), "--backend", "megatron"])
    err = capsys.readouterr().err
    assert rc == 2 and "model_type 'qwen2'" in err and "trainer.backend: torch" in err
    assert len(err.strip().splitlines()) == 1, err


def test_up_refuses_a_missing_megatron_before_starting_anything(monkeypatch, tmp_path):
    import yaml

    from astraflow.config.topology import parse_topology
    from astraflow.launch import up as launcher
    from astraflow.trainer import megatron_shims
    from tests.conftest import REPO

    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data["policies"]["actor"]["model"] = str(tmp_path / "model")  # not written yet
    data["policies"]["actor"]["trainer"]["backend"] = "megatron"
    topo = parse_topology(data)
    assert launcher.trainer_backend_problem(topo) is None
    monkeypatch.setattr(megatron_shims, "installed_version", lambda: None)
    problem = launcher.trainer_backend_problem(topo)
    assert problem and problem.startswith("policy actor: ") and "pip install" in problem
