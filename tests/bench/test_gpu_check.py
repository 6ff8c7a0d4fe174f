"""bench/gpu_check.sh: its dry run on the CPU (the tiny shape, gloo) passes every step, and
its argument and no-GPU errors are one line."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "bench" / "gpu_check.sh"


def _run(*args: str, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=timeout)


def test_an_unknown_argument_is_one_line():
    r = _run("--fast")
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "gpu_check: unknown argument --fast (--dry-run, --out DIR)"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without a GPU")
def test_without_a_gpu_it_refuses_and_names_the_dry_run():
    r = _run()
    assert r.returncode == 2 and "--dry-run" in r.stderr and "no GPU" in r.stderr


@pytest.mark.slow
def test_the_dry_run_passes_every_step(tmp_path):
    r = _run("--dry-run", "--out", str(tmp_path), timeout=1500)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    lines = r.stdout.strip().splitlines()
    assert [line.split()[1] for line in lines[-3:]] == ["cuda-tests", "trainer-parallel",
                                                        "sigkill-resume"]
    assert all(line.startswith("ok") for line in lines[-3:])
    assert "bit for bit" in (tmp_path / "sigkill-resume.log").read_text()
    assert (tmp_path / "trainer_parallel-cpu.json").is_file()
