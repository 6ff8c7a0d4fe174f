"""What the spawned ranks of test_control.py run (module-level, importable by a spawned
child). ``python -m tests.unit.trainer.control_workers wait``: join the group from the
environment, say so on stdout, and wait for rank 0's command (what a follower does)."""

from __future__ import annotations

import os
import sys
import time
from typing import Any

import torch

from astraflow.trainer.parallel import join
from tests.unit.trainer.parallel_workers import cpu, full_state, steps


def idle_then_train(model_path: str, config: dict, timeout_s: float, idle_s: float
                    ) -> dict[str, Any]:
    """A group whose collectives time out after ``timeout_s``: rank 0 idles ``idle_s``
    (as while it has no batch) before its command while the others wait for it on the
    control channel; then every rank trains one step (training's collectives). The command
    received, how long the others waited, and the trained state."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    group = join("cpu", timeout_s=timeout_s)
    try:
        tr = Trainer(model_path, TrainerSpec(**config), policy="actor", group=group)
        group.wait_for_all()  # the idle starts on every rank together
        t0 = time.monotonic()
        if group.rank == 0:
            time.sleep(idle_s)
        what = group.command(("step", 0) if group.rank == 0 else None)
        waited = time.monotonic() - t0
        metrics = steps(tr, [(what[1],)])
        group.wait_for_all()
        return cpu({"what": what, "waited": waited, "metrics": metrics,
                    "state": full_state(tr)})
    finally:
        group.close()


def _wait() -> int:
    group = join("cpu")
    print(f"rank {group.rank} joined", flush=True)
    if group.rank == 0:
        time.sleep(3600)  # until killed
        return 0
    try:
        group.command(None)
    except RuntimeError as e:
        print(f"follower stopped: {e}", flush=True)
        return 3
    return 0


if __name__ == "__main__" and sys.argv[1:] == ["wait"]:
    # os._exit: the process group of the dead peer is never destroyed, and gloo's threads
    # may abort the interpreter's teardown (SIGABRT), which would hide the exit code
    os._exit(_wait())
