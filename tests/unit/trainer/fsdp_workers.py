"""What the spawned trainer processes of test_fsdp.py run (module-level functions,
picklable arguments): FSDP2's collectives during a step, and a rank's memory and checks
when it loads and resumes."""

from __future__ import annotations

from typing import Any

import torch

from astraflow.config.sections import TrainerSpec
from astraflow.trainer.trainer import Trainer
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
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
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



def loaded(model_path: str, config: dict, batches: list[tuple]) -> dict[str, Any]:
    """A trainer on the group loaded from ``model_path``: whether it read its rows
    (``load_seconds``), its full weights and non-persistent buffers right after loading,
    and its metrics on ``batches``."""
    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    try:
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        out = {"rows_read": tr.load_seconds > 0, "weights": cpu(tr.state_dict()),
               "buffers": cpu({k: v for k, v in tr.model.named_buffers()})}
        out["metrics"] = steps(tr, batches)
        return out
    finally:
        group.close()


def checks(model_path: str, config: dict, batches: list[tuple]) -> dict[str, Any]:
    """After ``batches`` on the group: ``published_difference`` against the published
    state itself, against it with one element of the last row of a weight changed (a row
    the last rank holds), and without that weight; ``published_dtypes`` beside the
    published state's dtypes."""
    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    try:
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        steps(tr, batches)
        published = tr.published_state()  # gathered: the reference, for the test only
        name = next(k for k, v in published.items() if v.dim() == 2)
        changed = dict(published)
        changed[name] = published[name].clone()
        changed[name][-1, 0] = changed[name][-1, 0] + 1
        missing = {k: v for k, v in published.items() if k != name}
        return {"same": tr.published_difference(published), "name": name,
                "changed": tr.published_difference(changed),
                "missing": tr.published_difference(missing),
                "dtypes": tr.published_dtypes(),
                "want_dtypes": {k: v.dtype for k, v in published.items()}}
    finally:
        group.close()


__all__ = ["checks", "collectives", "cpu", "loaded"]
