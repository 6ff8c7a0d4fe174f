"""The trainer's state through ``torch.distributed.checkpoint`` (DCP): sharded, resharded
on load.

A checkpoint is a directory DCP writes: the tensors training updates (``Trainer.
trained_state()``: the fp32 masters, or the parameters when there are none, and persistent
buffers), the AdamW state of each (``step``, ``exp_avg``, ``exp_avg_sq``) keyed by the Hugging
Face name of its parameter (not by the optimizer's index), and a little metadata (``meta``:
format, version, steps, world size, dtypes). Under a process group each rank writes only
its own shards; DCP records which rows every file holds, so a state saved by N processes
loads into M (and into a group of one, which saves the same format from one process
without torch.distributed).

``save(..., async_=True)`` returns at once: the state is copied to CPU memory by a stager
thread (pinned memory and a stream of its own on a GPU), and the trainer's next optimizer
step waits until that copy is done (``Trainer.hold_updates``), so the copy overlaps the
next forward/backward; DCP then writes the files in a thread of its own. Its collectives
run on a gloo group of their own (``Group.checkpoint_group()``), apart from training's.
The files are complete when the handle's ``result()`` returns (DCP writes the directory's
``.metadata`` last).
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from astraflow.trainer.trainer import Trainer

FORMAT = "astraflow-trainer-dcp-1"
META_KEYS = ("format", "version", "steps", "world", "dtype", "publish_dtype", "forward_on")


class SaveHandle:
    """A checkpoint being written: ``result()`` / ``wait()`` return once its files are
    complete (raising what the write raised); ``done()`` says whether they are."""

    def __init__(self, directory: Path, future: Future | None = None):
        self.directory = directory
        self._future = future

    def done(self) -> bool:
        return self._future is None or self._future.done()

    def result(self, timeout: float | None = None) -> Path:
        """The checkpoint's directory, once complete."""
        if self._future is not None:
            self._future.result(timeout)
        return self.directory

    wait = result


def _moments(trainer: Trainer) -> dict[str, dict[str, torch.Tensor]]:
    """The AdamW state of each trained parameter by its name; zeros and step 0 where the
    optimizer has not stepped yet (AdamW steps from them as from no state)."""
    by_id = {id(t): k for k, t in trainer.trained_state().items()}
    out: dict[str, dict[str, torch.Tensor]] = {}
    for group in trainer.optimizer.param_groups:
        for p in group["params"]:
            state = trainer.optimizer.state.get(p) or {}
            out[by_id[id(p)]] = {
                "step": state.get("step", torch.tensor(0.0, dtype=torch.float32)),
                "exp_avg": state.get("exp_avg", _zeros(p)),
                "exp_avg_sq": state.get("exp_avg_sq", _zeros(p)),
            }
    return out


def placed(group: dict[str, Any], p: torch.Tensor, key: str, value: torch.Tensor
           ) -> torch.Tensor:
    """``value`` of the AdamW state ``key`` of parameter ``p`` (in param group ``group``)
    placed where the optimizer expects it, as ``Optimizer.load_state_dict`` places a loaded
    state: ``step`` a float32 scalar, on the CPU unless the group is ``capturable`` or
    ``fused`` (whose kernels read it on the device: then on ``p``'s device); every other
    tensor like ``p``: its device, and its dtype when floating."""
    if key == "step":
        on_device = bool(group.get("capturable") or group.get("fused"))
        return value.to(device=p.device if on_device else torch.device("cpu"),
                        dtype=torch.float32)
    if p.is_floating_point():
        return value.to(device=p.device, dtype=p.dtype)
    return value.to(device=p.device)


def _zeros(p: torch.Tensor) -> torch.Tensor:
    return torch.zeros_like(p, memory_format=torch.preserve_format).detach()


def _meta(trainer: Trainer, version: int) -> dict[str, Any]:
    c = trainer.spec
    return {"format": FORMAT, "version": int(version), "steps": int(trainer.steps),
            "world": trainer.group.world,
            "dtype": str(trainer.dtype).removeprefix("torch."),
            "publish_dtype": c.publish_dtype, "forward_on": c.forward_on}


def _dcp_args(trainer: Trainer) -> dict[str, Any]:
    if trainer.group.world == 1:  # nothing to coordinate: DCP without torch.distributed
        _quiet_no_dist()
        return {"no_dist": True}
    return {"process_group": trainer.group.checkpoint_group()}


def _stager(trainer: Trainer) -> Any:
    """The trainer's DCP stager: copies the state to CPU memory in a thread of its own
    (pinned memory and a CUDA stream of its own on a GPU, so the copy overlaps the next
    forward/backward), reused from save to save."""
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

    stager = getattr(trainer, "_dcp_stager", None)
    if stager is None:
        cuda = trainer.device.type == "cuda"
        stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False,
                                              use_async_staging=True,
                                              use_non_blocking_copy=cuda))
        trainer._dcp_stager = stager
    return stager


