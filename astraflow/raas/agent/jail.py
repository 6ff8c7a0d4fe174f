"""The jail every agent command runs in: its own processes, files, user and network.

An agent command is harness code, but what it does is steered by model output (a coding
agent runs the shell commands the model writes), so whatever it can reach, the policy can
learn to reach. The node starts each command as

    unshare [-r] -m -p -f --mount-proc --kill-child [-n] PYTHON -S jail.py --config-fd N

and this file, run by its path (stdlib only: it starts in the time a bare Python does),
is the namespace's first process. Before the command runs it:

- **mounts** (a mount namespace of its own, so nothing leaks back to the node): a fresh
  ``/proc`` of the new PID namespace, where no process but the episode's own is listed
  (so no other program's environment or memory can be found); an empty tmpfs over
  ``/tmp``, ``/var/tmp``, ``/dev/shm``, ``/run``, ``/root``, ``/home``, the node's ``HOME``
  and working directory, with only the paths the command needs bound back (its
  interpreter's prefixes, the directories of the files on its command line, the node's
  endpoint socket); ``/dev/null`` over each of the node's secret files (a file named by
  the node's environment in a variable that says PASSWORD, SECRET, TOKEN, KEY or
  CREDENTIAL);
- **network** (``-n``, unless the workflow's ``limits.network`` is true): a namespace with
  only a loopback device, where a forwarder listens on ``127.0.0.1`` at the endpoint's
  port and passes each connection through a Unix socket to the node (``UnixBridge``): the
  command reaches its endpoint at the same URL and nothing else, not the Kafka broker on
  the node's localhost either;
- **user**: when the node is root, the command runs as a uid of its own (one per
  concurrent episode, no supplementary groups), so the node's root-only files stay
  closed and ``RLIMIT_NPROC`` binds; otherwise (``-r``) as the node's uid with every
  capability dropped (an empty bounding set and ``no_new_privs``), so it cannot undo the
  mounts;
- **limits**, set before the command's first instruction and inherited by its children:
  ``RLIMIT_CPU`` (``cpu_s``), ``RLIMIT_AS`` (``mem_mb``), ``RLIMIT_NPROC`` (``max_procs``
  tasks, its main thread included; without root the forwarder's threads count too);
- an **environment** built from nothing: the node hands over exactly the variables the
  command gets (``program.py``), through a pipe rather than the command line.

With ``isolate: false`` (for machines that cannot make namespaces, e.g. a container
without ``CAP_SYS_ADMIN``), the same script only sets the limits and the environment and
runs the command as the node's user: it can then read what the node can, so that is for
trusted programs only.
"""

from __future__ import annotations

import ctypes
import fcntl
import json
import os
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

SCRIPT = Path(__file__).resolve()
SAFE_PATH = "/usr/local/bin:/usr/bin:/bin"
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_MS_BIND, _MS_REC = 0x1000, 0x4000
_PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 24, 38
# the directories a command never sees as the node has them (an empty tmpfs instead)
HIDDEN = ("/tmp", "/var/tmp", "/dev/shm", "/run", "/root", "/home")
_SECRET_NAME = re.compile(r"PASSWORD|SECRET|TOKEN|KEY|CREDENTIAL", re.I)


# --- the node's side -----------------------------------------------------------------------
def _pipe(src: socket.socket, dst: socket.socket) -> None:
    """Bytes from ``src`` to ``dst`` until ``src`` ends; then ``dst``'s write side ends."""
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        try:
            dst.shutdown(socket.SHUT_WR)
        except OSError:
            pass


def _splice(a: socket.socket, b: socket.socket) -> None:
    """Both directions between two connected sockets, each in a thread; closes both."""
    back = threading.Thread(target=_pipe, args=(b, a), daemon=True)
    back.start()
    _pipe(a, b)
    back.join()
    a.close()
    b.close()


def _serve(listener: socket.socket, connect: Callable[[], socket.socket]) -> None:
    """Accepts on ``listener`` until it closes; each connection spliced to ``connect()``."""
    while True:
        try:
            conn, _ = listener.accept()
        except OSError:
            return
        try:
            other = connect()
        except OSError:
            conn.close()
            continue
        threading.Thread(target=_splice, args=(conn, other), daemon=True).start()


class UnixBridge:
    """The node's side of a jail's network: a Unix socket (in a private temporary
    directory) whose connections are forwarded to the endpoint at ``host:port``."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.dir = tempfile.mkdtemp(prefix="astraflow-agent-")
        self.path = os.path.join(self.dir, "endpoint.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        threading.Thread(target=_serve, args=(self._sock, self._connect), daemon=True,
                         name="agent-unix-bridge").start()

    def _connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port))

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self.dir, ignore_errors=True)


def unshare_argv(network: bool) -> list[str]:
    """The ``unshare`` that makes a jail's namespaces (``network`` False: a network
    namespace too); without root, a user namespace where the node's uid is root."""
    unshare = shutil.which("unshare") or "unshare"
    user = [] if os.geteuid() == 0 else ["-r"]
    return [unshare, *user, "-m", "-p", "-f", "--mount-proc", "--kill-child",
            *([] if network else ["-n"])]


