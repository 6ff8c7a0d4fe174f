"""What ``astraflow up`` does when one of its processes exits: restart it, or give up.

A component that exits with code 0 has finished (a feeder at the end of its epochs, a
trainer at ``--max-steps``) and is left alone. One that fails is started again after a
backoff that doubles with each failure (``backoff_s`` up to ``backoff_max_s``); one that
fails more than ``max_restarts`` times within ``window_s`` seconds keeps failing for a
reason a restart does not fix, and the run stops with a non-zero exit naming it. One
that Kafka refused (exit ``EXIT_REFUSED``: an operation denied, a wrong password, a
certificate problem) is never restarted: the run stops at once, pointing at its log.

``RestartPolicy`` is the decision alone (no processes, a clock passed in); ``Supervisor``
applies it to ``subprocess.Popen`` children. ``run_lock`` keeps a second ``up`` of the same
run from starting while one runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.errors import AstraflowError
from astraflow.kafka.access import EXIT_REFUSED


class GaveUp(AstraflowError):
    """A component kept failing: the run stops."""


class RunLocked(AstraflowError):
    """Another ``astraflow up`` of this run is running."""


@dataclass
class RestartPolicy:
    """Restart with doubling backoff; give up past ``max_restarts`` within ``window_s``."""

    max_restarts: int = 5
    window_s: float = 300.0
    backoff_s: float = 1.0
    backoff_max_s: float = 30.0
    failures: dict[str, list[float]] = field(default_factory=dict)

    def on_exit(self, name: str, code: int, now: float) -> float | None:
        """When to start ``name`` again after it exited with ``code`` at ``now``: a time,
        or None when it finished (code 0). Raises ``GaveUp`` when it keeps failing."""
        if code == 0:
            return None
        if code == EXIT_REFUSED:
            raise GaveUp(f"{name}: Kafka refused it (exit code {code}: denied, bad "
                         f"credentials or a certificate problem; its log says which); "
                         "stopping the run")
        recent = [t for t in self.failures.get(name, []) if now - t <= self.window_s]
        recent.append(now)
        self.failures[name] = recent
        if len(recent) > self.max_restarts:
            raise GaveUp(
                f"{name} failed {len(recent)} times in {self.window_s:.0f}s (last exit code "
                f"{code}); stopping the run"
            )
        return now + min(self.backoff_max_s, self.backoff_s * 2 ** (len(recent) - 1))


class Supervisor:
    """Starts the planned processes and keeps them running (see the module doc)."""

    def __init__(
        self,
        plan: dict[str, list[str]],
        spawn: Callable[[str, list[str]], subprocess.Popen],
        policy: RestartPolicy | None = None,
        log: Callable[[str], None] = print,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.plan, self.spawn, self.log, self.clock = plan, spawn, log, clock
        self.policy = policy or RestartPolicy()
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = dict.fromkeys(plan, 0)
        self.finished: set[str] = set()
        self._due: dict[str, float] = {}
        self._retiring: list[subprocess.Popen] = []  # stopped on purpose, not yet exited

    def start_all(self) -> None:
        for name, cmd in self.plan.items():
            self.procs[name] = self.spawn(name, cmd)

    def add(self, name: str, cmd: list[str]) -> None:
        """Start one more process (an autoscaled node), supervised like the planned ones."""
        self.plan[name] = cmd
        self.restarts.setdefault(name, 0)
        self.finished.discard(name)
        self.procs[name] = self.spawn(name, cmd)

    def retire(self, name: str) -> None:
        """Stop ``name`` for good: SIGTERM (it finishes what it has begun), no restart."""
        proc = self.procs.pop(name, None)
        self.plan.pop(name, None)
        self._due.pop(name, None)
        if proc is not None and proc.poll() is None:
            proc.terminate()
            self._retiring.append(proc)

    def pids(self) -> dict[str, int]:
        return {n: p.pid for n, p in self.procs.items() if n not in self.finished}

    def check(self) -> bool:
        """Reap exits and start what is due; True when the set of processes changed.
        Raises ``GaveUp``."""
        now, changed = self.clock(), False
        self._retiring = [p for p in self._retiring if p.poll() is None]
        for name, proc in self.procs.items():
            if name in self.finished or name in self._due or proc.poll() is None:
                continue
            changed = True
            at = self.policy.on_exit(name, proc.returncode, now)
            if at is None:
                self.finished.add(name)
                self.log(f"{name} finished")
            else:
                self._due[name] = at
                self.log(f"{name} exited with code {proc.returncode}; restarting it in "
                         f"{at - now:.0f}s")
        for name, at in list(self._due.items()):
            if now >= at:
                del self._due[name]
                self.procs[name] = self.spawn(name, self.plan[name])
                self.restarts[name] += 1
                changed = True
        return changed

    def restart_summary(self) -> str:
        """``"raas-0 x2, trainer x1"``: the components restarted so far ("" if none)."""
        return ", ".join(f"{n} x{k}" for n, k in self.restarts.items() if k)

    def stop_all(self, timeout: float = 30.0) -> None:
        """SIGTERM every running child, SIGKILL what is still running after ``timeout``."""
        live = [p for p in [*self.procs.values(), *self._retiring] if p.poll() is None]
        for p in live:
            p.terminate()
        deadline = time.time() + timeout
        for p in live:
            try:
                p.wait(max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)


@contextlib.contextmanager
def run_lock(path: Path) -> Iterator[None]:
    """Hold an exclusive lock on ``path`` for the block; ``RunLocked`` if another process
    holds it. The lock dies with its process, so a crashed ``up`` leaves none behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = Path(path).read_text().strip() or "another process"
            raise RunLocked(f"this run is already up (pid {holder}); `astraflow down` stops "
                            "it") from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        yield
    finally:
        os.close(fd)


__all__ = ["GaveUp", "RestartPolicy", "RunLocked", "Supervisor", "run_lock"]
