"""The code sandbox: limits, kills, network blocking, temp dir, environment.

Each protection is checked against a control where it matters: the same network probe
connects when every layer is off, so a sandbox that let it through would fail the test.
A kill is checked by its mechanism (the limit that fired, the reason and exit signal the
result records), never by how long it took: that is measured by ``bench/sandbox.py``.
The ``timeout_s`` of a run that must end otherwise is only a guard against a hang.
"""

from __future__ import annotations

import os
import signal
import socket
import threading
from collections.abc import Iterator

import pytest

from astraflow.sandbox import (
    STATUSES,
    check_cases,
    interpreter_and_user,
    namespace_prefix,
    run_function,
    run_python,
)
from astraflow.sandbox.child import CPU_EXIT
from tests.conftest import wait_for

HAVE_NAMESPACES = bool(namespace_prefix(*interpreter_and_user()))
# the kernel exempts uid 0 from RLIMIT_NPROC: the process limit needs a sandbox uid != 0
SANDBOX_UID = interpreter_and_user()[1]
HAVE_NPROC = (os.getuid() if SANDBOX_UID is None else SANDBOX_UID) != 0
NS_MODES = [
    pytest.param(True, id="userns", marks=pytest.mark.skipif(
        not HAVE_NAMESPACES, reason="unshare does not work unprivileged here")),
    pytest.param(False, id="no-namespaces"),
]


def test_normal_code_runs_with_stdin_and_a_scrubbed_environment(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_TEST_SECRET", "hunter2")
    r = run_python(
        "import os, sys\n"
        "print(input()[::-1])\n"
        "print(sorted(os.environ))\n"
        "print(os.environ.get('ASTRAFLOW_TEST_SECRET'))\n"
        "print(sys.flags.isolated, sys.flags.no_site)\n"
        "sys.stderr.write('note\\n')",
        stdin="olleh\n",
    )
    assert r.status == "ok" and r.returncode == 0, r
    lines = r.stdout.splitlines()
    assert lines[0] == "hello"
    assert lines[1] == "['HOME', 'LANG', 'LC_ALL', 'PATH', 'TMPDIR']"
    assert lines[2] == "None"
    assert lines[3] == "1 1"
    assert r.stderr == "note\n"
    err = run_python("raise ValueError('boom')")
    assert err.status == "error" and err.returncode == 1 and "ValueError: boom" in err.stderr


def test_busy_loop_is_stopped_by_the_cpu_limit():
    r = run_python("while True:\n    pass", cpu_s=1, timeout_s=120)
    # the kernel's SIGXCPU at the soft limit (RLIMIT_CPU, 1 s), caught by the preamble's
    # handler, which exits with CPU_EXIT: no other path gives that exit code
    assert r.status == "timeout" and r.reason == "cpu time limit", r
    assert r.returncode == CPU_EXIT and "sandbox: cpu time limit" in r.stderr


@pytest.mark.parametrize("namespaces", NS_MODES)
def test_code_that_ignores_the_cpu_signal_is_killed_at_the_hard_cpu_limit(namespaces):
    code = "import signal\nsignal.signal(signal.SIGXCPU, signal.SIG_IGN)\nwhile True:\n    pass"
    r = run_python(code, cpu_s=1, timeout_s=120, namespaces=namespaces)
    # SIGKILL from the kernel at the hard limit (soft + 1 s): not the wall clock's kill
    assert r.status == "timeout" and r.reason == "cpu time limit", r
    assert r.returncode == -signal.SIGKILL and r.stderr == "", r


def test_sleeping_code_is_killed_at_the_wall_clock_limit():
    r = run_python("import time\nprint('started', flush=True)\ntime.sleep(600)", timeout_s=1)
    assert r.status == "timeout" and r.reason == "wall-clock timeout", r
    assert r.returncode == -signal.SIGKILL  # the group kill, not an exit of its own
    assert r.stdout == "started\n"
    assert r.seconds >= 1  # never before the limit (only checked after the deadline)


def test_whole_process_group_is_killed():
    # layers off so the code may fork: the forked child sleeps in the same process group
    code = (
        "import os, time\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    time.sleep(600)\n"
        "    os._exit(0)\n"
        "print(pid, flush=True)\n"
        "time.sleep(600)"
    )
    r = run_python(code, timeout_s=1, audit=False, namespaces=False)
    assert r.status == "timeout" and r.returncode == -signal.SIGKILL, r
    child = int(r.stdout.split()[0])
    wait_for(lambda: not _alive(child), 5, f"the forked child {child} to be killed", step=0.05)


@pytest.mark.skipif(not HAVE_NAMESPACES, reason="unshare does not work unprivileged here")
def test_pid_namespace_kills_a_child_that_left_the_process_group():
    # the child starts its own session (out of the group killpg reaches); its host pid is
    # what /proc/self points to, since /proc is the host's
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.write(w, os.readlink('/proc/self').encode())\n"
        "    time.sleep(600)\n"
        "    os._exit(0)\n"
        "print(os.read(r, 100).decode(), flush=True)\n"
        "time.sleep(600)"
    )
    r = run_python(code, timeout_s=1, audit=False, namespaces=True)
    assert r.status == "timeout" and r.reason == "wall-clock timeout", r
    child = int(r.stdout.split()[0])
    wait_for(lambda: not _alive(child), 5, f"the forked child {child} to be killed", step=0.05)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_memory_hog_is_stopped():
    big = run_python("x = bytearray(512 * 2 ** 20)\nprint(len(x))", mem_mb=128)
    assert big.status == "memory", big
    r = run_python(
        "chunks = []\nwhile True:\n    chunks.append(bytearray(10 ** 6))", mem_mb=128, timeout_s=30
    )
    assert r.status == "memory", r
    fits = run_python("x = bytearray(32 * 2 ** 20)\nprint(len(x))", mem_mb=128)
    assert fits.status == "ok" and fits.stdout.strip() == str(32 * 2**20), fits


