"""Answer equivalence by math-verify (Hugging Face's answer-verification library), run in a
child process that is killed when it takes too long.

``math_verify.parse`` pulls the final answer out of a completion (``\\boxed{18}``, ``The
answer is 18.``, ``$18.00``, ``1,080``, ``\\frac{36}{2}``) as a SymPy object and
``math_verify.verify`` compares it with the gold answer. Both can hang on hostile input:
``9**9**9**9 + 1`` makes SymPy compute a power with billions of digits inside one C call.
math-verify's own timeout is ``signal.alarm``, which cannot interrupt a C call, only works
in the main thread (RaaS nodes and processors may score in others) and replaces the
process's SIGALRM handler meanwhile. So its timeouts are turned off here and the work runs
in a child process instead (``python -m astraflow.tasks.mathverify``, started on the first
question and kept): when an answer takes longer than ``timeout_s`` the child is killed, the
answer counts as wrong and the next question starts a new child. The child's address space
is limited (``mem_mb``), so a huge number fails fast with ``MemoryError`` (also wrong).

Needs ``pip install math-verify`` (the ``math`` extra); ``require_math_verify`` says so in
one line when it is missing.
"""

from __future__ import annotations

import importlib.util
import json
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path

from astraflow.errors import AstraflowError

MODULE = "math_verify"  # what require_math_verify looks for
INSTALL = "python3 -m pip install math-verify"
START_TIMEOUT_S = 120.0  # importing SymPy on a busy machine; no question is timed meanwhile


class MathVerifyError(AstraflowError, RuntimeError):
    """math-verify is not installed, or its child process could not be started."""


def require_math_verify() -> None:
    """``MathVerifyError`` naming the install command when math-verify is missing (found
    without importing it: SymPy is slow to import)."""
    if importlib.util.find_spec(MODULE) is None:
        raise MathVerifyError(f"the math_verify reward needs math-verify: {INSTALL}")


def final_answer_text(completion: str, marker: str = "####") -> str:
    """The part of a completion that holds its final answer: the rest of the line after
    the last ``marker`` when there is one (a GSM8K solution ends in ``#### 18``; what the
    model adds after that line is not its answer), else the whole completion."""
    if marker and marker in completion:
        tail = completion.rsplit(marker, 1)[1].lstrip()
        return tail.split("\n", 1)[0]
    return completion


class AnswerVerifier:
    """``verifier(gold, text)``: whether math-verify finds in ``text`` an answer equal to
    ``gold`` (an answer string such as ``"18"``), within ``timeout_s`` seconds.

    Thread-safe (questions are answered one at a time by one child process); ``timeouts``
    counts the questions that ran out of time. ``close()`` ends the child (it also ends
    when this object is collected, or when its parent exits and its input closes).
    """

    def __init__(self, timeout_s: float = 5.0, mem_mb: int = 1024) -> None:
        if timeout_s <= 0:
            raise ValueError(f"math-verify timeout_s must be positive, not {timeout_s}")
        if mem_mb < 256:
            raise ValueError(f"math-verify mem_mb must be at least 256, not {mem_mb}")
        require_math_verify()
        self.timeout_s = float(timeout_s)
        self.mem_mb = int(mem_mb)
        self.timeouts = 0
        self._lock = threading.Lock()
        self._proc: subprocess.Popen[bytes] | None = None
        self._buffer = b""
        self._finalizer: weakref.finalize | None = None

    def __call__(self, gold: str, text: str) -> bool:
        with self._lock:
            proc = self._child()
            assert proc.stdin is not None
            try:
                proc.stdin.write(json.dumps({"gold": gold, "text": text}).encode() + b"\n")
                proc.stdin.flush()
                line = self._read_line(time.monotonic() + self.timeout_s)
            except (BrokenPipeError, OSError):  # the child died (killed from outside)
                line = None
            if line is None:
                if proc.poll() is None:  # still at it: out of time (else it died)
                    self.timeouts += 1
                self._stop()
                return False
            return bool(json.loads(line)["ok"])

    def close(self) -> None:
        """End the child process (a later question starts a new one)."""
        with self._lock:
            self._stop()

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._stop()
        package_root = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (package_root, env.get("PYTHONPATH")) if p)
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "astraflow.tasks.mathverify", str(self.mem_mb)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        self._finalizer = weakref.finalize(self, _kill, self._proc)
        ready = self._read_line(time.monotonic() + START_TIMEOUT_S)
        if ready is None or not json.loads(ready).get("ready"):
            code = self._proc.poll()
            why = (json.loads(ready).get("error") if ready else
                   f"it exited with status {code}" if code is not None else
                   f"no answer in {START_TIMEOUT_S:.0f} s")
            self._stop()
            raise MathVerifyError(f"math-verify's child process did not start: {why}")
        return self._proc

    def _read_line(self, deadline: float) -> bytes | None:
        """The child's next line, None when it ends or ``deadline`` passes first."""
        assert self._proc is not None and self._proc.stdout is not None
        fd = self._proc.stdout.fileno()
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _stop(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills and reaps the child
            self._finalizer = None
        self._proc = None
        self._buffer = b""


def _kill(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait()
    for f in (proc.stdin, proc.stdout):
        if f is not None:
            f.close()


def serve(mem_mb: int) -> None:
    """The child: answer ``{"gold", "text"}`` lines on stdin with ``{"ok"}`` lines on
    stdout, after a ``{"ready"}`` line (or an ``{"error"}`` one), until stdin closes."""
    import logging

    # the answers go to the real stdout; anything a library prints goes to stderr instead
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    try:
        from math_verify import parse, verify
    except ImportError as e:
        out.write(json.dumps({"error": f"{e} ({INSTALL})"}) + "\n")
        out.flush()
        return
    # its warnings say that timeouts are off: the parent keeps the time
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    try:
        import resource

        limit = mem_mb * 1024 * 1024
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    except (ImportError, ValueError, OSError):  # no such limit here: the timeout still holds
        pass
    golds: dict[str, list] = {}  # parsed gold answers: one per problem of the dataset
    out.write(json.dumps({"ready": True}) + "\n")
    out.flush()
    for line in sys.stdin:
        try:
            q = json.loads(line)
            gold = golds.get(q["gold"])
            if gold is None:
                gold = golds[q["gold"]] = parse(q["gold"], parsing_timeout=None)
            ok = bool(gold) and verify(gold, parse(q["text"], parsing_timeout=None),
                                       timeout_seconds=None)
        except Exception:  # MemoryError among them: an answer beyond the limits is wrong
            ok = False
        out.write(json.dumps({"ok": bool(ok)}) + "\n")
        out.flush()


__all__ = ["INSTALL", "MODULE", "AnswerVerifier", "MathVerifyError", "final_answer_text",
           "require_math_verify", "serve"]


if __name__ == "__main__":
    serve(int(sys.argv[1]) if len(sys.argv) > 1 else 1024)
