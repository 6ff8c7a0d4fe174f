"""bench/trainer_parallel.py on the tiny shape: every configuration's every rank reports
every phase (that it runs, not its numbers)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import REPO

HEADER = ["configuration", "rank", "timed steps", "RSS peak start GB", "RSS peak step GB",
          "RSS peak resume GB", "GPU peak start GB", "GPU peak step GB", "GPU peak resume GB",
          "step s", "tokens/s", "fwd/bwd s", "optim s", "publish on thread s",
          "publish wait s", "publish off thread s", "MB/version", "floor s",
          "state on thread s", "state copied s", "state written s", "state GB", "resume s"]
GPU = {"GPU peak start GB", "GPU peak step GB", "GPU peak resume GB"}
# what a configuration does not have on a CPU
NOT_THERE = {"baseline": GPU | {"publish wait s", "publish off thread s", "state copied s"},
             "group": GPU | {"floor s"}}


def _table(stdout: str) -> tuple[list[str], list[list[str]]]:
    lines = [line for line in stdout.splitlines() if line.startswith("|")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    return cells[0], cells[2:]  # the header, then the rows after the |---| line


@pytest.mark.slow
def test_every_rank_of_every_configuration_reports_every_phase(tmp_path):
    out = tmp_path / "trainer_parallel.json"
    # a deadline far away: a loaded machine must not cut phases short
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "trainer_parallel.py"), "--shape", "tiny",
         "--steps", "1", "--processes", "1,2", "--threads", "1", "--deadline-s", "86400",
         "--out", str(out)],
        capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-6000:]
    header, rows = _table(proc.stdout)
    assert header == HEADER
    by_rank = {(r[0], r[1]): dict(zip(header, r)) for r in rows}
    assert list(by_rank) == [("baseline", "0"), ("group of 1", "0"), ("group of 2", "0"),
                             ("group of 2", "1")]
    for (config, rank), row in by_rank.items():
        assert len(row) == len(HEADER), (config, rank)
        absent = NOT_THERE["baseline" if config == "baseline" else "group"]
        assert {k for k, v in row.items() if v == "n/a"} == absent, (config, rank, row)
        for key in HEADER[2:]:
            if key not in absent:  # measured: a number (not "-")
                float(row[key].replace(",", ""))
        assert row["timed steps"] == "1"
    data = json.loads(out.read_text())
    assert data["meta"]["bench"] == "trainer_parallel"
    assert [(r["config"], r["rank"]) for r in data["rows"]] == [
        ("baseline", 0), ("group of 1", 0), ("group of 2", 0), ("group of 2", 1)]
    assert data["notes"] == []
