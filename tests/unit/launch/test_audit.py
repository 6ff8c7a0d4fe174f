"""The run audit's verdict without a broker: the first problem named, the rest counted (the books
on a real broker: tests/integration/launch/test_audit.py)."""

from __future__ import annotations

from astraflow.launch.audit import Audit


def test_the_verdict_names_the_first_problem_and_counts_the_rest():
    assert Audit().verdict() == "exactly once"
    assert Audit({}, ["x broke"]).verdict() == "BROKEN: x broke"
    assert Audit({}, ["x", "y", "z"]).verdict() == "BROKEN: x (+2 more)"

