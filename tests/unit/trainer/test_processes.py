"""The trainer group's supervisor (``astraflow.trainer.processes``): the group lives and
dies as one, with real child processes."""

from __future__ import annotations

import signal
import subprocess
import sys

from astraflow.trainer.processes import _supervise, in_group, rank_env


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
