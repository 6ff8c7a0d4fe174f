"""Run untrusted Python code in a separate, limited process.

``run_python(code, stdin=...)`` runs ``code`` as a script and returns a ``SandboxResult``
(``status`` is ``ok``, ``error``, ``timeout``, ``killed``, ``memory`` or ``limit``);
``run_function(code, "f", inputs)`` calls a function the code defines on each input inside
one sandboxed process, and ``check_cases(code, "f", cases)`` compares those outputs with
expected values (the expected values never enter the sandbox, so printing cannot fake a
pass).

What is enforced, in layers (``SandboxResult.isolation`` names those in force on a run):

* **separate process** in its own session and process group; on a wall-clock timeout or
  when the output limit is exceeded the whole process group is killed with SIGKILL.
* **resource limits** (``setrlimit``, set before the user code runs, soft = hard so they
  cannot be raised again): CPU time (``RLIMIT_CPU``, whole seconds; SIGXCPU, then SIGKILL
  one second later), address space (``RLIMIT_AS``, always set: allocations beyond
  ``mem_mb`` fail with ``MemoryError``, status ``memory``), file size (``RLIMIT_FSIZE``),
  open files (``RLIMIT_NOFILE``), no core dumps, and processes + threads
  (``RLIMIT_NPROC``, ``max_procs`` tasks, the main thread included: a fork beyond fails
  with EAGAIN, a thread with "can't start new thread"; uncaught, in any thread or call,
  either ends the run with status ``limit``, reason ``process limit``; a thread whose
  stack no longer fits in ``mem_mb`` gives ``memory``). The kernel counts this limit per
  real uid *and user namespace* (ucounts, Linux >= 5.14): with namespaces the count
  starts empty in the run's own namespace (limit ``max_procs`` + 1, the ``unshare``
  process; isolation ``nproc-userns``) and nothing else of the uid shares it. Without
  them it counts every task of the uid, so the limit is the uid's tasks at the start +
  ``max_procs`` (isolation ``nproc-uid``; approximate: other processes of the uid, other
  runs among them, that start or end meanwhile shrink or widen the room). uid 0 is
  exempt (no ``nproc-*`` entry): only a root caller that keeps its uid
  (``drop_user=False``, or ``nobody`` cannot run Python) runs without it. At the default
  256 MiB a thread bomb runs out of address space first (8 MiB stacks plus a glibc malloc
  arena per thread: about 5 threads), status ``memory``; the process limit is what stops
  forks, and threads when ``mem_mb`` is larger.
* **namespaces** when ``unshare`` works unprivileged (probed once; it does on this
  machine): a new user, network and PID namespace (``unshare -c -n -p -f --kill-child``).
  The network namespace has only a down loopback device: no connection to anything,
  127.0.0.1 included. The PID namespace dies with its first process, so nothing forked
  can outlive the run.
* **a final sweep** after every run: processes still in the run's session, or of the
  run's uid with its directory as cwd or ``HOME`` (one that left the session), are
  killed (through pidfds) until none is left; their number is ``SandboxResult.strays``.
* **an unprivileged user** when the caller is root: the code runs as ``nobody`` (65534).
  If ``sys.executable`` is not executable by ``nobody`` (e.g. under ``/root``),
  ``/usr/bin/python3`` is used; when neither works the code keeps the caller's uid.
* **an audit hook** (``sys.addaudithook``, which code cannot remove) installed before the
  user code: it refuses every ``socket.*`` event, importing ``socket``, ``ssl``,
  ``subprocess``, ``multiprocessing``, ``ctypes`` and their C modules, process creation
  (``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``,
  ``subprocess.Popen``), every ``ctypes.*`` event, ``os.kill`` of other processes,
  ``resource.setrlimit``, and writes, removals, renames, ``chmod``/``chown`` of paths
  outside the sandbox directory.
* ``python -I -S -B``: isolated mode (no ``PYTHON*`` variables, no user site, script
  directory not on ``sys.path``), no ``site`` (so no site-packages: the standard library
  only), no ``.pyc`` writes.
* a **fresh temporary directory** as cwd, ``HOME`` and ``TMPDIR``, removed afterwards
  (also when the code made parts of it unreadable); a **scrubbed environment** (only
  ``PATH``, ``HOME``, ``TMPDIR``, ``LANG``, ``LC_ALL``); stdin from a file; stdout and
  stderr each capped at ``max_output`` bytes (the run is killed beyond).

What is NOT enforced: the audit hook is a best-effort layer in the same interpreter, not a
security boundary (a bug in CPython or a C extension could get around it); without working
namespaces the network is blocked only by that hook. Reading files the uid may read is
allowed (no mount namespace or chroot); without a uid drop (caller not root) the code may
read everything the caller can. ``RLIMIT_AS`` and ``RLIMIT_CPU`` hold per process: with
the audit hook off (or bypassed) a fork bomb may use up to ``max_procs`` times each
until the wall-clock timeout. Code that catches the fork/thread error itself goes on (its
status is then whatever it ends with). Without a PID namespace the sweep misses a
process that left the session, changed directory and replaced its environment (exec, which
the hook refuses). No limit on disk use other than the file-size limit per file, no
cgroup, no seccomp filter. For hostile code use a container or VM as well.
"""