def jail_argv(isolate: bool, network: bool, config_fd: int) -> list[str]:
    """The command line that starts a jail reading its config from ``config_fd``."""
    prefix = unshare_argv(network) if isolate else []
    return [*prefix, sys.executable, "-S", str(SCRIPT), "--config-fd", str(config_fd)]


def run_jailed(config: Mapping[str, Any], isolate: bool, network: bool,
               stdin: Any = subprocess.PIPE) -> subprocess.Popen:
    """Start a jail with ``config`` (``config()`` builds it), in a session of its own, its
    output piped."""
    r, w = os.pipe()
    try:
        proc = subprocess.Popen(jail_argv(isolate, network, r), stdin=stdin,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                env={"PATH": SAFE_PATH, "LANG": "C.UTF-8"}, text=True,
                                start_new_session=True, pass_fds=(r,), cwd="/")
    finally:
        os.close(r)
    with os.fdopen(w, "w") as fh:  # a pipe holds 64 KiB: the config is far smaller
        json.dump(dict(config), fh)
    return proc


def interpreter_paths() -> list[str]:
    """What a command run by the node's interpreter needs to see: its prefixes and the
    directory of its executable (a virtual environment's links point out of it)."""
    exe = os.path.realpath(sys.executable)
    return sorted({sys.prefix, sys.base_prefix, sys.exec_prefix, os.path.dirname(exe)})


def secret_files(environ: Mapping[str, str]) -> list[str]:
    """The files the node's environment names in a variable that says PASSWORD, SECRET,
    TOKEN, KEY or CREDENTIAL (blanked in a jail)."""
    return sorted({os.path.realpath(v) for k, v in environ.items()
                   if _SECRET_NAME.search(k) and v.startswith("/") and os.path.isfile(v)})


def hidden_dirs(home: str, cwd: str) -> list[str]:
    """The directories covered by an empty tmpfs in a jail: ``HIDDEN``, the node's home and
    working directory (not ``/`` nor a system directory), those that exist, outermost
    first, none inside another."""
    system = ("/", "/usr", "/bin", "/lib", "/lib64", "/etc", "/opt", "/var", "/proc", "/dev")
    dirs = [d for d in {*HIDDEN, home, cwd} if d and os.path.isdir(d)
            and os.path.realpath(d) not in system]
    out: list[str] = []
    for d in sorted({os.path.realpath(d) for d in dirs}, key=len):
        if not any(d == o or d.startswith(o.rstrip("/") + "/") for o in out):
            out.append(d)
    return out


def config(argv: Sequence[str], env: Mapping[str, str], *, uid: int | None,
           limits: Mapping[str, Any], keep: Iterable[str] = (), blank: Iterable[str] = (),
           hide: Iterable[str] = (), bridge: tuple[str, int] | None = None,
           tmpfs_mb: int = 256) -> dict[str, Any]:
    """What a jail reads: the command and its environment, the uid to run it as (None:
    stay), its limits (``cpu_s``, ``mem_mb``, ``max_procs``), the directories to hide and
    the paths to keep, the files to blank, the Unix socket and port of its endpoint when it
    has no network, and the size of its ``/tmp``."""
    return {"argv": list(argv), "env": dict(env), "uid": uid, "limits": dict(limits),
            "keep": sorted(set(keep)), "blank": sorted(set(blank)), "hide": list(hide),
            "bridge": list(bridge) if bridge else None, "tmpfs_mb": int(tmpfs_mb)}


def probe(isolate: bool, network: bool) -> str | None:
    """Why a jail cannot run here with these settings (no ``unshare``, namespaces or
    mounts refused), else None: a jailed ``true`` must end well."""
    if isolate and shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    true = shutil.which("true", path=SAFE_PATH) or "/bin/true"
    cfg = config([true], {"PATH": SAFE_PATH}, uid=None, limits={}, hide=["/tmp"])
    try:
        proc = run_jailed(cfg, isolate, network, stdin=subprocess.DEVNULL)
        _, err = proc.communicate(timeout=20)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"the jail did not start: {e}"
    if proc.returncode != 0:
        return (f"{' '.join(unshare_argv(network)) if isolate else 'the jail'} failed: "
                f"{err.strip().splitlines()[-1] if err.strip() else proc.returncode}")
    return None


# --- inside the namespaces ------------------------------------------------------------------
def _libc() -> Any:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong,
                           ctypes.c_char_p]
    libc.prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong,
                           ctypes.c_ulong]
    return libc


def _mount(libc: Any, source: str, target: str, fstype: str | None, flags: int,
           data: str | None = None) -> None:
    if libc.mount(source.encode(), target.encode(), fstype.encode() if fstype else None,
                  flags, data.encode() if data else None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"mount {source} on {target}: {os.strerror(e)}")


