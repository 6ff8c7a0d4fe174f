"""The trainer group's supervisor (``astraflow.trainer.processes``): the group lives and
dies as one, with real child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from astraflow.kafka.embedded import pid_alive
from astraflow.trainer.processes import _supervise, in_group, rank_env
from tests.conftest import wait_for


def _start(*codes: str) -> dict[int, tuple[int, subprocess.Popen]]:
    """One child per Python snippet, ranks in order."""
    children = {}
    for rank, code in enumerate(codes):
        p = subprocess.Popen([sys.executable, "-c", code])
        children[p.pid] = (rank, p)
    return children


FOREVER = "import time\nwhile True: time.sleep(1)"


def test_a_failing_rank_takes_the_others_down_with_its_status():
    children = _start(FOREVER, "raise SystemExit(3)", FOREVER)
    procs = [p for _, p in children.values()]
    assert _supervise(children) == 3
    assert procs[1].returncode == 3
    assert [p.returncode for p in (procs[0], procs[2])] == [-signal.SIGKILL] * 2


def test_a_rank_killed_by_a_signal_is_a_failure_named_by_it():
    children = _start(FOREVER, "import os, signal; os.kill(os.getpid(), signal.SIGKILL)")
    assert _supervise(children) == 128 + signal.SIGKILL


def test_a_group_whose_ranks_all_end_cleanly_ends_cleanly():
    children = _start("pass", "pass")
    procs = [p for _, p in children.values()]
    assert _supervise(children) == 0
    assert [p.returncode for p in procs] == [0, 0]


def test_rank_env_is_torchruns():
    env = rank_env(1, 4, 29555, base={"PATH": "/bin"})
    assert env == {"PATH": "/bin", "RANK": "1", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
                   "LOCAL_WORLD_SIZE": "4", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": "29555"}


def test_in_group_reads_the_environment(monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("RANK", raising=False)
    assert not in_group()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    assert in_group()


# The child: writes its niceness, and a file when SIGTERM ends it; then waits.
_CHILD = """
import os, signal, sys, time
out = sys.argv[1]
signal.signal(signal.SIGTERM, lambda *_: (open(out + "/term", "w").close(), sys.exit(0)))
open(out + "/nice", "w").write(str(os.nice(0)))
while True: time.sleep(1)
"""
# The parent: starts the child as `astraflow up` starts a component (a session of its
# own, die_with_parent(SIGTERM, then: nice 5)), writes its pid, and waits.
_PARENT = """
import os, signal, subprocess, sys, time
from astraflow.trainer.processes import die_with_parent
out, code = sys.argv[1], sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", code, out], start_new_session=True,
                         preexec_fn=die_with_parent(signal.SIGTERM, lambda: os.nice(5)))
open(out + "/pid", "w").write(str(child.pid))
while True: time.sleep(1)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_gets_its_signal_when_its_parent_is_killed_and_runs_then_first(tmp_path):
    """What ``astraflow up`` gives its components: in a session of their own, each still
    gets SIGTERM when ``up`` is SIGKILLed, after the ``then`` step (its niceness) ran."""
    parent = subprocess.Popen([sys.executable, "-c", _PARENT, str(tmp_path), _CHILD])
    try:
        wait_for(lambda: (tmp_path / "pid").exists() and (tmp_path / "nice").exists()
                 and (tmp_path / "nice").read_text(), 60, "the child to start")
        child = int((tmp_path / "pid").read_text())
        assert int((tmp_path / "nice").read_text()) == os.nice(0) + 5
        parent.kill()
        parent.wait(30)
        wait_for(lambda: not pid_alive(child), 60, "the child to end with its parent")
        assert (tmp_path / "term").exists()  # ended by its own SIGTERM handler
    finally:
        if parent.poll() is None:
            parent.kill()
