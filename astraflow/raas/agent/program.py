"""Starting a user's agent program for one episode, and what it returns.

A program is either a **command** (a list of arguments, or a string split like a shell
would) or a **function** (``"package.module:function"``). Either gets the task's payload
(what the workflow shows it: ``astraflow.raas.workflows.agent``) and the episode's OpenAI
base URL:

- a command reads them from its environment, as the ``openai`` client does:
  ``OPENAI_BASE_URL``, ``OPENAI_API_KEY`` (the episode's own key: the endpoint answers no
  call without it), ``ASTRAFLOW_TASK`` (the payload as JSON, also on its standard input),
  and, for a trusted program only, ``ASTRAFLOW_REWARD_URL``; it ends the episode by
  exiting 0, with a JSON object as the last line of its output, or by posting its reward;
- a function is called as ``function(payload, base_url)`` in a thread and returns the same
  object (or a number: the reward, or None). It runs inside the node: it is trusted.

A command runs in a jail of its own (``jail``): its own PID, mount and (unless
``limits.network``) network namespace, the node's private directories and secret files
hidden, a uid of its own when the node is root, an environment built from nothing
(``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, the endpoint, the task, the workflow's ``env``),
and ``limits`` (``cpu_s``, ``mem_mb``, ``max_procs``) set before it starts.
``limits.isolate: false`` keeps only the environment and the limits, for machines that
cannot make namespaces (trusted programs only).

A program that runs past ``timeout_s``, exits non-zero, raises, or prints no JSON object
where one is needed fails its episode, with the reason.
"""

from __future__ import annotations

import atexit
import functools
import importlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

from pydantic import ConfigDict

from astraflow.config.options import AgentLimitsOptions
from astraflow.raas.agent import jail

API_KEY = "astraflow"  # a function's placeholder: the openai client insists on one
# a root node runs each command as a uid of its own: this node's range, one per slot
_UID_BASE = (1 << 30) | ((os.getpid() & 0xFFFF) << 10)
_UID_SLOTS = 1 << 10


class Limits(AgentLimitsOptions):
    """A command's resource limits (None: unlimited), its network (None or False: none
    but its endpoint; True: the node's) and whether it is jailed at all (``isolate``):
    the workflow's ``limits:`` options, declared with their defaults in
    ``AgentLimitsOptions``."""

    model_config = ConfigDict(**AgentLimitsOptions.model_config, frozen=True)

    def rlimits(self) -> dict[str, Any]:
        return {"cpu_s": self.cpu_s, "mem_mb": self.mem_mb, "max_procs": self.max_procs}


