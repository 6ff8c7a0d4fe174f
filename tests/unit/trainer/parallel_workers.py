"""What the spawned trainer processes of test_parallel.py run (importable by a spawned
child: module-level functions, picklable arguments). Each joins the gloo group from the
environment ``spawn_local`` sets, trains on test_trainer.py's batches, and returns CPU
tensors and metrics."""

from __future__ import annotations

from typing import Any

import torch

from astraflow.config.sections import TrainerSpec
from astraflow.trainer.trainer import Trainer
from astraflow.wire.records import Batch
from tests.unit.trainer.test_trainer import make_batch


def cpu(tree: Any) -> Any:
    """``tree`` with every tensor a CPU copy (what goes back to the parent)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().to("cpu", copy=True)
    if isinstance(tree, dict):
        return {k: cpu(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(cpu(v) for v in tree)
    return tree


def full_state(tr: Trainer) -> dict[str, Any]:
    """The trained tensors and AdamW state by name, as full tensors (gathered under a
    group: every rank must call it)."""
    from torch.distributed.tensor import DTensor

    def full(t: torch.Tensor) -> torch.Tensor:
        return t.full_tensor() if isinstance(t, DTensor) else t

    names = {id(t): k for k, t in tr.trained_state().items()}
    optim = {}
    for p, state in tr.optimizer.state.items():
        optim[names[id(p)]] = {k: full(v) for k, v in state.items()}
    return cpu({"weights": tr.state_dict(), "optim": optim, "steps": tr.steps})


def steps(tr: Trainer, batches: list[tuple | Batch]) -> list[dict[str, float]]:
    """``train_step`` on each of ``batches``: a ``Batch``, or ``make_batch``'s arguments
    (the first, the batch's index, is the current version)."""
    return [tr.train_step(b) if isinstance(b, Batch) else tr.train_step(make_batch(*b), b[0])
            for b in batches]


def run(model_path: str, config: dict, batches: list[tuple], group: Any = None,
        load: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
    """A fresh trainer (on ``group``, or alone), given the weights ``load`` (full tensors)
    if any, trained on ``batches``: its metrics, full state, published state and published
    part."""
    tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
    if load is not None:
        tr.load_weights(load)
    metrics = steps(tr, batches)
    part, rows = tr.published_part()
    return {"metrics": metrics, "state": full_state(tr), "published": cpu(tr.published_state()),
            "part": cpu(part), "rows": rows}


def train(model_path: str, runs: list[tuple]) -> list[dict[str, Any]]:
    """``run`` of each ``(config, batches[, load])`` of ``runs`` on the group, one after
    the other."""
    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    try:
        return [run(model_path, *r[:2], group, *r[2:]) for r in runs]
    finally:
        group.close()


def checkpoints(model_path: str, config: dict, batches: list[tuple], save_after: int,
                save_dir: str | None, load_dir: str | None) -> dict[str, Any]:
    """Train on ``batches`` and, after ``save_after`` of them, save the state
    asynchronously into ``save_dir`` (the rest is trained while it is written). Then load
    ``load_dir`` into the same trainer and train the batches after ``save_after`` again.
    Full states and metrics along the way."""
    from astraflow.trainer import checkpoint
    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    out: dict[str, Any] = {"rank": group.rank}
    try:
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        out["metrics"] = steps(tr, batches[:save_after])
        out["saved"] = full_state(tr)
        handle = None
        if save_dir is not None:
            handle = checkpoint.save(tr, save_dir, async_=True)
        out["metrics"] += steps(tr, batches[save_after:])
        out["end"] = full_state(tr)
        if handle is not None:
            handle.result()
        group.barrier()  # every rank's files are written before anyone reads
        if load_dir is not None:
            out["meta"] = checkpoint.load(tr, load_dir)
            out["loaded"] = full_state(tr)
            out["resumed_metrics"] = steps(tr, batches[save_after:])
            out["resumed"] = full_state(tr)
    finally:
        group.close()
    return out


def parts(model_path: str, config: dict, batches: list[tuple]) -> dict[str, Any]:
    """A rank's published part after ``batches``, checked and loaded as a part: what a
    resuming rank that follows its own rows does. Whether ``published_difference`` finds
    the part equal and a changed copy different (the ranks agree), and the part a fresh
    trainer publishes after loading it."""
    from astraflow.trainer.parallel import join

    torch.set_num_threads(1)
    group = join("cpu")
    try:
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        steps(tr, batches)
        part = {k: v.clone() for k, v in tr.published_part()[0].items()}
        out: dict[str, Any] = {"fully_sharded": tr.fully_sharded,
                               "same": tr.published_difference(part, part=True)}
        changed = dict(part)
        if group.rank == 1:  # only rank 1's copy differs: rank 0 must agree all the same
            name = sorted(changed)[-1]
            changed[name] = changed[name].clone()
            changed[name].view(-1)[0] += 1
        out["changed"] = tr.published_difference(changed, part=True)
        fresh = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        fresh.load_weights(part, part=True)
        out["reloaded_same"] = fresh.published_difference(part, part=True)
        out["part"], out["reloaded"] = cpu(part), cpu(fresh.published_part()[0])
    finally:
        group.close()
    return out


def regrouped(store_dir: str, manifests: list, count: int, upto: int) -> dict[str, Any]:
    """A rank's ``RegroupedFollower`` over versions of ``count`` parts in the file store
    at ``store_dir``: its rows at each version ``0..upto`` (or why it could not reach
    one), and the blobs it fetched."""
    from astraflow.trainer.parallel import join
    from astraflow.trainer.regroup import RegroupedFollower
    from astraflow.weights.errors import NoPlanError
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores import StoreResolver
    from astraflow.weights.stores.filesystem import FileBlobStore

    torch.set_num_threads(1)
    group = join("cpu")
    store = FileBlobStore(store_dir)
    opened: list[str] = []

    def follower(part: tuple[int, int]) -> WeightFollower:
        f = WeightFollower(stores=[store], inplace=False, threads=1, part=part)
        real = f.resolver.open
        f.resolver.open = lambda ref: (opened.append(ref.uri), real(ref))[1]
        f.observe(manifests)
        return f

    out: dict[str, Any] = {"states": [], "error": None}
    f = RegroupedFollower(group, count, manifests, follower, StoreResolver([store]))
    try:
        out["parts"] = f.parts
        for v in range(upto + 1):
            f.update(v)
            out["states"].append(cpu(f.state))
    except NoPlanError as e:
        out["error"] = str(e)
    finally:
        f.close()
        group.close()
    out["opened"] = opened
    return out
