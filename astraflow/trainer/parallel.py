"""The trainer's processes: one ``torch.distributed`` group, its collectives, local spawning.

A trainer of N processes is started as torchrun starts one: every process has ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` in its environment
(``spawn_local`` sets them for local children). ``join(device)`` turns that environment
into a ``Group``: the default process group (gloo on CPUs, NCCL on GPUs, where each process
drives GPU ``LOCAL_RANK``) and the device the process trains on. ``Trainer(..., group=...)``
(``astraflow.trainer.trainer``) shards its model over the group with FSDP2.

A trainer of one process is a group of one (``solo``): no ``torch.distributed`` at all, and
every collective is the identity, so the trainer and its service run the same code at any
world size. A group of one (``solo``, or torchrun's with ``WORLD_SIZE=1``) shards nothing.

The collectives here are what the service needs around the step: ``broadcast`` a Python
object from one rank, ``gather`` every rank's object on rank 0, ``barrier``, and
``sum_floats`` / ``max_floats`` of a dict of numbers. Every rank must call each of them, in
the same order. They fail after the group's collective timeout (``timeout_s``).

Rank 0 alone reads Kafka, so the other ranks wait for it, for as long as it has no batch.
They wait on the *control channel*, a gloo group of its own made at ``join`` with a
timeout of ``CONTROL_TIMEOUT_S`` (a year): ``command`` hands them rank 0's next command,
``wait_for_all`` holds every rank until all are there (before the collectives that follow
work one rank does alone). A rank that dies closes its connections, so a rank waiting on
the channel fails at once with an error naming the peer, not at the timeout; training's
collectives keep their short timeout, which finds a rank that hangs.

A rank's part of a sharded tensor is rows ``start..stop`` of its dim 0 (FSDP2 shards every
parameter along dim 0): ``shard_rows`` says which, ``rows`` makes the blob format's ``Rows``
(``astraflow.weights.blob``) for them.
"""

from __future__ import annotations

import datetime
import faulthandler
import io
import multiprocessing.connection
import os
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from astraflow.trainer.processes import RANK_ENV, free_port, rank_env

if TYPE_CHECKING:
    from astraflow.weights.blob import Rows

# the environment torchrun gives each process
DEFAULT_TIMEOUT_S = 600.0
# how long training's collectives wait for the other ranks (seconds), when join is not told
TIMEOUT_ENV = "ASTRAFLOW_TRAINER_COLLECTIVE_TIMEOUT_S"
# the control channel's: the other ranks wait for rank 0's next command as long as it lives
CONTROL_TIMEOUT_S = 365 * 24 * 3600.0


def rows(start: int, stop: int, shape: tuple[int, ...]) -> Rows:
    """``Rows(start, stop, shape)`` of the blob format (``astraflow.weights.blob``,
    imported here only when a part is made)."""
    from astraflow.weights.blob import Rows

    return Rows(start, stop, tuple(shape))