@dataclass(frozen=True)
class Access:
    """How an episode's program reaches its endpoint: the base URL, the episode's key
    (None: none needed, for a function) and, for a trusted program, the reward URL."""

    base_url: str
    key: str | None = None
    reward_url: str | None = None


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
            if self.limits.network is not None or not self.limits.isolate:
                raise ValueError("agent limits.network and limits.isolate are a command's; "
                                 "a function runs in the node's own process")
        elif self.limits.isolate and (why := _probe(self.limits.network is True)):
            raise ValueError(f"agent limits.isolate: the jail cannot run here: {why}; "
                             "limits.isolate: false runs the program unisolated (it can then "
                             "read what the node can: trusted programs only)")

    @classmethod
    def from_options(cls, command: str | list[str] | None = None, function: str | None = None,
                     limits: AgentLimitsOptions | Mapping[str, Any] | None = None,
                     env: Mapping[str, str] | None = None) -> AgentProgram:
        cmd = shlex.split(command) if isinstance(command, str) else command
        return cls(command=tuple(str(c) for c in cmd) if cmd is not None else None,
                   function=function, limits=Limits(**(
                       limits.model_dump() if isinstance(limits, AgentLimitsOptions)
                       else dict(limits or {}))),
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

    def run(self, payload: Mapping[str, Any], access: Access, timeout_s: float) -> Outcome:
        """One episode of the program; never raises for what the program does."""
        if self.command is not None:
            return self._run_command(payload, access, timeout_s)
        return self._run_function(payload, access.base_url, timeout_s)

    def _argv(self) -> list[str]:
        """The command line: ``python`` is the node's interpreter, and an argument that
        names a file here is its absolute path (a jail starts elsewhere)."""
        argv = list(self.command or ())
        if argv and argv[0] in ("python", "python3"):
            argv[0] = sys.executable
        return [os.path.abspath(a) if os.path.isfile(a) else a for a in argv]

    def _run_command(self, payload: Mapping[str, Any], access: Access,
                     timeout_s: float) -> Outcome:
        task = json.dumps(dict(payload))
        argv = self._argv()
        isolate, network = self.limits.isolate, self.limits.network is True
        with _home(isolate) as home, _uid(isolate) as uid:
            env = {"PATH": f"{os.path.dirname(sys.executable)}:{jail.SAFE_PATH}",
                   "HOME": home, "TMPDIR": home, "LANG": "C.UTF-8", **self.env,
                   "OPENAI_BASE_URL": access.base_url,
                   "OPENAI_API_KEY": access.key or API_KEY, "ASTRAFLOW_TASK": task}
            if access.reward_url is not None:
                env["ASTRAFLOW_REWARD_URL"] = access.reward_url
            bridge = None
            if isolate and not network:
                where = urlsplit(access.base_url)
                b = _bridge(where.hostname or "127.0.0.1", where.port or 80)
                bridge = (b.path, where.port or 80)
            keep = [*jail.interpreter_paths(), *(os.path.dirname(a) for a in argv[1:]
                                                  if os.path.isfile(a))]
            if bridge is not None:
                keep.append(os.path.dirname(bridge[0]))
            cfg = jail.config(argv, env, uid=uid, limits=self.limits.rlimits(), keep=keep,
                              blank=jail.secret_files(os.environ),
                              hide=jail.hidden_dirs(os.path.expanduser("~"), os.getcwd()),
                              bridge=bridge, tmpfs_mb=max(64, self.limits.mem_mb or 256))
            try:
                proc = jail.run_jailed(cfg, isolate, network)
            except OSError as e:
                return Outcome(error=f"cannot start {argv[0]!r}: {e}")
            try:
                out, err = proc.communicate(task, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                out, err = proc.communicate()
                return Outcome(error=f"timeout: still running after {timeout_s:g} s",
                               stderr=_tail(err))
        if proc.returncode != 0:
            return Outcome(error=f"exit code {_exit(proc.returncode)}: "
                                 f"{_tail(err, 300) or 'no stderr'}", stderr=_tail(err))
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


@functools.cache
def _probe(network: bool) -> str | None:
    """Why a jail cannot run here (probed once per setting), else None."""
    return jail.probe(True, network)


_free_uids = list(range(_UID_SLOTS))
_uids_lock = threading.Lock()


@contextmanager
def _uid(isolate: bool) -> Iterator[int | None]:
    """A uid of the node's range for one command while it runs, when the node is root
    and jails it; else None (the command keeps the node's uid)."""
    if not isolate or os.geteuid() != 0:
        yield None
        return
    with _uids_lock:
        if not _free_uids:
            raise RuntimeError(f"agent: more than {_UID_SLOTS} commands at once")
        slot = _free_uids.pop()
    try:
        yield _UID_BASE + slot
    finally:
        with _uids_lock:
            _free_uids.append(slot)


@contextmanager
def _home(isolate: bool) -> Iterator[str]:
    """The command's home: ``/tmp`` of its jail (a tmpfs of its own), or a fresh
    directory removed afterwards."""
    if isolate:
        yield "/tmp"
        return
    home = tempfile.mkdtemp(prefix="astraflow-agent-home-")
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)


def _exit(code: int) -> str:
    """An exit code, with the signal it stands for (a jail reports 128 + the signal)."""
    sig = -code if code < 0 else code - 128 if 128 < code < 192 else None
    try:
        return f"{code} ({signal.Signals(sig).name})" if sig else str(code)
    except ValueError:
        return str(code)


_bridges: dict[tuple[str, int], jail.UnixBridge] = {}
_bridges_lock = threading.Lock()


def _bridge(host: str, port: int) -> jail.UnixBridge:
    """The node's one Unix socket bridge to the endpoint at ``host:port`` (made on first
    use, kept while the node runs)."""
    with _bridges_lock:
        if (host, port) not in _bridges:
            bridge = _bridges[(host, port)] = jail.UnixBridge(host, port)
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


__all__ = ["API_KEY", "Access", "AgentProgram", "Limits", "Outcome"]
