"""The trainer group's control channel (``trainer.parallel``): ranks wait for rank 0's
commands past the collective timeout while it lives, and stop at once when it dies."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

from astraflow.trainer.parallel import spawn_local
from astraflow.trainer.processes import free_port, rank_env
from tests.conftest import REPO, wait_for
from tests.unit.trainer import control_workers, test_parallel

qwen = test_parallel.qwen  # the fixture: a tiny random Qwen2 directory
CONFIG = test_parallel.CONFIG


def test_a_group_idles_five_collective_timeouts_then_trains(qwen):
    """Collectives time out after 2 s; rank 0 has no command for 11 s while rank 1 waits
    for it (on the control channel); then both train a step on a collective, which equals
    one process training the same batch."""
    from tests.unit.trainer import parallel_workers as workers

    timeout_s, idle_s = 2.0, 11.0
    got = spawn_local(2, control_workers.idle_then_train, (qwen, CONFIG, timeout_s, idle_s),
                      timeout_s=300)
    assert [g["what"] for g in got] == [("step", 0), ("step", 0)]
    assert got[1]["waited"] >= 5 * timeout_s
    one = workers.run(qwen, CONFIG, [(0,)])
    assert got[0]["metrics"][0]["trainer/loss_tokens"] == one["metrics"][0][
        "trainer/loss_tokens"] > 0
    # within the rounding of another reduction order, as test_parallel compares them
    test_parallel.assert_close_states(got[0]["state"]["weights"], one["state"]["weights"])


def test_a_follower_whose_rank_0_dies_stops_with_a_clear_error(tmp_path):
    """Rank 1 waits for rank 0's command (collective timeout 600 s, the channel's a
    year); rank 0 is SIGKILLed: rank 1 fails at once, naming the lost group, not at a
    timeout."""
    port = free_port()
    procs, logs = [], []
    for rank in (0, 1):
        log = tmp_path / f"rank{rank}.log"
        with open(log, "wb") as out:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "tests.unit.trainer.control_workers", "wait"],
                env=rank_env(rank, 2, port), cwd=REPO, stdout=out, stderr=subprocess.STDOUT))
        logs.append(log)
    try:
        wait_for(lambda: all("joined" in log.read_text() for log in logs), 120,
                 "both ranks joined", step=0.2)
        time.sleep(0.5)  # rank 1 into its wait (it must fail either way)
        procs[0].send_signal(signal.SIGKILL)
        assert procs[0].wait(30) == -signal.SIGKILL
        code = procs[1].wait(60)  # far below either timeout
        text = logs[1].read_text()
        assert code == 3, text[-2000:]
        assert "follower stopped: trainer rank 1: lost the trainer group while waiting " \
               "for rank 0" in text
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()

