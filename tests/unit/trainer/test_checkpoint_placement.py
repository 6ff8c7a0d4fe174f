"""A trainer state loaded through DCP (``trainer.checkpoint``) places every AdamW state
tensor as the optimizer expects it (torch's rule, what ``Optimizer.load_state_dict``
does): ``step`` float32 on the CPU, or on the parameter's device for a capturable or fused
group; ``exp_avg``/``exp_avg_sq`` with the parameter's device and dtype."""

from __future__ import annotations

import pytest
import torch

from tests.unit.trainer import test_trainer
from tests.unit.trainer.test_trainer import make_batch

tiny_model = test_trainer.tiny_model  # the fixture: a tiny random Qwen2


def expected(group: dict, p: torch.Tensor, key: str) -> tuple[torch.device, torch.dtype]:
    """torch's placement rule, written out on its own."""
    if key == "step":
        fused = group.get("fused") or group.get("capturable")
        return (p.device if fused else torch.device("cpu")), torch.float32
    return p.device, p.dtype


@pytest.mark.parametrize("flags", [{}, {"fused": True}, {"capturable": True},
                                   {"foreach": True}])
def test_placed_follows_torchs_rule(flags):
    """On a parameter of another device (meta) and dtype (bf16), from CPU float64 values:
    step goes to the device only for a fused or capturable group, always float32; the
    moments take the parameter's device and dtype."""
    from astraflow.trainer.checkpoint import placed

    p = torch.nn.Parameter(torch.empty(3, 2, dtype=torch.bfloat16, device="meta"))
    group = {"params": [p], **flags}
    for key, value in [("step", torch.tensor(7.0, dtype=torch.float64)),
                       ("exp_avg", torch.ones(3, 2, dtype=torch.float64)),
                       ("exp_avg_sq", torch.ones(3, 2, dtype=torch.float64))]:
        got = placed(group, p, key, value)
        assert (got.device, got.dtype) == expected(group, p, key), (key, flags)
    step = placed(group, p, "step", torch.tensor(7.0, dtype=torch.float64))
    if step.device.type == "cpu":
        assert float(step) == 7.0


def _resumed_step(tiny_model, tmp_path, device: str, adam_impl: str):
    """A trainer trains 2 batches, saves through DCP, trains a third; a fresh trainer
    loads the save and trains the third: the fresh one's state placement before that
    step, both results."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer import checkpoint
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    cfg = TrainerSpec(lr=1e-3, micro_batch_size=3, device=device, adam_impl=adam_impl)
    a = Trainer(tiny_model, cfg, policy="actor")
    for i in range(2):
        a.train_step(make_batch(i))
    checkpoint.save(a, tmp_path / "ckpt", async_=False)
    a.train_step(make_batch(2))
    b = Trainer(tiny_model, cfg, policy="actor")
    checkpoint.load(b, tmp_path / "ckpt")
    placement = [(group, p, k, v) for group in b.optimizer.param_groups
                 for p in group["params"] for k, v in b.optimizer.state[p].items()]
    b.train_step(make_batch(2))
    return placement, a, b


@pytest.mark.parametrize("adam_impl", ["fused", "for-loop"])
def test_a_dcp_resume_places_the_optimizer_state_and_steps_on(tiny_model, tmp_path,
                                                              adam_impl):
    """On the CPU: after a load every state tensor follows the rule, and the next step
    equals the uninterrupted trainer's bit for bit."""
    from astraflow.weights.bits import state_bytes_equal

    placement, a, b = _resumed_step(tiny_model, tmp_path, "cpu", adam_impl)
    assert placement
    for group, p, k, v in placement:
        assert (v.device, v.dtype) == expected(group, p, k), k
    assert state_bytes_equal(a.state_dict(), b.state_dict())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (fused AdamW on a GPU "
                    "reads step on the parameter's device)")
def test_fused_adamw_on_cuda_steps_after_a_dcp_resume(tiny_model, tmp_path):
    """Fused AdamW on CUDA after a DCP resume: step is on the GPU, and the next step
    runs and equals the uninterrupted trainer's."""
    from astraflow.weights.bits import state_bytes_equal

    placement, a, b = _resumed_step(tiny_model, tmp_path, "cuda", "fused")
    steps = [v for _, _, k, v in placement if k == "step"]
    assert steps and all(v.device.type == "cuda" and v.dtype == torch.float32 for v in steps)
    assert state_bytes_equal(a.state_dict(), b.state_dict())
