"""A policy's trainer as N processes on this host: start them, and take them down together.

``astraflow trainer run --processes N`` (``policies.<p>.trainer.parallel.processes``)
starts N copies of its own command line with torchrun's environment (``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); each copy sees
``WORLD_SIZE`` and joins the group instead of starting more (``in_group``). Under torchrun
(processes on several hosts) torchrun sets that environment itself and nothing here runs.

The group lives and dies as one: the processes meet in every step's collectives, so when
one dies the others would wait for it forever. The parent therefore waits for any child to
end; when one fails (any exit status but 0, or a signal) it SIGKILLs the rest and exits
with that status, and the supervisor (``astraflow up``, compose's restart policy) starts
the group again, which resumes from the committed offsets and the newest manifest. Each
child is also killed by the kernel when the parent dies (``PR_SET_PDEATHSIG``), so a
SIGKILL of the parent leaves no process behind. SIGTERM or SIGINT to the parent is handed
to rank 0 alone, which finishes its step and tells the others to stop.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence

log = logging.getLogger("astraflow.trainer")

RANK_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
_PR_SET_PDEATHSIG = 1


def in_group() -> bool:
    """Whether this process is one rank of a trainer group (torchrun's environment)."""
    return "WORLD_SIZE" in os.environ and "RANK" in os.environ


def free_port() -> int:
    """A TCP port free on localhost right now (the group's rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int, base: dict[str, str] | None = None
             ) -> dict[str, str]:
    """The environment of local rank ``rank`` of ``world`` meeting on ``port``."""
    env = dict(os.environ if base is None else base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    return env


def die_with_parent(sig: int = signal.SIGKILL,
                    then: Callable[[], None] | None = None) -> Callable[[], None]:
    """A ``preexec_fn`` that asks the kernel to send ``sig`` to the child when the process
    that started it dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing), then runs
    ``then``. Call it in the parent: it notes the parent's pid, so that a child whose
    parent died between the fork and the request gets ``sig`` at once.

    The trainer's ranks die with their parent (SIGKILL); ``astraflow up``'s components
    are asked to stop (SIGTERM), which ends each one's open transaction cleanly."""
    parent = os.getpid()

    def preexec() -> None:  # pragma: no cover - runs in the child before exec
        try:
            ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, sig)
        except (OSError, AttributeError):
            pass
        else:
            if os.getppid() != parent:
                os.kill(os.getpid(), sig)
        if then is not None:
            then()

    return preexec


def run_local_group(argv: Sequence[str], processes: int, port: int | None = None) -> int:
    """Run ``python -m astraflow.cli.main *argv`` as ranks 0..processes-1 of one group and
    supervise them (see the module docstring); the group's exit status."""
    port = port or free_port()
    cmd = [sys.executable, "-m", "astraflow.cli.main", *argv]
    children: dict[int, tuple[int, subprocess.Popen]] = {}
    for rank in range(processes):
        p = subprocess.Popen(cmd, env=rank_env(rank, processes, port),
                             preexec_fn=die_with_parent())
        children[p.pid] = (rank, p)
    log.info("trainer group of %d processes (pids %s) meeting on 127.0.0.1:%d", processes,
             ", ".join(str(pid) for pid in children), port)
    leader = next(p for rank, p in children.values() if rank == 0)

    def forward(signum, _frame):
        if leader.poll() is None:
            log.info("signal %d: handed to rank 0 (it finishes its step, then stops the "
                     "group)", signum)
            leader.send_signal(signal.SIGTERM)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _supervise(children)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def _supervise(children: dict[int, tuple[int, subprocess.Popen]]) -> int:
    """Wait until every child ended; the first failure kills the rest and is returned."""
    status = 0
    while children:
        try:
            pid, raw = os.waitpid(-1, 0)
        except InterruptedError:  # a forwarded signal: keep waiting
            continue
        except ChildProcessError:
            break
        entry = children.pop(pid, None)
        if entry is None:
            continue
        rank, p = entry
        p.returncode = code = os.waitstatus_to_exitcode(raw)
        if code == 0 or status != 0:
            continue
        status = code if code > 0 else 128 - code  # killed by signal -code
        log.error("trainer rank %d (pid %d) ended with %s: taking the group down (it "
                  "resumes from the committed offsets when restarted)", rank, pid,
                  f"exit status {code}" if code > 0 else f"signal {-code}")
        for _, other in children.values():
            if other.poll() is None:
                other.kill()
    return status


__all__ = ["RANK_ENV", "die_with_parent", "free_port", "in_group", "rank_env",
           "run_local_group"]
