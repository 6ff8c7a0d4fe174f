"""bench/learning.py on a multi-policy topology: every policy's evaluator settings (its
role's metric) and the table of held-out scores against version 0 (no Kafka, no model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.config.topology import load_topology
from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("learning")


@pytest.mark.parametrize("name,roles", [
    ("smollm2-solver-verifier.yaml", {"solver": "solver", "verifier": "verifier"}),
    ("smollm2-solver-selector.yaml", {"solver": "solver", "selector": "selector"}),
    ("smollm2-code.yaml", {"solver": "coder", "generator": "tester"}),
])
def test_every_policy_is_scored_by_its_roles_evaluator(name, roles, tmp_path):
    path, doc = bench.bench_topology(REPO / "topology" / name, tmp_path)
    assert load_topology(path).eval is None  # the run has no evaluator
    assert doc["eval"] and set(doc["policies"]) == set(roles)
    for policy, role in roles.items():
        settings = bench.policy_eval_settings(path, doc, policy, None)
        assert settings.role == role and settings.policy == policy
        assert settings.size == doc["eval"]["size"]  # the file's held-out size
        assert bench.policy_eval_settings(path, doc, policy, 7).size == 7  # --eval-size


def test_the_policies_table_sets_each_checkpoint_against_version_0():
    result = {"policies": {
        "solver": {"start": 0.1, "at": {60.0: 3, 120.0: None}, "accuracy": {60.0: 0.25}},
        "verifier": {"start": 0.5, "at": {60.0: 2, 120.0: 4},
                     "accuracy": {60.0: 0.5, 120.0: 0.625}}}}
    doc = {"policies": {"solver": {}, "verifier": {"role": "verifier"}}}
    table = bench.policies_report(result, doc, [60.0, 120.0]).splitlines()
    assert table[0] == "| t (s) | solver (solver) | verifier (verifier) |"
    assert table[2] == "| v0 | 10.0 % | 50.0 % |"
    assert table[3] == "| 60 | 25.0 % (v3) | 50.0 % (v2) |"
    assert table[4] == "| 120 | - | 62.5 % (v4) |"
