"""Starting a user's agent program for one episode, and what it returns.

A program is either a **command** (a list of arguments, or a string split like a shell
would) or a **function** (``"package.module:function"``). Either gets the task's payload
and the episode's OpenAI base URL:

- a command reads them from its environment, as the ``openai`` client does:
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (a placeholder), ``ASTRAFLOW_TASK`` (the payload
  as JSON, also on its standard input) and ``ASTRAFLOW_REWARD_URL``; it ends the episode
  by exiting 0, with a JSON object as the last line of its output (``{"reward": x}``,
  ``{"rewards": {policy: x}}`` or ``{"answer": "..."}`` for the workflow's reward function
  to score), or by posting the reward to ``ASTRAFLOW_REWARD_URL`` first;
- a function is called as ``function(payload, base_url)`` in a thread and returns the same
  object (or a number: the reward, or None).

A program that runs past ``timeout_s``, exits non-zero, raises, or prints no JSON object
where one is needed fails its episode, with the reason. ``limits`` bound a command's CPU
seconds, memory and processes (``prlimit`` on the started process), and with
``network: false`` it runs in a network namespace that reaches nothing but its endpoint
(``netjail``).
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import resource
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from astraflow.raas.agent import netjail

API_KEY = "astraflow"  # the openai client insists on one; the endpoint ignores it


@dataclass(frozen=True)
class Limits:
    """A command's resource limits (None: unlimited); ``network`` False: no network but
    its endpoint."""

    cpu_s: float | None = None
    mem_mb: int | None = None
    max_procs: int | None = None
    network: bool | None = None

    def apply(self, pid: int) -> None:
        """On the started process ``pid`` (``prlimit``: no code runs between fork and exec,
        which a node's threads make unsafe; the program's first instant runs unbounded)."""
        if self.cpu_s is not None:
            resource.prlimit(pid, resource.RLIMIT_CPU, (int(self.cpu_s), int(self.cpu_s) + 1))
        if self.mem_mb is not None:
            b = int(self.mem_mb) * 2**20
            resource.prlimit(pid, resource.RLIMIT_AS, (b, b))
        if self.max_procs is not None:
            resource.prlimit(pid, resource.RLIMIT_NPROC, (self.max_procs, self.max_procs))


@dataclass
class Outcome:
    """How a program's episode ended: ``result`` (its JSON object, a number or None) or
    ``error`` (why it failed), and the tail of what it wrote to stderr."""

    result: Any = None
    error: str | None = None
    stderr: str = ""


@dataclass(frozen=True)
class AgentProgram:
    """A command or a function (module docstring)."""

    command: tuple[str, ...] | None = None
    function: str | None = None
    limits: Limits = field(default_factory=Limits)
    env: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if (self.command is None) == (self.function is None):
            raise ValueError("agent: give the program as command (a list or a string) or as "
                             "function ('package.module:function'), one of them")
        if self.function is not None:
            module, sep, name = self.function.partition(":")
            if not sep or not module or not name.isidentifier():
                raise ValueError(f"agent function {self.function!r}: expected "
                                 "'package.module:function'")
            if self.limits.network is False:
                raise ValueError("agent limits.network: false isolates a command; a function "
                                 "runs in the node's own process")
        elif self.limits.network is False and (why := netjail.probe()):
            raise ValueError(f"agent limits.network: false cannot isolate here: {why}")

    @classmethod
    def from_options(cls, command: str | list[str] | None = None, function: str | None = None,
                     limits: Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> AgentProgram:
        cmd = shlex.split(command) if isinstance(command, str) else command
        return cls(command=tuple(str(c) for c in cmd) if cmd is not None else None,
                   function=function, limits=Limits(**dict(limits or {})),
                   env={str(k): str(v) for k, v in (env or {}).items()})

    def resolve(self) -> Callable[..., Any] | None:
        """The function, imported (``ValueError`` naming what is missing); None for a
        command."""
        if self.function is None:
            return None
        module, _, name = self.function.partition(":")
        try:
            fn = getattr(importlib.import_module(module), name)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"agent function {self.function!r}: {e}") from None
        if not callable(fn):
            raise ValueError(f"agent function {self.function!r} is not callable")
        return fn

    def run(self, payload: Mapping[str, Any], base_url: str, reward_url: str,
            timeout_s: float) -> Outcome:
        """One episode of the program; never raises for what the program does."""
        if self.command is not None:
            return self._run_command(payload, base_url, reward_url, timeout_s)
        return self._run_function(payload, base_url, timeout_s)

    def _run_command(self, payload: Mapping[str, Any], base_url: str, reward_url: str,
                     timeout_s: float) -> Outcome:
        task = json.dumps(dict(payload))
        env = {**os.environ, **self.env, "OPENAI_BASE_URL": base_url, "OPENAI_API_KEY": API_KEY,
               "ASTRAFLOW_TASK": task, "ASTRAFLOW_REWARD_URL": reward_url}
        argv = list(self.command or ())
        if argv and argv[0] in ("python", "python3"):  # the node's own interpreter
            argv[0] = sys.executable
        if self.limits.network is False:
            where = urlsplit(base_url)
            bridge = _bridge(where.hostname or "127.0.0.1", where.port or 80)
            argv = netjail.jail_argv(bridge.path, where.port or 80, argv)
        try:
            proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, env=env, text=True,
                                    start_new_session=True)
        except OSError as e:
            return Outcome(error=f"cannot start {argv[0]!r}: {e}")
        try:
            self.limits.apply(proc.pid)
        except (OSError, ValueError) as e:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(error=f"cannot set its limits: {e}")
        try:
            out, err = proc.communicate(task, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            return Outcome(error=f"timeout: still running after {timeout_s:g} s",
                           stderr=_tail(err))
        if proc.returncode != 0:
            return Outcome(error=f"exit code {proc.returncode}: {_tail(err, 300) or 'no stderr'}",
                           stderr=_tail(err))
        return Outcome(result=_last_json(out), stderr=_tail(err))

    def _run_function(self, payload: Mapping[str, Any], base_url: str,
                      timeout_s: float) -> Outcome:
        try:
            fn = self.resolve()
        except ValueError as e:
            return Outcome(error=str(e))
        assert fn is not None
        box: dict[str, Any] = {}

        def call() -> None:
            try:
                box["result"] = fn(dict(payload), base_url)
            except BaseException as e:  # noqa: BLE001 - the program's failure, reported
                box["error"] = f"{type(e).__name__}: {e}"

        t = threading.Thread(target=call, daemon=True, name="agent-episode")
        t.start()
        t.join(timeout_s)
        if t.is_alive():  # it cannot be killed: its episode ends, so its calls now fail
            return Outcome(error=f"timeout: still running after {timeout_s:g} s")
        if "error" in box:
            return Outcome(error=box["error"])
        return Outcome(result=box.get("result"))


_bridges: dict[tuple[str, int], netjail.UnixBridge] = {}
_bridges_lock = threading.Lock()


def _bridge(host: str, port: int) -> netjail.UnixBridge:
    """The node's one Unix socket bridge to the endpoint at ``host:port`` (made on first
    use, kept while the node runs)."""
    with _bridges_lock:
        if (host, port) not in _bridges:
            bridge = _bridges[(host, port)] = netjail.UnixBridge(host, port)
            atexit.register(bridge.close)  # its socket's directory goes with the node
        return _bridges[(host, port)]


def _last_json(out: str) -> Any:
    """The last line of ``out`` that is a JSON object, else None."""
    for line in reversed(out.strip().splitlines()):
        try:
            value = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(value, dict):
            return value
    return None


def _tail(text: str | None, n: int = 2000) -> str:
    return (text or "").strip()[-n:]


__all__ = ["API_KEY", "AgentProgram", "Limits", "Outcome"]