from __future__ import annotations

import functools
import json
import os
import selectors
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from astraflow.sandbox.child import CPU_EXIT, LIMIT_EXIT, MEMORY_EXIT, PREAMBLE, SETUP_EXIT

NOBODY = 65534
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
MAX_CODE_BYTES = 1 << 20

STATUSES = ("ok", "error", "timeout", "killed", "memory", "limit")

# util-linux's unshare (2.38) cannot re-raise SIGKILL on itself when its child died of it
# (signal(SIGKILL, SIG_DFL) fails): it exits 1 with this message instead
UNSHARE_SIGKILL = "unshare: sigprocmask unblock failed"


@dataclass
class SandboxResult:
    """How a sandboxed run ended.

    ``status``: ``ok`` (exit 0), ``error`` (non-zero exit, e.g. an exception),
    ``timeout`` (CPU-time limit or wall-clock timeout; ``reason`` says which), ``killed``
    (killed by a signal, or for exceeding the output limit), ``memory`` (the memory
    limit was hit, ``reason`` ``memory limit``) or ``limit`` (the process/thread limit
    was hit: a fork failed with EAGAIN or a thread could not start; ``reason`` ``process
    limit``). ``seconds``: wall clock; ``cpu_seconds``: user + system CPU of the process
    tree. ``truncated``: stdout or stderr was cut at the output limit. ``isolation``: the
    layers that were in force (see the module docstring). ``strays``: processes of the
    run still alive after it ended, killed by the final sweep (dying ones included).
    """

    status: str
    stdout: str
    stderr: str
    returncode: int | None
    seconds: float
    cpu_seconds: float = 0.0
    reason: str = ""
    truncated: bool = False
    isolation: list[str] = field(default_factory=list)
    strays: int = 0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclass
class SandboxLimits:
    """Limits of one sandboxed run (see ``run_python``)."""

    cpu_s: float = 2.0
    mem_mb: int = 256
    timeout_s: float = 10.0
    max_output: int = 64 * 1024
    fsize_mb: int = 16
    nofile: int = 64
    max_procs: int = 32


class SandboxError(RuntimeError):
    """The sandbox itself could not run (not the code in it)."""


# --- probes ------------------------------------------------------------------------------
def _runs(cmd: list[str], user: int | None) -> bool:
    kw: dict[str, Any] = {}
    if user is not None:
        kw = {"user": user, "group": user, "extra_groups": []}
    try:
        r = subprocess.run(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=20,
            env={"PATH": SAFE_PATH},
            cwd="/",
            **kw,
        )
    except (OSError, subprocess.SubprocessError):
        return False
    return r.returncode == 0


