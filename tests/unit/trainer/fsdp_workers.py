"""What the spawned trainer processes of test_fsdp.py run (module-level functions,
picklable arguments): FSDP2's collectives during a step, and a rank's memory and checks
when it loads and resumes."""

from __future__ import annotations

from typing import Any

import torch

from astraflow.trainer.trainer import Trainer, TrainerConfig
from tests.unit.trainer.parallel_workers import cpu, steps


def collectives(model_path: str, config: dict, batches: list[tuple]) -> dict[str, Any]:
    """Train ``batches`` on the group, recording the dtype of the input of every FSDP2
    all-gather and reduce-scatter during each step (rank 0's result is what the parent
    reads)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as fc

    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    seen: list[tuple[str, torch.dtype]] = []
    gather, scatter = fc.DefaultAllGather.__call__, fc.DefaultReduceScatter.__call__

    def all_gather(self, output_tensor, input_tensor, *args, **kwargs):
        seen.append(("all_gather", input_tensor.dtype))
        return gather(self, output_tensor, input_tensor, *args, **kwargs)

    def reduce_scatter(self, output_tensor, input_tensor, *args, **kwargs):
        seen.append(("reduce_scatter", input_tensor.dtype))
        return scatter(self, output_tensor, input_tensor, *args, **kwargs)

    fc.DefaultAllGather.__call__ = all_gather
    fc.DefaultReduceScatter.__call__ = reduce_scatter
    try:
        tr = Trainer(model_path, TrainerConfig(**config), policy="actor", group=group)
        per_step = []
        for b in batches:
            seen.clear()
            metrics = steps(tr, [b])[0]
            per_step.append({"metrics": metrics, "calls": list(seen)})
        return {"steps": per_step, "fsdp_groups": sum(
            1 for m in tr.model.modules() if type(m).__name__.startswith("FSDP"))}
    finally:
        fc.DefaultAllGather.__call__, fc.DefaultReduceScatter.__call__ = gather, scatter
        group.close()


__all__ = ["collectives", "cpu"]
