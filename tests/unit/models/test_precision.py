"""``best`` precision: bf16 exactly where the hardware computes it natively, with the reason;
the trainer's ``autocast: best`` and a policy's ``dtype: best`` follow the choice."""

from __future__ import annotations

import pytest
import torch

from astraflow.config.sections import TrainerSpec
from astraflow.models import precision
from astraflow.models.precision import choose, cpu_flags
from astraflow.trainer.trainer import chosen_autocast


@pytest.mark.parametrize("flags,bf16,why", [
    ({"avx2", "avx512f", "amx_bf16", "amx_tile"}, True, "amx_bf16"),
    ({"avx2", "avx512f", "avx512_bf16"}, True, "avx512_bf16"),
    ({"avx2", "fma"}, False, "emulated"),
    (set(), False, "emulated"),
])
def test_a_cpu_takes_bf16_only_with_native_bf16_instructions(flags, bf16, why):
    p = choose("cpu", flags, None)
    assert p.bf16 is bf16 and why in p.reason


@pytest.mark.parametrize("capability,bf16", [((9, 0), True), ((8, 0), True), ((7, 5), False),
                                             (None, False)])
def test_a_gpu_takes_bf16_from_ampere_on(capability, bf16):
    # the CPU's flags do not matter for a GPU device
    assert choose("cuda:0", {"amx_bf16"}, capability).bf16 is bf16


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: X\nflags\t\t: fpu avx2 amx_bf16\n\n")
    assert cpu_flags(info) == {"fpu", "avx2", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == set()


@pytest.fixture(params=[True, False], ids=["native", "emulated"])
def native(request, monkeypatch) -> bool:
    """This machine's CPU seen with, or without, native bf16."""
    flags = {"avx2", "amx_bf16"} if request.param else {"avx2"}
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    return request.param


def test_trainer_autocast_best_follows_the_cpu(native):
    autocast, why = chosen_autocast(TrainerSpec(autocast="best"))
    assert autocast == ("bf16" if native else "none") and "CPU has" in why
    # megatron's CPU path takes no autocast whatever the CPU
    assert chosen_autocast(TrainerSpec(autocast="best", backend="megatron"))[0] == "none"
    assert chosen_autocast(TrainerSpec(autocast="bf16")) == ("bf16", "as configured")


def test_a_policy_loaded_with_dtype_best_follows_the_cpu(native, tmp_path):
    from astraflow.models.loading import load_policy
    from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer

    tiny_model().save_pretrained(tmp_path)
    tiny_tokenizer().save_pretrained(tmp_path)
    model, _ = load_policy(tmp_path, dtype="best")
    assert next(model.parameters()).dtype == (torch.bfloat16 if native else torch.float32)