@functools.cache
def interpreter_and_user(python: str | None = None) -> tuple[str, int | None]:
    """The interpreter to run and the uid to run it as (None: the caller's uid).

    As root: ``nobody`` with ``python`` (default ``sys.executable``) if it can run it,
    else with ``/usr/bin/python3``; if neither works, the caller's uid and ``python``.
    """
    python = python or sys.executable
    if os.geteuid() != 0:
        return python, None
    for candidate in dict.fromkeys([python, "/usr/bin/python3"]):
        if os.path.exists(candidate) and _runs([candidate, "-I", "-S", "-c", "pass"], NOBODY):
            return candidate, NOBODY
    return python, None


@functools.cache
def namespace_prefix(python: str, user: int | None) -> tuple[str, ...]:
    """``unshare`` arguments for new user, network and PID namespaces, or () if they do
    not work for ``user`` here (probed once)."""
    unshare = shutil.which("unshare", path=SAFE_PATH)
    if unshare is None:
        return ()
    prefix = (unshare, "-c", "-n", "-p", "-f", "--kill-child")
    probe = (
        "import socket\ntry:\n socket.create_connection(('127.0.0.1', 9), 2)\n"
        "except OSError:\n pass"
    )
    ok = _runs([*prefix, python, "-I", "-S", "-c", probe], user)
    return prefix if ok else ()


# --- running -----------------------------------------------------------------------------
def _rmtree(path: str) -> None:
    """Remove ``path`` even where the code took permissions away."""

    def fix(func: Any, p: str, _exc: Any) -> None:
        try:
            os.chmod(os.path.dirname(p) or p, stat.S_IRWXU)
            if os.path.isdir(p) and not os.path.islink(p):
                os.chmod(p, stat.S_IRWXU)
            func(p)
        except OSError:
            pass

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=fix)
    else:
        shutil.rmtree(path, onerror=fix)
    if os.path.exists(path):  # a second pass after the permission fixes
        shutil.rmtree(path, ignore_errors=True)


class _Pipes:
    """Non-blocking reads of the child's stdout and stderr, each capped at ``limit`` bytes.

    One thread, no reader threads: a process that escaped the kill and still holds a pipe
    cannot make the caller wait for it.
    """

    def __init__(self, streams: Sequence[Any], limit: int):
        self.limit = limit
        self.bufs = {s.fileno(): bytearray() for s in streams}
        self.truncated = False
        self.sel = selectors.DefaultSelector()
        for fd in self.bufs:
            os.set_blocking(fd, False)
            self.sel.register(fd, selectors.EVENT_READ)

    @property
    def open(self) -> bool:
        return bool(self.sel.get_map())

    def poll(self, timeout: float, extra: int | None = None) -> bool:
        """Read what is there (waiting up to ``timeout``); True if ``extra`` is ready."""
        if extra is not None and extra not in self.sel.get_map():
            self.sel.register(extra, selectors.EVENT_READ)
        ready = False
        for key, _ in self.sel.select(timeout):
            fd = key.fd
            if fd == extra:
                ready = True
                continue
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                continue
            except OSError:
                chunk = b""
            if not chunk:
                self.sel.unregister(fd)
                continue
            buf = self.bufs[fd]
            room = self.limit - len(buf)
            if room > 0:
                buf += chunk[:room]
            if len(chunk) > room:
                self.truncated = True
        return ready

    def forget(self, fd: int | None) -> None:
        """Stop watching ``fd`` (given to ``poll`` as ``extra``)."""
        if fd is not None and fd in self.sel.get_map():
            self.sel.unregister(fd)

    def drain(self, quiet_s: float = 0.2, max_s: float = 2.0) -> None:
        """Read to EOF, giving up after ``quiet_s`` without data or ``max_s`` in all."""
        end = time.monotonic() + max_s
        while self.open and time.monotonic() < end:
            before = sum(len(b) for b in self.bufs.values())
            n_open = len(self.sel.get_map())
            self.poll(quiet_s)
            after = sum(len(b) for b in self.bufs.values())
            if after == before and len(self.sel.get_map()) == n_open:
                break
        self.sel.close()

    def text(self, stream: Any) -> str:
        return bytes(self.bufs[stream.fileno()]).decode("utf-8", "replace")


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)  # readable once the process has exited
    except (AttributeError, OSError):
        return None