@pytest.fixture
def listening_port() -> Iterator[int]:
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(8)
    accepted: list[socket.socket] = []

    def serve() -> None:
        while True:
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            accepted.append(conn)

    threading.Thread(target=serve, daemon=True).start()
    yield srv.getsockname()[1]
    srv.close()
    for c in accepted:
        c.close()


def _connect_code(port: int) -> str:
    return (
        f"import socket\ns = socket.create_connection(('127.0.0.1', {port}), 3)\nprint('CONNECTED')"
    )


def test_network_is_blocked(listening_port):
    code = _connect_code(listening_port)
    # control: with every layer off the same code reaches the listening port
    control = run_python(code, audit=False, namespaces=False)
    assert control.status == "ok" and "CONNECTED" in control.stdout, control
    # the default sandbox
    r = run_python(code)
    assert r.status == "error" and "CONNECTED" not in r.stdout, r
    # the audit hook alone
    hook = run_python(code, namespaces=False)
    assert hook.status == "error" and "CONNECTED" not in hook.stdout
    assert "not allowed" in hook.stderr
    # a socket made without importing the socket module is refused as well
    raw = run_python(
        f"import _socket\ns = _socket.socket()\ns.connect(('127.0.0.1', {listening_port}))\n"
        "print('CONNECTED')",
        namespaces=False,
    )
    assert raw.status == "error" and "CONNECTED" not in raw.stdout


@pytest.mark.skipif(not HAVE_NAMESPACES, reason="unshare does not work unprivileged here")
def test_network_namespace_alone_blocks_the_network(listening_port):
    r = run_python(_connect_code(listening_port), audit=False, namespaces=True)
    assert r.status == "error" and "CONNECTED" not in r.stdout, r
    assert "netns" in r.isolation and "audit-hook" not in r.isolation
    assert "unreachable" in r.stderr or "Errno" in r.stderr


def test_temp_dir_is_fresh_and_removed():
    code = (
        "import os\n"
        "print(os.getcwd())\n"
        "print(sorted(os.listdir('.')))\n"
        "open('out.txt', 'w').write('x' * 1000)\n"
        "os.mkdir('locked')\n"
        "open('locked/inner.txt', 'w').write('y')\n"
        "os.chmod('locked', 0)\n"
    )
    first = run_python(code)
    second = run_python(code)
    assert first.status == "ok" and second.status == "ok", (first, second)
    d1, d2 = first.stdout.splitlines()[0], second.stdout.splitlines()[0]
    assert d1 != d2
    assert first.stdout.splitlines()[1] == "['main.py']"  # nothing left from other runs
    assert not os.path.exists(d1) and not os.path.exists(d2)


def test_writes_outside_the_sandbox_dir_are_refused(tmp_path):
    target = tmp_path / "outside.txt"
    r = run_python(f"open({str(target)!r}, 'w').write('x')")
    assert r.status == "error" and "not allowed" in r.stderr, r
    assert not target.exists()
    spawn = run_python("import os\nos.system('true')")
    assert spawn.status == "error" and "os.system is not allowed" in spawn.stderr


def test_output_is_capped():
    r = run_python("while True:\n    print('x' * 1000)", max_output=10_000, timeout_s=30)
    assert r.status == "killed" and r.reason == "output limit" and r.truncated, r
    assert len(r.stdout) == 10_000


