"""The markers are complete: a test that needs the broker is marked ``kafka``, so
``pytest -m "not kafka"`` runs without one (no broker here: this collects in a child)."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from functools import cache

import pytest

from tests.conftest import BROKER_FIXTURE, REPO


def _fixtures_per_test(*args: str, where: str = "tests") -> dict[str, set[str]]:
    """``pytest --fixtures-per-test ARGS WHERE``: test id -> every fixture it uses, directly
    or through another fixture (a test that uses none is left out)."""
    res = subprocess.run([sys.executable, "-m", "pytest", "--fixtures-per-test", "-q",
                          "-p", "no:cacheprovider", *args, where],
                         capture_output=True, text=True, cwd=REPO, timeout=300)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    tests: dict[str, set[str]] = {}
    for block in re.split(r"\n-+ fixtures used by ", res.stdout)[1:]:
        name = block.split(" ", 1)[0]
        where = re.search(r"\((tests/\S+?):\d+\)", block)
        tests[f"{where.group(1) if where else '?'}::{name}"] = set(
            re.findall(r"^(\w+) -- ", block, re.M))
    return tests


OWN_BROKER = ("EmbeddedBroker(", "EmbeddedCluster(", '"broker", "start"', "chaos_run")
NO_BROKER_AFTER_ALL = {  # test -> why its broker never starts
    "tests/unit/config/test_topology.py::test_missing_java_says_what_to_install":
        "no Java is found: the start fails, which is the test",
    "tests/unit/broker/test_ports.py::test_a_port_asked_for_and_taken_is_one_line":
        "only the port choice runs, refused, which is the test",
    "tests/unit/broker/test_ports.py::test_the_default_port_taken_gives_way_and_says_so":
        "only the port choice runs, no broker starts",
    "tests/unit/broker/test_cluster.py::test_racks_must_name_one_rack_a_node":
        "the racks are refused in the constructor, which is the test",
    "tests/unit/broker/test_cluster.py::test_a_state_of_another_size_is_refused_before_anything_starts":
        "the recorded size is refused before any node starts, which is the test",
    "tests/unit/broker/test_cluster.py::test_cluster_options_that_cannot_apply_are_one_line_errors":
        "every `broker start` there is refused before anything starts, which is the test",
}


@cache
def _test_sources(path: str) -> dict[str, str]:
    text = (REPO / path).read_text()
    return {n.name: ast.get_source_segment(text, n) or "" for n in ast.parse(text).body
            if isinstance(n, ast.FunctionDef)}


def _starts_its_own_broker(test: str) -> bool:
    if test in NO_BROKER_AFTER_ALL:
        return False
    path, name = test.split("::", 1)
    source = _test_sources(path).get(name.split("[", 1)[0], "") if path != "?" else ""
    return any(s in source for s in OWN_BROKER)


@pytest.mark.slow  # collects the whole suite in a child process
def test_every_test_that_uses_the_broker_is_marked_kafka():
    unmarked = _fixtures_per_test("-m", "not kafka")  # (tests without fixtures not listed)
    assert any("tmp_path" in fixtures for fixtures in unmarked.values()), sorted(unmarked)
    needing = sorted(t for t, fixtures in unmarked.items() if BROKER_FIXTURE in fixtures)
    assert not needing, f"tests that start the broker but run under -m 'not kafka': {needing}"
    own = sorted(t for t in unmarked if _starts_its_own_broker(t))
    assert not own, f"tests that start their own broker but are not marked kafka: {own}"
    # and the check can see a broker test: a marked one does use the fixture (one
    # module's collection is enough to show that the parsing finds it)
    marked = _fixtures_per_test("-m", "kafka", where="tests/integration/kafka/test_replication.py")
    assert any(BROKER_FIXTURE in fixtures for fixtures in marked.values()), sorted(marked)