def run_sandboxed(
    source: str,
    stdin: bytes,
    mode: str,
    func: str,
    nonce: str,
    limits: SandboxLimits,
    namespaces: bool | None,
    audit: bool,
    python: str | None,
    drop_user: bool,
) -> SandboxResult:
    if int(limits.mem_mb) < 1 or int(limits.max_procs) < 1:
        raise ValueError("mem_mb and max_procs must be at least 1 (they cannot be turned off)")
    if len(source.encode("utf-8", "surrogatepass")) > MAX_CODE_BYTES:
        return SandboxResult("error", "", "sandbox: code too large", None, 0.0, reason="too large")
    interp, user = interpreter_and_user(python)
    if not drop_user:
        interp, user = python or sys.executable, None
    prefix = namespace_prefix(interp, user) if namespaces is not False else ()
    if namespaces and not prefix:
        raise SandboxError("namespaces were required but unshare does not work here")
    isolation = _isolation(prefix, user, audit)
    root = tempfile.mkdtemp(prefix="astraflow-sandbox-")
    try:
        main = os.path.join(root, "main.py")
        with open(main, "w", encoding="utf-8", errors="surrogatepass") as fh:
            fh.write(source)
        os.chmod(main, 0o644)  # readable by the sandbox user whatever the caller's umask
        if user is not None:
            os.chown(root, user, user)
        cfg = _child_config(mode, func, nonce, limits, audit, root, main, bool(prefix))
        cmd = [*prefix, interp, "-I", "-S", "-B", "-X", "utf8", "-c", PREAMBLE, json.dumps(cfg)]
        proc, t0 = _spawn(cmd, root, stdin, user)
        try:
            result = _wait(proc, t0, limits, isolation, wrapped=bool(prefix))
        finally:
            strays = _sweep(proc.pid, root, os.getuid() if user is None else user)
        result.strays = strays
        return result
    finally:
        _rmtree(root)


def _isolation(prefix: Sequence[str], user: int | None, audit: bool) -> list[str]:
    """The names of the isolation layers a run gets (reported in ``SandboxResult``)."""
    isolation = ["process-group", "rlimits", "tmpdir", "env", "isolated-python"]
    if prefix:
        isolation += ["userns", "netns", "pidns"]
    # the kernel exempts uid 0 from RLIMIT_NPROC, in a user namespace too
    if (os.getuid() if user is None else user) != 0:
        isolation.append("nproc-userns" if prefix else "nproc-uid")
    if user is not None:
        isolation.append("uid=nobody")
    if audit:
        isolation.append("audit-hook")
    return isolation