def test_function_against_cases():
    code = "def f(x, y):\n    print('noise')\n    return [x + y] if x != -1 else 1 // 0\n"
    run = run_function(code, "f", [[1, 2], [-1, 2], ["a", "b"], [1, None]])
    assert run.result.status == "ok"
    assert [c.ok if c else None for c in run.cases] == [True, False, True, False]
    assert run.cases[0].value == [3] and run.cases[2].value == ["ab"]
    assert "ZeroDivisionError" in run.cases[1].error
    assert "noise" in run.result.stdout  # the code's own output, without the results
    report = check_cases(code, "f", [([1, 2], (3,)), ([0, 0], [1]), ([-1, 0], 0)])
    assert report.passed == [True, False, False]
    assert report.fraction == pytest.approx(1 / 3) and not report.all_passed
    # a call that never returns stops the process; the calls before it keep their results
    slow = run_function(
        "def f(x):\n    while x:\n        pass\n    return 0", "f", [[0], [1], [0]], cpu_s=1
    )
    assert slow.result.status == "timeout"
    assert slow.cases[0] is not None and slow.cases[0].value == 0
    assert slow.cases[1] is None and slow.cases[2] is None
    missing = run_function("g = 1", "f", [[1]])
    assert missing.result.status == "error" and missing.cases == [None]


# --- bombs: process, thread and memory limits, and no survivors ----------------------------
def _procs_in(directory: str) -> list[int]:
    """Live processes whose working directory is (or was, before its removal) ``directory``:
    the code of a run, whatever session or PID namespace it is in."""
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{name}/cwd").removesuffix(" (deleted)")
        except OSError:
            continue
        if (cwd == directory or cwd.startswith(directory + "/")) and _alive(int(name)):
            found.append(int(name))
    return found


def _caller_keeps_working() -> None:
    t = threading.Thread(target=lambda: None)
    t.start()
    t.join()
    r = run_python("print(6 * 7)")
    assert r.status == "ok" and r.stdout == "42\n", r


FORK_BOMB = "import os\nprint(os.getcwd(), flush=True)\nwhile True:\n    os.fork()\n"
THREAD_BOMB = (
    "import os, threading\n"
    "print(os.getcwd(), flush=True)\n"
    "stop = threading.Event()\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        threading.Thread(target=stop.wait).start()\n"
    "        n += 1\n"
    "finally:\n"
    "    print(n, flush=True)\n"
)


def test_limits_are_on_by_default_and_cannot_be_turned_off():
    code = (
        "import resource\n"
        "print(resource.getrlimit(resource.RLIMIT_AS), resource.getrlimit(resource.RLIMIT_NPROC),"
        " resource.getrlimit(resource.RLIMIT_CPU))"
    )
    r = run_python(code)
    assert r.status == "ok", r
    as_limit, nproc, cpu = r.stdout.strip().split(") (")
    assert as_limit == f"({256 << 20}, {256 << 20}"
    assert cpu == "2, 3)"  # cpu_s 2: SIGXCPU at 2 s of CPU, SIGKILL at 3
    if HAVE_NAMESPACES:  # max_procs + the unshare process, counted in the run's namespace
        assert nproc == "33, 33"
    assert "limit" in STATUSES
    for bad in ({"mem_mb": 0}, {"max_procs": 0}):
        with pytest.raises(ValueError, match="at least 1"):
            run_python("pass", **bad)


def test_fork_bomb_is_refused_by_the_audit_hook():
    r = run_python(FORK_BOMB, timeout_s=5)
    assert r.status == "error" and "os.fork is not allowed" in r.stderr, r
    assert _procs_in(r.stdout.split()[0]) == []


@pytest.mark.skipif(not HAVE_NPROC, reason="the sandbox runs as uid 0, exempt from RLIMIT_NPROC")
@pytest.mark.parametrize("namespaces", NS_MODES)
def test_fork_bomb_is_stopped_by_the_kernel_process_limit(namespaces):
    # the audit hook off: only RLIMIT_NPROC stands between the bomb and the machine
    r = run_python(FORK_BOMB, audit=False, namespaces=namespaces, max_procs=8, timeout_s=30)
    assert r.status == "limit" and r.reason == "process limit", r
    assert "sandbox: process limit: BlockingIOError" in r.stderr
    assert ("nproc-userns" if namespaces else "nproc-uid") in r.isolation
    assert _procs_in(r.stdout.split()[0]) == []
    _caller_keeps_working()