def _quiet_no_dist() -> None:
    """Silence DCP's notice that it runs without a process group: that is what a trainer
    without a group means. An asynchronous save gives it from DCP's thread, so the filter
    is the process's (set again on each call: a test framework resets the filters)."""
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable "
                            "or uninitialized")


def save(trainer: Trainer, directory: str | Path, *, async_: bool,
         version: int | None = None) -> SaveHandle:
    """Write ``trainer``'s state (see the module docstring) into ``directory`` (created;
    it should be new or empty). Every rank of the trainer's group calls it. ``version``:
    recorded in the metadata (default: the trainer's step count). ``async_``: return once
    the state is copied to CPU memory, the files being written in the background."""
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    state = {"weights": trainer.trained_state(), "optim": _moments(trainer),
             "meta": _meta(trainer, trainer.steps if version is None else version)}
    args = _dcp_args(trainer)
    with torch.no_grad():
        if async_:
            response = dcp.async_save(state, checkpoint_id=str(directory),
                                      async_stager=_stager(trainer), **args)
            future = response.upload_completion
            # the copy to CPU memory runs in the stager's thread: the trained tensors must
            # not change before it is done (the next optimizer step waits for it)
            trainer.hold_updates(response.staging_completion.result)
            return SaveHandle(directory, future)
        dcp.save(state, checkpoint_id=str(directory), **args)
    return SaveHandle(directory)


def read_meta(directory: str | Path) -> dict[str, Any]:
    """The metadata of the checkpoint in ``directory`` (one process reads it; no process
    group involved). ``ValueError`` naming the directory when there is no complete
    checkpoint."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    try:
        keys = set(FileSystemReader(str(directory)).read_metadata().state_dict_metadata)
    except (FileNotFoundError, OSError) as e:
        raise ValueError(f"{directory}: no complete trainer checkpoint ({e})") from None
    if "meta.format" not in keys:
        raise ValueError(f"{directory}: a DCP checkpoint, but not a trainer state (no meta)")
    meta: dict[str, Any] = {"meta": {k: None for k in META_KEYS}}
    _quiet_no_dist()
    dcp.load(meta, checkpoint_id=str(directory), no_dist=True)
    if meta["meta"]["format"] != FORMAT:
        raise ValueError(f"{directory}: checkpoint format {meta['meta']['format']!r}, this "
                         f"trainer reads {FORMAT!r}")
    return meta["meta"]


def load(trainer: Trainer, directory: str | Path) -> dict[str, Any]:
    """Load the state in ``directory`` into ``trainer`` (every rank of its group calls
    it; each reads its own rows, whatever world size saved it): weights in place, the
    published parameters re-rounded, the AdamW state set, the trainer's step count
    restored. Returns the checkpoint's metadata. ``ValueError`` (one line) when the
    checkpoint does not fit the trainer (dtype, names, shapes)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemReader

    directory = Path(directory)
    meta = read_meta(directory)
    dtype = str(trainer.dtype).removeprefix("torch.")
    if meta["dtype"] != dtype:
        raise ValueError(f"{directory}: the trainer state is {meta['dtype']}, the model trains "
                         f"in {dtype}: restart with the --dtype the run was started with")
    saved = FileSystemReader(str(directory)).read_metadata().state_dict_metadata
    weights = trainer.trained_state()
    moments = _moments(trainer)
    for k, v in weights.items():
        md = saved.get(f"weights.{k}")
        if md is None:
            raise ValueError(f"{directory}: no weight {k!r} in the checkpoint")
        if tuple(md.size) != tuple(v.shape):
            raise ValueError(f"{directory}: weight {k} has shape {tuple(md.size)}, the model's "
                             f"is {tuple(v.shape)}")
    state = {"weights": weights, "optim": moments}
    with torch.no_grad():  # into the trained tensors in place
        trainer._before_update()  # a save still copying: it must see the old tensors
        dcp.load(state, checkpoint_id=str(directory), **_dcp_args(trainer))
    name_of = {id(t): k for k, t in weights.items()}
    opt = trainer.optimizer
    for group in opt.param_groups:
        for p in group["params"]:
            # loaded into the tensors _moments made (a fresh optimizer's step is a CPU
            # scalar): placed as the optimizer expects them, e.g. fused AdamW on CUDA reads
            # step on the parameter's device
            opt.state[p] = {k: placed(group, p, k, v)
                            for k, v in state["optim"][name_of[id(p)]].items()}
    trainer.refresh_published()
    trainer.steps = int(meta["steps"])
    return meta


__all__ = ["FORMAT", "SaveHandle", "load", "placed", "read_meta", "save"]