def _hide(libc: Any, cfg: Mapping[str, Any]) -> None:
    """The jail's view of the files: hidden directories empty, kept paths bound back,
    secret files blank."""
    hide = list(cfg["hide"])
    keep = [p for p in cfg["keep"] if os.path.exists(p)
            and any(p == h or p.startswith(h.rstrip("/") + "/") for h in hide)]
    held = {p: os.open(p, os.O_PATH) for p in keep}  # still reachable once covered
    for d in hide:
        _mount(libc, "tmpfs", d, "tmpfs", 0, f"mode=1777,size={int(cfg['tmpfs_mb'])}m")
    for p, fd in sorted(held.items(), key=lambda kv: len(kv[0])):
        if os.path.isdir(f"/proc/self/fd/{fd}"):
            os.makedirs(p, mode=0o755, exist_ok=True)
        else:
            os.makedirs(os.path.dirname(p), mode=0o755, exist_ok=True)
            open(p, "a").close()
        _mount(libc, f"/proc/self/fd/{fd}", p, None, _MS_BIND | _MS_REC)
        os.close(fd)
    for f in cfg["blank"]:
        if os.path.isfile(f):
            _mount(libc, "/dev/null", f, None, _MS_BIND)


def _loopback_up() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))
        flags = struct.unpack("16sH", ifr[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
    finally:
        s.close()


def _tasks_here() -> int:
    """Tasks (threads) of this PID namespace, as its fresh ``/proc`` lists them."""
    n = 0
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                n += len(os.listdir(f"/proc/{pid}/task"))
            except OSError:
                pass
    return n


def _uid_tasks() -> int:
    """Tasks (threads) of this process's uid, all PID namespaces it can see."""
    uid, n = str(os.getuid()), 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as fh:
                fields = dict(line.split(":", 1) for line in fh if ":" in line)
        except (OSError, ValueError):
            continue
        if fields.get("Uid", "").split()[:1] == [uid]:
            n += int(fields.get("Threads", "1"))
    return n


def _become(libc: Any, cfg: Mapping[str, Any], isolated: bool) -> None:
    """In the forked child: the limits, then the command's user (or no capabilities)."""
    lim = cfg["limits"]
    if lim.get("cpu_s") is not None:
        cpu = max(1, int(-(-float(lim["cpu_s"]) // 1)))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if lim.get("mem_mb") is not None:
        b = int(lim["mem_mb"]) << 20
        resource.setrlimit(resource.RLIMIT_AS, (b, b))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    uid = cfg["uid"]
    if lim.get("max_procs") is not None:
        # the kernel counts tasks per uid and user namespace, this child's among them: a
        # uid of its own has none before it; the node's uid in a new user namespace has
        # the unshare process (outside the PID namespace) and this namespace's tasks;
        # without namespaces, every task of the uid
        if uid is not None:
            base = 0
        elif isolated:
            base = _tasks_here()
        else:
            base = _uid_tasks() - 1
        n = int(lim["max_procs"]) + base
        resource.setrlimit(resource.RLIMIT_NPROC, (n, n))
    if uid is not None:
        os.setgroups([])
        os.setgid(uid)
        os.setuid(uid)
    elif isolated:
        for cap in range(64):  # past the kernel's last capability prctl fails: harmless
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)


def jail(cfg: Mapping[str, Any], isolated: bool) -> int:
    """The namespace's first process: files, network, then the command in a child, run to
    its end; its exit code (a signal that killed it: outside namespaces the jail dies of
    the same signal, inside 128 + the signal)."""
    libc = _libc()
    if isolated:
        _hide(libc, cfg)
    listener = None
    if cfg["bridge"]:
        unix_path, port = cfg["bridge"]
        _loopback_up()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.bind(("127.0.0.1", int(port)))
        listener.listen(64)
    env = dict(cfg["env"])
    home = env.get("HOME") or "/tmp"
    os.makedirs(home, mode=0o700, exist_ok=True)
    if cfg["uid"] is not None:
        os.chown(home, cfg["uid"], cfg["uid"])
    pid = os.fork()  # before any thread: the child runs no Python but ours until exec
    if pid == 0:
        try:
            if listener is not None:
                listener.close()
            _become(libc, cfg, isolated)
            os.chdir(home)
            os.execvpe(cfg["argv"][0], cfg["argv"], env)
        except BaseException as e:  # noqa: BLE001 - told to the node on stderr
            os.write(2, f"agent jail: cannot start {cfg['argv'][0]!r}: {e}\n".encode())
        os._exit(127)
    if listener is not None:
        def connect() -> socket.socket:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(unix_path)
            return s

        threading.Thread(target=_serve, args=(listener, connect), daemon=True).start()
    _, status = os.waitpid(pid, 0)
    code = os.waitstatus_to_exitcode(status)
    if code < 0 and not isolated:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    # the first process of a PID namespace cannot signal itself: 128 + the signal, as a
    # shell says it
    return 128 - code if code < 0 else code


def main(args: Sequence[str]) -> int:
    if len(args) != 2 or args[0] != "--config-fd":
        sys.exit("usage: jail.py --config-fd N")
    with os.fdopen(int(args[1])) as fh:
        cfg = json.load(fh)
    # pid 1 of a new PID namespace: the jail of unshare; else run as a plain process
    return jail(cfg, isolated=os.getpid() == 1)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