@pytest.mark.skipif(not HAVE_NPROC, reason="the sandbox runs as uid 0, exempt from RLIMIT_NPROC")
@pytest.mark.parametrize("namespaces", NS_MODES)
def test_thread_bomb_is_stopped_at_the_process_limit(namespaces):
    # the audit hook does not refuse threads; memory enough for 8 thread stacks
    r = run_python(THREAD_BOMB, namespaces=namespaces, max_procs=8, mem_mb=1024, timeout_s=30)
    assert r.status == "limit" and r.reason == "process limit", r
    assert "can't start new thread" in r.stderr
    cwd, started = r.stdout.split()
    if namespaces:
        assert int(started) == 7  # max_procs tasks: the main thread and 7 more
    else:
        assert int(started) <= 7  # the uid's other tasks may take some of the room
    assert _procs_in(cwd) == []
    _caller_keeps_working()


def test_thread_bomb_against_the_memory_limit_is_a_memory_stop():
    # 8 MiB stacks (or more) do not fit in 64 MiB for long: memory, not the process limit
    r = run_python(THREAD_BOMB, max_procs=1000, mem_mb=64, timeout_s=30)
    assert r.status == "memory" and r.reason == "memory limit", r
    assert "no room for a thread stack" in r.stderr
    assert int(r.stdout.split()[1]) < 8
    assert _procs_in(r.stdout.split()[0]) == []


def test_memory_bomb_is_stopped():
    code = (
        "import os\nprint(os.getcwd(), flush=True)\n"
        "x = []\nwhile True:\n    x.append(bytearray(2 ** 20))"
    )
    r = run_python(code, mem_mb=128, timeout_s=30)
    assert r.status == "memory" and r.reason == "memory limit", r
    assert "sandbox: MemoryError" in r.stderr  # the preamble's stop, not a crash
    assert _procs_in(r.stdout.split()[0]) == []
    _caller_keeps_working()


def test_bombs_in_function_calls_stop_the_run():
    # a per-call error would let the next call go on; a bomb ends the run instead
    code = (
        "import threading\n"
        "def f(x):\n"
        "    if x == 1:\n"
        "        while True:\n"
        "            threading.Thread(target=threading.Event().wait).start()\n"
        "    if x == 2:\n"
        "        return bytearray(2 ** 40)\n"
        "    return x\n"
    )
    thread = run_function(code, "f", [[0], [1], [0]], max_procs=4, mem_mb=1024)
    memory = run_function(code, "f", [[0], [2], [0]])
    if HAVE_NPROC:
        assert thread.result.status == "limit", thread.result
    else:
        assert thread.result.status in ("limit", "memory"), thread.result
    assert memory.result.status == "memory", memory.result
    for run in (thread, memory):
        assert run.cases[0] is not None and run.cases[0].value == 0
        assert run.cases[1] is None and run.cases[2] is None


def test_sweep_kills_a_process_that_left_the_session_without_namespaces():
    # no PID namespace, and the child is out of the process group killpg reaches
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.close(1)\n"
        "    os.close(2)\n"
        "    os.write(w, str(os.getpid()).encode())\n"
        "    time.sleep(60)\n"
        "    os._exit(0)\n"
        "print(os.read(r, 100).decode(), flush=True)\n"
    )
    r = run_python(code, audit=False, namespaces=False)
    assert r.status == "ok" and r.strays == 1, r
    child = int(r.stdout.split()[0])
    assert not _alive(child)  # dead when run_python returns, not later
    clean = run_python("print(1)")
    assert clean.status == "ok" and clean.strays == 0, clean


def test_a_survivor_holding_the_pipes_does_not_keep_the_run_waiting():
    """Without namespaces a child that left the session and keeps stdout and stderr open
    outlives the code: the run still ends (the pipes are read until they go quiet, not to
    their end, which only the child's exit would bring) and the sweep kills the child."""
    code = (
        "import os, time\n"
        "r, w = os.pipe()\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    os.write(w, str(os.getpid()).encode())\n"
        "    time.sleep(600)\n"
        "    os._exit(0)\n"
        "print(os.read(r, 100).decode(), flush=True)\n"
    )
    box: dict = {}
    t = threading.Thread(
        target=lambda: box.update(r=run_python(code, audit=False, namespaces=False)),
        daemon=True)
    t.start()
    t.join(300)  # only a guard against a hang: the child would hold the pipes for 600 s
    assert "r" in box, "run_python is still waiting for the pipes the child holds"
    r = box["r"]
    assert r.status == "ok" and r.strays == 1, r
    assert not _alive(int(r.stdout.split()[0]))
