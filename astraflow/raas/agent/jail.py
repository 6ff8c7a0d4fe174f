"""An agent command with no network but its endpoint (``limits: {network: false}``).

The command runs in a network namespace of its own (``unshare -r -n``: a new user and
network namespace, which needs no privilege where unprivileged user namespaces are on),
so it reaches no address at all, not even the host's localhost, except one: inside the
namespace, this file runs as a script (``jail``) that brings the loopback device up,
listens on ``127.0.0.1`` at the endpoint's own port and forwards each connection to a
Unix socket. Unix sockets are files, not network, so they cross namespaces; the node
side (``UnixBridge``) forwards from that socket to the endpoint. The program's
``OPENAI_BASE_URL`` is therefore the same URL as without the jail.

Stdlib only, and run by its path rather than ``-m``: the jail starts in the time a bare
Python does, without importing AstraFlow.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

SCRIPT = Path(__file__).resolve()
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1


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
    """The node's side: a Unix socket (in a private temporary directory) whose
    connections are forwarded to the endpoint at ``host:port``."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self._dir = tempfile.mkdtemp(prefix="astraflow-agent-")
        self.path = os.path.join(self._dir, "endpoint.sock")
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._sock.bind(self.path)
        self._sock.listen(64)
        threading.Thread(target=_serve, args=(self._sock, self._connect), daemon=True,
                         name="agent-unix-bridge").start()

    def _connect(self) -> socket.socket:
        return socket.create_connection((self.host, self.port))

    def close(self) -> None:
        self._sock.close()
        shutil.rmtree(self._dir, ignore_errors=True)


def jail_argv(unix_path: str, port: int, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` in the jail (``unshare`` and this script)."""
    unshare = shutil.which("unshare") or "unshare"
    return [unshare, "-r", "-n", sys.executable, "-S", str(SCRIPT), unix_path, str(port),
            "--", *argv]


def probe() -> str | None:
    """Why the jail cannot run here (no ``unshare``, or namespaces refused), else None."""
    if shutil.which("unshare") is None:
        return "unshare (util-linux) is not installed"
    try:
        r = subprocess.run(["unshare", "-r", "-n", "true"], capture_output=True, text=True,
                           timeout=10)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare -r -n failed: {e}"
    if r.returncode != 0:
        return f"unshare -r -n failed: {r.stderr.strip() or f'exit code {r.returncode}'}"
    return None


def _loopback_up() -> None:
    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = fcntl.ioctl(s, _SIOCGIFFLAGS, struct.pack("16sH", b"lo", 0))
        flags = struct.unpack("16sH", ifr[:18])[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH", b"lo", flags | _IFF_UP))
    finally:
        s.close()


def jail(unix_path: str, port: int, argv: list[str]) -> int:
    """Inside the namespace: loopback up, ``127.0.0.1:port`` forwarded to ``unix_path``,
    then ``argv`` run to its end; its exit code (a signal that killed it kills the jail
    with the same signal, so the node sees what the program saw)."""
    _loopback_up()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)

    def connect() -> socket.socket:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.connect(unix_path)
        return s

    threading.Thread(target=_serve, args=(listener, connect), daemon=True).start()
    code = subprocess.call(argv)
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code


if __name__ == "__main__":
    try:
        sep = sys.argv.index("--")
        path, port_text = sys.argv[1:sep]
        port, command = int(port_text), sys.argv[sep + 1:]
    except ValueError:
        sys.exit("usage: netjail.py UNIX_PATH PORT -- COMMAND...")
    if not command:
        sys.exit("netjail.py: no command")
    sys.exit(jail(path, port, command))
