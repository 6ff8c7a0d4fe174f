"""``astraflow up``'s supervision: restart decisions, real child processes, the run lock."""

from __future__ import annotations

import subprocess
import sys

import pytest

from astraflow.launch.supervisor import GaveUp, RestartPolicy, RunLocked, Supervisor, run_lock
from tests.conftest import wait_for


def test_restart_policy_backs_off_and_gives_up_on_a_component_that_keeps_failing():
    policy = RestartPolicy(max_restarts=3, window_s=100, backoff_s=1, backoff_max_s=3)
    assert policy.on_exit("feeder", 0, now=0) is None  # finished: not restarted
    assert policy.on_exit("raas", 1, now=0) == 1  # 1 s, then doubling up to the cap
    assert policy.on_exit("raas", 1, now=10) == 12
    assert policy.on_exit("raas", -9, now=20) == 23
    with pytest.raises(GaveUp, match="raas failed 4 times in 100s .*exit code 1"):
        policy.on_exit("raas", 1, now=30)
    # failures older than the window are forgiven; other components count apart
    policy = RestartPolicy(max_restarts=1, window_s=10, backoff_s=1)
    assert policy.on_exit("trainer", 1, now=0) == 1
    assert policy.on_exit("trainer", 1, now=20) == 21
    assert policy.on_exit("router", 1, now=20) == 21


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def test_supervisor_restarts_a_crashed_process_and_leaves_a_finished_one(tmp_path):
    marker, second = tmp_path / "crashed-once", tmp_path / "running-again"
    # dies with code 3 the first time, runs on the second (and says so in ``second``)
    flaky = _python(f"import os, sys, time, pathlib\np = pathlib.Path({str(marker)!r})\n"
                    "if not p.exists():\n    p.touch(); sys.exit(3)\n"
                    f"pathlib.Path({str(second)!r}).touch()\ntime.sleep(60)")
    plan = {"flaky": flaky, "done": _python("pass"), "steady": _python("import time; "
                                                                       "time.sleep(60)")}
    logs: list[str] = []
    sup = Supervisor(plan, lambda name, cmd: subprocess.Popen(cmd),
                     RestartPolicy(backoff_s=0.1), log=logs.append)
    sup.start_all()
    try:
        wait_for(lambda: (sup.check() or True) and sup.restarts["flaky"] == 1
                 and "done" in sup.finished, 30, "flaky restarted once and done finished",
                 step=0.05)
        first = sup.procs["flaky"].pid
        # the restarted one got past the point where it crashed: it must now be left running
        wait_for(second.exists, 30, "the restarted flaky to run past its crash", step=0.05)
        sup.check()
        assert sup.procs["flaky"].poll() is None and sup.procs["flaky"].pid == first
        assert sup.restart_summary() == "flaky x1"
        assert set(sup.pids()) == {"flaky", "steady"}
        assert any("flaky exited with code 3; restarting" in m for m in logs)
    finally:
        sup.stop_all(timeout=5)
    assert all(p.poll() is not None for p in sup.procs.values())


def test_supervisor_gives_up_on_a_process_that_always_fails():
    sup = Supervisor({"broken": _python("raise SystemExit(2)")},
                     lambda name, cmd: subprocess.Popen(cmd),
                     RestartPolicy(max_restarts=2, backoff_s=0.05), log=lambda m: None)
    sup.start_all()
    with pytest.raises(GaveUp, match="broken failed 3 times"):  # check() raises it
        wait_for(lambda: sup.check() and False, 30, "the supervisor to give up", step=0.02)
    assert sup.restarts["broken"] == 2


def test_a_second_up_of_the_same_run_is_refused(tmp_path):
    lock = tmp_path / "run" / "up.lock"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path\n"
         "from astraflow.launch.supervisor import run_lock\n"
         f"with run_lock(Path({str(lock)!r})):\n"
         "    print('locked', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        with pytest.raises(RunLocked, match=f"already up \\(pid {holder.pid}\\)"):
            with run_lock(lock):
                pass
    finally:
        holder.kill()
        holder.wait()
    with run_lock(lock):  # the holder died: its lock went with it
        pass


def test_the_actuator_starts_and_retires_a_pools_nodes_to_follow_the_advice():
    from astraflow.launch.actuator import PoolActuator
    from astraflow.wire.records import ScalingAdvice

    sleeper = _python("import time; time.sleep(60)")
    sup = Supervisor({"raas-local-0": sleeper, "trainer-actor": sleeper},
                     lambda name, cmd: subprocess.Popen(cmd), log=lambda m: None)
    logs: list[str] = []
    actuator = PoolActuator(["local"], sup, lambda pool, i: sleeper, log=logs.append,
                            since_ms=1000)

    def advice(target: int, at_ms: int = 2000, pool: str = "local") -> ScalingAdvice:
        return ScalingAdvice(pool=pool, current_size=0, target_size=target, branch="up",
                             wait_fraction=0.2, upper=0.1, lower=0.05, reason="r",
                             at_ms=at_ms)

    sup.start_all()
    try:
        assert actuator.follow(advice(3)) == 2
        assert actuator.nodes("local") == [0, 1, 2]
        assert all(sup.procs[f"raas-local-{i}"].poll() is None for i in range(3))
        newest = sup.procs["raas-local-2"]
        assert actuator.follow(advice(2)) == -1  # the newest node goes, and stays gone
        assert actuator.nodes("local") == [0, 1]
        newest.wait(10)
        assert not sup.check() and "raas-local-2" not in sup.pids()
        assert actuator.follow(advice(5, at_ms=500)) == 0  # written before this up began
        assert actuator.follow(advice(5, pool="gpu")) == 0 and "not one of" in logs[-1]
        assert actuator.follow(advice(3)) == 1 and actuator.nodes("local") == [0, 1, 2]
        assert set(sup.pids()) == {"raas-local-0", "raas-local-1", "raas-local-2",
                                   "trainer-actor"}
    finally:
        sup.stop_all(timeout=5)
    assert all(p.poll() is not None for p in sup.procs.values())
