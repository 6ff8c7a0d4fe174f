"""FSDP2's communication in the trainer (2 local processes, gloo): bf16 all-gathers and
fp32 reduce-scatters where the trainer computes in bf16, fp32 both where it computes in
fp32, and one reduce-scatter per sharded module a step however many micro-batches it
has."""

from __future__ import annotations

import torch

from astraflow.trainer.parallel import spawn_local
from tests.unit.trainer import fsdp_workers as workers
from tests.unit.trainer.test_parallel import CONFIG, TIMEOUT_S, qwen  # noqa: F401 (fixture)

# 1 sequence a pass: make_batch's batches are several passes on each rank
MICRO = {**CONFIG, "micro_batch_size": 1}
BATCHES = [(0, 3), (1, 3)]


def _calls(result: dict, kind: str) -> list[list[torch.dtype]]:
    return [[dt for k, dt in s["calls"] if k == kind] for s in result["steps"]]


def test_bf16_compute_gathers_bf16_reduces_fp32_once_a_step(qwen):  # noqa: F811
    got = spawn_local(2, workers.collectives, (qwen, {**MICRO, "autocast": "bf16"}, BATCHES),
                      timeout_s=TIMEOUT_S)[0]
    modules = got["fsdp_groups"]  # each decoder layer and the root
    for s, gathers, scatters in zip(got["steps"], _calls(got, "all_gather"),
                                    _calls(got, "reduce_scatter")):
        assert s["metrics"]["trainer/micro_batches"] >= 4  # several passes a rank
        assert gathers and set(gathers) == {torch.bfloat16}
        # the gradients are summed unsharded over the step's passes, then reduced once
        assert scatters == [torch.float32] * modules


def test_fp32_compute_stays_fp32(qwen):  # noqa: F811
    got = spawn_local(2, workers.collectives, (qwen, MICRO, BATCHES[:1]),
                      timeout_s=TIMEOUT_S)[0]
    modules = got["fsdp_groups"]
    assert set(_calls(got, "all_gather")[0]) == {torch.float32}
    assert _calls(got, "reduce_scatter")[0] == [torch.float32] * modules