def _cpu_limit(limits: SandboxLimits) -> int:
    """The CPU-time limit in whole seconds, rounded up (at least 1)."""
    return max(1, int(-(-float(limits.cpu_s) // 1)))


def _child_config(mode: str, func: str, nonce: str, limits: SandboxLimits, audit: bool,
                  root: str, main: str, userns: bool) -> dict[str, Any]:
    """What the preamble in the child reads: what to run and the limits to set
    (``userns``: it runs in a user namespace of its own)."""
    return {
        "mode": mode,
        "func": func,
        "nonce": nonce,
        "cpu": _cpu_limit(limits),
        "mem": int(limits.mem_mb) << 20,
        "fsize": int(limits.fsize_mb) << 20,
        "nofile": int(limits.nofile),
        "procs": int(limits.max_procs),
        "procs_base": "userns" if userns else "uid",
        "audit": bool(audit),
        "root": root,
        "main": main,
        "cpu_exit": CPU_EXIT,
        "memory_exit": MEMORY_EXIT,
        "setup_exit": SETUP_EXIT,
        "limit_exit": LIMIT_EXIT,
    }


def _spawn(cmd: list[str], root: str, stdin: bytes,
           user: int | None) -> tuple[subprocess.Popen, float]:
    """Start ``cmd`` in its own session in ``root`` with a minimal environment, reading
    ``stdin``; the process and its start time."""
    env = {
        "PATH": SAFE_PATH,
        "HOME": root,
        "TMPDIR": root,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
    }
    kw: dict[str, Any] = {}
    if user is not None:
        kw = {"user": user, "group": user, "extra_groups": []}
    with tempfile.TemporaryFile() as stdin_file:
        stdin_file.write(stdin)
        stdin_file.seek(0)
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd,
            stdin=stdin_file,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=root,
            env=env,
            start_new_session=True,
            close_fds=True,
            **kw,
        )
    return proc, t0


def _wait(
    proc: subprocess.Popen, t0: float, limits: SandboxLimits, isolation: list[str],
    wrapped: bool = False,
) -> SandboxResult:
    """Wait for the run to end (``wrapped``: its process is ``unshare`` around the code's)
    and say how it ended."""
    pipes = _Pipes([proc.stdout, proc.stderr], limits.max_output)
    status, usage, killed_for = _wait_exit(proc, pipes, t0 + float(limits.timeout_s))
    seconds = time.monotonic() - t0
    proc.returncode = rc = os.waitstatus_to_exitcode(status)
    pipes.drain()
    out, err = pipes.text(proc.stdout), pipes.text(proc.stderr)
    if wrapped:
        rc, err = _unwrapped(rc, err)
    for stream in (proc.stdout, proc.stderr):
        if stream is not None:
            stream.close()
    cpu = usage.ru_utime + usage.ru_stime
    st, reason = _outcome(rc, cpu, err, killed_for, _cpu_limit(limits))
    return SandboxResult(
        status=st,
        stdout=out,
        stderr=err,
        returncode=rc,
        seconds=seconds,
        cpu_seconds=cpu,
        reason=reason,
        truncated=pipes.truncated,
        isolation=isolation,
    )


def _unwrapped(rc: int, err: str) -> tuple[int, str]:
    """The exit code and stderr of the code run under ``unshare``: a child killed by
    SIGKILL (the hard CPU limit, or a kill of its own) makes ``unshare`` exit 1 with
    ``UNSHARE_SIGKILL`` as its last line; that is -SIGKILL, without the line."""
    at = err.rfind(UNSHARE_SIGKILL)
    if rc == 1 and at >= 0 and "\n" not in err[at:].rstrip("\n"):
        return -signal.SIGKILL, err[:at]
    return rc, err


def _wait_exit(proc: subprocess.Popen, pipes: _Pipes, deadline: float) -> tuple[int, Any, str]:
    """Read the pipes until the process exits, its output is over the limit or the
    ``deadline`` passes; then kill its process group and reap it. ``(wait status, resource
    usage, why it was killed or "")``."""
    pidfd = _pidfd(proc.pid)
    killed_for = ""
    try:
        while True:
            # observe the exit without reaping, so the process group id stays ours meanwhile
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            if info is not None and info.si_pid == proc.pid:
                break
            if pipes.truncated:
                killed_for = "output limit"
            elif time.monotonic() >= deadline:
                killed_for = "wall-clock timeout"
            if killed_for:
                break
            wait = max(0.0, deadline - time.monotonic())
            pipes.poll(min(wait, 0.5 if pidfd is not None else 0.01), pidfd)
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # the leader is unreaped: the pgid is still ours
        except (ProcessLookupError, PermissionError):
            pass
        _, status, usage = os.wait4(proc.pid, 0)
    finally:
        if pidfd is not None:
            pipes.forget(pidfd)
            os.close(pidfd)
    return status, usage, killed_for


def _belongs(pid: int, sid: int, root: str, uid: int) -> bool:
    """Whether ``pid`` is a live process of the run: in its session ``sid``, or owned by
    ``uid`` with the run's directory ``root`` as cwd or ``HOME`` (one that left the
    session: without a PID namespace nothing else kills it)."""
    base = f"/proc/{pid}"
    try:
        with open(f"{base}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
        if fields[0] in (b"Z", b"X"):
            return False
        if int(fields[3]) == sid:
            return True
        if os.stat(base).st_uid != uid:
            return False
        cwd = os.readlink(f"{base}/cwd")
        if cwd == root or cwd.startswith(root + os.sep):
            return True
        with open(f"{base}/environ", "rb") as fh:
            return b"\0HOME=" + os.fsencode(root) + b"\0" in b"\0" + fh.read()
    except (OSError, IndexError, ValueError):
        return False


def _kill_if_still(pid: int, sid: int, root: str, uid: int) -> None:
    """SIGKILL ``pid`` if it still belongs to the run (checked through a pidfd, so a
    reused pid is never hit)."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfds on this kernel: a plain kill, after the same check
        try:
            if _belongs(pid, sid, root, uid):
                os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
        return
    try:
        if _belongs(pid, sid, root, uid):
            signal.pidfd_send_signal(fd, signal.SIGKILL)
    except OSError:
        pass
    finally:
        os.close(fd)


def _sweep(sid: int, root: str, uid: int, max_s: float = 2.0) -> int:
    """Kill the run's processes still alive after it ended (``_belongs``) and wait until
    none is left (or ``max_s`` passed); how many there were."""
    seen: set[int] = set()
    me = os.getpid()
    end = time.monotonic() + max_s
    while True:
        pids = [
            int(n) for n in os.listdir("/proc")
            if n.isdigit() and int(n) != me and _belongs(int(n), sid, root, uid)
        ]
        if not pids or time.monotonic() >= end:
            return len(seen)
        for pid in pids:
            _kill_if_still(pid, sid, root, uid)
        seen.update(pids)
        time.sleep(0.002)


def _outcome(rc: int, cpu: float, err: str, killed_for: str,
             cpu_limit: int) -> tuple[str, str]:
    """``(status, reason)`` of a run from its exit code, CPU time and stderr."""
    if killed_for == "wall-clock timeout":
        return "timeout", killed_for
    if killed_for:
        return "killed", killed_for
    if rc == CPU_EXIT or rc == -signal.SIGXCPU or (rc == -signal.SIGKILL and cpu >= cpu_limit):
        return "timeout", "cpu time limit"
    if rc == LIMIT_EXIT:
        return "limit", "process limit"
    if rc == MEMORY_EXIT or (rc != 0 and "MemoryError" in err[-2000:]):
        return "memory", "memory limit"
    if rc == SETUP_EXIT:
        return "error", "sandbox setup failed"
    if rc < 0:
        try:
            name = signal.Signals(-rc).name
        except ValueError:
            name = str(-rc)
        return "killed", f"signal {name}"
    if rc == 0:
        return "ok", ""
    return "error", f"exit status {rc}"


def run_python(
    code: str,
    stdin: str | bytes = "",
    *,
    cpu_s: float = 2.0,
    mem_mb: int = 256,
    timeout_s: float = 10.0,
    max_output: int = 64 * 1024,
    fsize_mb: int = 16,
    nofile: int = 64,
    max_procs: int = 32,
    namespaces: bool | None = None,
    audit: bool = True,
    python: str | None = None,
    drop_user: bool = True,
) -> SandboxResult:
    """Run ``code`` as a Python script in the sandbox; see the module docstring.

    ``cpu_s``: CPU-time limit (rounded up to whole seconds); ``mem_mb``: address-space
    limit; ``timeout_s``: wall-clock limit; ``max_output``: bytes kept of stdout and of
    stderr (beyond: killed); ``max_procs``: processes + threads the code may have, its
    main thread included (``RLIMIT_NPROC``, see the module docstring). ``namespaces``:
    None uses user/network/PID namespaces when they work here, True requires them
    (``SandboxError`` otherwise), False turns them off.
    ``audit``: install the audit hook. ``python``: interpreter (default
    ``sys.executable``). ``drop_user``: run as ``nobody`` when the caller is root.
    ``namespaces=False`` / ``audit=False`` exist to test each layer on its own.
    """
    limits = SandboxLimits(cpu_s, mem_mb, timeout_s, max_output, fsize_mb, nofile, max_procs)
    data = stdin.encode("utf-8") if isinstance(stdin, str) else bytes(stdin)
    return run_sandboxed(code, data, "script", "", "", limits, namespaces, audit, python, drop_user)


__all__ = [
    "STATUSES",
    "SandboxError",
    "SandboxLimits",
    "SandboxResult",
    "interpreter_and_user",
    "namespace_prefix",
    "run_python",
    "run_sandboxed",
]
