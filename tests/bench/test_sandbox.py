"""bench/sandbox.py: each case ends the way its name says, and the table and JSON rows
hold every repeat (the times themselves are the bench's output, not checked here)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench

sandbox = load_bench("sandbox")


def test_cases_end_as_named_and_every_repeat_is_kept(tmp_path):
    out = tmp_path / "sandbox.json"
    assert sandbox.main(["--repeats", "2", "--cases", "ok,wall,output", "--out", str(out)]) == 0
    rows = {r["case"]: r for r in json.loads(out.read_text())["rows"]}
    assert rows["ok"]["outcomes"] == ["ok"]
    assert rows["wall"]["outcomes"] == ["timeout/wall-clock timeout"]
    assert rows["output"]["outcomes"] == ["killed/output limit"]
    assert all(r["repeats"] == 2 for r in rows.values())
    assert all(r["seconds_max"] >= r["seconds_median"] > 0 for r in rows.values())


def test_an_unknown_case_is_named():
    with pytest.raises(ValueError, match=r"unknown cases \['nope'\]"):
        sandbox.measure(["ok", "nope"], 1, None)
    with pytest.raises(SystemExit):
        sandbox.main(["--cases", "nope"])