def shard_rows(n: int, rank: int, world: int) -> tuple[int, int]:
    """The rows of dim 0 (of ``n``) that rank ``rank`` of ``world`` holds under FSDP2's
    ``Shard(0)``: ``torch.chunk``'s split, ``ceil(n / world)`` rows a rank, so the last
    ranks may hold fewer or none."""
    size = -(-n // world) if n else 0
    start = min(rank * size, n)
    return start, min(start + size, n)


@dataclass
class Group:
    """This process's place in the trainer's process group (see the module docstring).

    ``device``: where this process trains (``cuda:LOCAL_RANK`` under NCCL, the CPU under
    gloo). ``backend`` ``"none"``: a group of one without ``torch.distributed`` (``solo``).
    With one rank every collective returns what it was given."""

    rank: int
    world: int
    local_rank: int
    backend: str
    device: torch.device
    _mesh: Any = field(default=None, repr=False)
    _checkpoint_group: Any = field(default=None, repr=False)
    # the control channel (gloo, CONTROL_TIMEOUT_S); None: the default group's collectives
    _control: Any = field(default=None, repr=False)

    @property
    def mesh(self) -> Any:
        """The 1-D ``DeviceMesh`` of every rank (what FSDP2 shards over)."""
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._mesh = init_device_mesh(self.device.type, (self.world,))
        return self._mesh

    def checkpoint_group(self) -> Any:
        """A gloo group of every rank for checkpoint I/O (``astraflow.trainer.checkpoint``):
        an asynchronous save runs its collectives in a thread, on this group, so they never
        interleave with training's. Created on first use: every rank must call it then."""
        if self._checkpoint_group is None:
            self._checkpoint_group = dist.new_group(backend="gloo")
        return self._checkpoint_group

    def _tensor(self, values: Sequence[float]) -> torch.Tensor:
        # float64: counts stay exact, sums of fp32 figures lose nothing
        return torch.tensor(list(values), dtype=torch.float64, device=self.device)

    def broadcast(self, obj: Any = None, src: int = 0) -> Any:
        """``obj`` of rank ``src`` (pickled) on every rank; other ranks' ``obj`` is
        ignored."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == src else None]
        dist.broadcast_object_list(box, src=src, device=self._object_device())
        return box[0]

    def command(self, obj: Any = None) -> Any:
        """Rank 0's ``obj`` (pickled) on every rank, over the control channel: the other
        ranks wait for it as long as rank 0 lives (see the module docstring); they fail
        promptly with ``RuntimeError`` when it dies."""
        if self.world == 1:
            return obj
        box = [obj if self.rank == 0 else None]
        self._on_control(lambda: dist.broadcast_object_list(
            box, src=0, group=self._control,
            device=None if self._control is not None else self._object_device()))
        return box[0]

    def wait_for_all(self) -> None:
        """Return once every rank got here, over the control channel (no deadline while
        the ranks live): before training's collectives, after work one rank did alone."""
        if self.world == 1:
            return
        if self._control is None:
            self.barrier()
            return
        self._on_control(lambda: dist.barrier(group=self._control))

    def _on_control(self, op: Callable[[], Any]) -> None:
        try:
            op()
        except (RuntimeError, dist.DistBackendError) as e:
            raise RuntimeError(
                f"trainer rank {self.rank}: lost the trainer group while waiting for rank 0 "
                f"(a rank died or left): {e}") from e

    def gather(self, obj: Any) -> list[Any] | None:
        """Every rank's ``obj`` (pickled), in rank order, on rank 0; None elsewhere."""
        if self.world == 1:
            return [obj]
        out: list[Any] | None = [None] * self.world if self.rank == 0 else None
        if self.backend == "nccl":  # NCCL has no gather: every rank receives, 0 keeps
            everyone: list[Any] = [None] * self.world
            dist.all_gather_object(everyone, obj)
            return everyone if self.rank == 0 else None
        dist.gather_object(obj, out, dst=0)
        return out

    def barrier(self) -> None:
        """Return once every rank got here."""
        if self.world == 1:
            return
        if self.backend == "nccl":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def sum_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value summed over the ranks (every rank passes the same keys)."""
        return self._reduce(values, dist.ReduceOp.SUM)

    def max_floats(self, values: dict[str, float]) -> dict[str, float]:
        """Each value's maximum over the ranks (every rank passes the same keys)."""
        return self._reduce(values, dist.ReduceOp.MAX)

    def _reduce(self, values: dict[str, float], op: Any) -> dict[str, float]:
        if self.world == 1:
            return dict(values)
        keys = sorted(values)
        t = self._tensor([values[k] for k in keys])
        dist.all_reduce(t, op=op)
        return dict(zip(keys, t.tolist()))

    def all_gather_rows(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's 1-D ``t`` (lengths may differ) concatenated in rank order, on every
        rank."""
        if self.world == 1:
            return t.reshape(-1)
        n = torch.tensor([t.numel()], dtype=torch.long, device=self.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world)]
        dist.all_gather(sizes, n)
        longest = max(int(s) for s in sizes)
        padded = torch.zeros(longest, dtype=t.dtype, device=self.device)
        padded[: t.numel()] = t.reshape(-1).to(self.device)
        parts = [torch.empty_like(padded) for _ in range(self.world)]
        dist.all_gather(parts, padded)
        return torch.cat([p[: int(s)] for p, s in zip(parts, sizes)])

    def _object_device(self) -> torch.device | None:
        return self.device if self.backend == "nccl" else None

    def close(self) -> None:
        """Destroy the process group (and the checkpoint group): the end of this process's
        part in the trainer (nothing for ``solo``'s group)."""
        if self.backend != "none" and dist.is_initialized():
            for sub in (self._checkpoint_group, self._control):
                if sub is not None:
                    dist.destroy_process_group(sub)
            self._checkpoint_group = self._control = None
            dist.destroy_process_group()
        self._mesh = None


def solo(device: str = "cpu") -> Group:
    """The group of one process alone: rank 0 of 1 on ``device``, without
    ``torch.distributed`` (every collective is the identity; see the module docstring)."""
    return Group(0, 1, 0, "none", torch.device(device))


def _env_int(name: str) -> int:
    value = os.environ[name]
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {value!r}") from None


def _env_seconds(name: str, default: float) -> float:
    value = os.environ.get(name)
    if not value:
        return default
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not seconds > 0:
        raise ValueError(f"environment variable {name} must be a number of seconds > 0, "
                         f"got {value!r}")
    return seconds


def join(device: str = "cpu", timeout_s: float | None = None,
         control_timeout_s: float = CONTROL_TIMEOUT_S) -> Group:
    """Join the trainer's process group from torchrun's environment (``processes.RANK_ENV``).

    ``device``: ``cpu`` (gloo) or ``cuda`` (NCCL; this process drives GPU ``LOCAL_RANK``,
    or the index given as ``cuda:N``). ``timeout_s``: how long a collective may wait for the
    other ranks before it fails (default: ``$ASTRAFLOW_TRAINER_COLLECTIVE_TIMEOUT_S``, else
    ``DEFAULT_TIMEOUT_S``; the control channel's is ``control_timeout_s``: see the module
    docstring). ``ValueError`` (one line) when the environment is incomplete or the
    device is not usable."""
    missing = [v for v in RANK_ENV if not os.environ.get(v)]
    if missing:
        raise ValueError(
            f"joining the trainer's process group needs {', '.join(missing)} in the "
            "environment (set by torchrun or spawn_local: RANK, WORLD_SIZE, LOCAL_RANK, "
            "MASTER_ADDR, MASTER_PORT)")
    rank, world, local = (_env_int(v) for v in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if timeout_s is None:
        timeout_s = _env_seconds(TIMEOUT_ENV, DEFAULT_TIMEOUT_S)
    if not 0 <= rank < world:
        raise ValueError(f"RANK ({rank}) must be in 0..WORLD_SIZE-1 ({world - 1})")
    try:
        dev = torch.device(device)
    except RuntimeError:
        dev = torch.device("meta")  # not a device torch knows: refused below
    if dev.type == "cpu":
        backend, dev = "gloo", torch.device("cpu")
    elif dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device {device!r}: CUDA is not available in this process")
        dev = torch.device("cuda", local if dev.index is None else dev.index)
        if dev.index >= torch.cuda.device_count():
            raise ValueError(f"device {dev}: only {torch.cuda.device_count()} GPU(s) visible "
                             f"(LOCAL_RANK {local})")
        torch.cuda.set_device(dev)
        backend = "nccl"
    else:
        raise ValueError(f"device must be 'cpu' or 'cuda' (or 'cuda:N'), got {device!r}")
    if dist.is_initialized():
        raise ValueError("a torch.distributed process group is already initialized in "
                         "this process")
    dist.init_process_group(
        backend, rank=rank, world_size=world, init_method="env://",
        timeout=datetime.timedelta(seconds=timeout_s),
        **({"device_id": dev} if backend == "nccl" else {}))
    control = dist.new_group(backend="gloo",
                             timeout=datetime.timedelta(seconds=control_timeout_s))
    return Group(rank, world, local, backend, dev, _control=control)


def _child(rank: int, n: int, port: int, target: Callable[..., Any], args: tuple,
           conn: multiprocessing.connection.Connection) -> None:
    """A spawned worker: torchrun's environment, then ``target(*args)``; its result (or
    its traceback) goes back through ``conn`` serialized with ``torch.save``."""
    os.environ.update(rank_env(rank, n, port, base={}))
    faulthandler.enable()  # a crash in native code leaves its Python stack on stderr
    try:
        result: Any = ("ok", target(*args))
    except BaseException:
        result = ("error", traceback.format_exc())
    buf = io.BytesIO()
    torch.save(result, buf)
    conn.send_bytes(buf.getvalue())
    conn.close()


def spawn_local(n: int, target: Callable[..., Any], args: tuple = (), *,
                port: int | None = None, timeout_s: float | None = None) -> list[Any]:
    """Run ``target(*args)`` in ``n`` fresh local processes (spawned) with torchrun's
    environment set for ranks ``0..n-1`` (``target`` calls ``join``); their return values
    in rank order. ``target`` and ``args`` must be picklable (a module-level function); the
    results are passed back with ``torch.save`` (tensors included).

    ``RuntimeError`` with the worker's traceback when one fails, or when ``timeout_s``
    passes before all are done (every worker is then terminated)."""
    if n < 1:
        raise ValueError(f"n (processes) must be at least 1, got {n}")
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = port or free_port()
    procs, conns = [], []
    for rank in range(n):
        recv, send = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_child, args=(rank, n, port, target, args, send),
                        name=f"astraflow-trainer-rank{rank}", daemon=False)
        p.start()
        send.close()
        procs.append(p)
        conns.append(recv)
    results: dict[int, Any] = {}
    failure: str | None = None
    try:
        pending = dict(enumerate(conns))
        while pending and failure is None:
            ready = multiprocessing.connection.wait(list(pending.values()), timeout=timeout_s)
            if not ready:
                failure = f"{len(pending)} of {n} workers not done after {timeout_s} s"
                break
            for rank, c in list(pending.items()):
                if c not in ready:
                    continue
                del pending[rank]
                try:
                    status, value = torch.load(io.BytesIO(c.recv_bytes()), weights_only=False)
                except EOFError:
                    procs[rank].join(5)
                    status, value = "error", (f"rank {rank} exited without a result "
                                              f"(exit code {procs[rank].exitcode})")
                if status != "ok":
                    failure = f"rank {rank} failed:\n{value}"
                    break
                results[rank] = value
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
            p.join()
        for c in conns:
            c.close()
    if failure is not None:
        raise RuntimeError(failure)
    return [results[r] for r in range(n)]


__all__ = ["CONTROL_TIMEOUT_S", "DEFAULT_TIMEOUT_S", "TIMEOUT_ENV", "Group", "join", "rows",
           "shard_rows", "solo", "spawn_local"]
