"""FSDP2 in the trainer (2 local processes, gloo). Communication: bf16 all-gathers and
fp32 reduce-scatters where the trainer computes in bf16, fp32 both where it computes in
fp32, and one reduce-scatter per sharded module a step however many micro-batches it
has. Memory: each rank reads its own rows of the model directory, and checks the
published weights on its own rows."""

from __future__ import annotations

import pytest
import torch

from astraflow.config.sections import TrainerSpec
from astraflow.trainer.parallel import spawn_local
from astraflow.trainer.trainer import Trainer
from tests.unit.trainer import fsdp_workers as workers
from tests.unit.trainer.test_parallel import (  # noqa: F401 (fixtures)
    CONFIG,
    TIMEOUT_S,
    qwen,
    tied_llama,
)
from tests.unit.trainer.test_trainer import make_batch

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


def test_each_rank_reads_its_rows_and_loads_what_one_process_loads(tied_llama):  # noqa: F811
    """A model directory under a group: built on the meta device, each rank reading its rows
    from the safetensors file; the weights (the tied output layer included) and the
    rotary buffers are bit for bit those of a one-process load, and the step trains as one
    process does."""
    got = spawn_local(2, workers.loaded, (tied_llama, CONFIG, [(0,)]), timeout_s=TIMEOUT_S)
    torch.set_num_threads(1)
    one = Trainer(tied_llama, TrainerSpec(**CONFIG), policy="actor")
    want = {k: v.clone() for k, v in one.state_dict().items()}  # the step writes in place
    buffers = {k: v.clone() for k, v in one.model.named_buffers()}
    metrics = one.train_step(make_batch(0), 0)
    for rank in got:
        assert rank["rows_read"]
        assert rank["weights"].keys() == want.keys()
        for k, v in want.items():
            assert torch.equal(rank["weights"][k], v), k
        assert rank["buffers"].keys() == buffers.keys()
        for k, v in buffers.items():
            assert torch.equal(rank["buffers"][k], v), k
        assert rank["metrics"][0]["trainer/loss"] == pytest.approx(
            metrics["trainer/loss"], rel=1e-4, abs=1e-6)


def test_the_published_checks_run_on_each_ranks_rows(qwen):  # noqa: F811
    """The resume's checks (published dtypes, equality with the published weights) under
    a group, each rank on its own rows: equal when equal; a change in a row only the last
    rank holds, or a missing tensor, is named on every rank."""
    got = spawn_local(2, workers.checks, (qwen, CONFIG, [(0,)]), timeout_s=TIMEOUT_S)
    for rank in got:
        assert rank["same"] is None
        assert rank["changed"] == rank["name"] and rank["missing"] == rank["name"]
        assert rank["dtypes"] == rank["want_dtypes"]
        assert set(rank["dtypes"].values()) == {torch.bfloat16}


def test_the_published_checks_without_a_group(qwen):  # noqa: F811
    tr = Trainer(qwen, TrainerSpec(**CONFIG), policy="actor")
    published = tr.published_state()
    assert tr.published_difference(published) is None
    assert tr.published_dtypes() == {k: v.dtype for k, v in published.items()}
    name = next(iter(published))
    bad = {**published, name: published[name].clone().float()}
    assert tr.published_difference(bad) == name
