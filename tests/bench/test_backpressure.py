"""bench/backpressure.py: the variant topologies it writes and the lookups of its stale
trace (no Kafka, no model)."""

from __future__ import annotations

import random
from pathlib import Path

import yaml

from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("backpressure")


def test_the_newest_version_before_a_key_matches_a_plain_scan():
    rng = random.Random(0)
    points = [(rng.randrange(50), rng.randrange(100)) for _ in range(40)]
    newest = bench._Newest(points)
    for key in range(-1, 52):
        below = [v for k, v in points if k < key]
        upto = [v for k, v in points if k <= key]
        assert newest.before(key, default=-7) == max(below, default=-7)
        assert newest.at_or_before(key, default=-7) == max(upto, default=-7)


def test_histograms_are_sorted_by_value_with_string_keys():
    assert bench._histogram([2, 0, 2, -1]) == {"-1": 1, "0": 1, "2": 2}


def test_the_variants_set_their_staleness_budget_and_may_leave_the_evaluator_out(tmp_path):
    for variant, budget in (("queue", "queue"), ("in_flight", "in_flight"),
                            ("admission", None)):
        doc = yaml.safe_load(bench.variant_topology(
            variant, tmp_path, REPO / "topology" / "smollm2.yaml", evaluate=False).read_text())
        assert "eval" not in doc and doc["run"] == f"bench-bp-{variant}"
        options = doc["processors"]["admission"].get("options", {})
        assert options.get("staleness_budget") == budget
    doc = yaml.safe_load(bench.variant_topology("passthrough", tmp_path).read_text())
    assert "admission" not in doc["processors"] and "eval" in doc
