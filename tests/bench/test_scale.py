"""bench/scale.py: the long-tailed token model, the sleeping engine, the expected rates, the
rebalance and rate computations, the cell's topology and the plateau finder (no Kafka)."""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import pytest
import yaml

from astraflow.config.topology import parse_topology
from astraflow.raas.engine import SamplingParams
from astraflow.raas.workflows import make_workflow
from astraflow.tasks.base import make_task
from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]


scale = load_bench("scale")
BASE = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())


@pytest.mark.parametrize("kwargs, key", [
    ({"tokens_per_s": 0}, "tokens_per_s"),
    ({"min_tokens": 0}, "min_tokens"),
    ({"min_tokens": 600, "max_tokens": 512}, "min_tokens"),
    ({"alpha": 0}, "alpha"),
])
def test_token_model_refuses_bad_settings_naming_them(kwargs, key):
    with pytest.raises(ValueError, match=key):
        scale.TokenModel(**kwargs)


def test_lengths_are_pareto_from_the_minimum_up_to_the_cap():
    model = scale.TokenModel(tokens_per_s=10, min_tokens=10, alpha=1.0, max_tokens=100)
    rng = random.Random(0)
    lengths = [model.length(rng) for _ in range(5000)]
    assert min(lengths) == 10 and max(lengths) == 100  # the tail reaches the cap
    assert sorted(lengths)[len(lengths) // 2] < 30  # most are short: median 2 x minimum
    assert model.rollout_s([10, 40, 20]) == 4.0  # the longest sample, at 10 tokens/s


def test_mean_rollout_is_the_longest_of_n_samples():
    fixed = scale.TokenModel(tokens_per_s=8, min_tokens=16, alpha=1e6, max_tokens=512)
    assert scale.mean_rollout_s(fixed, 4, draws=100) == 2.0  # every sample 16 tokens
    tail = scale.TokenModel(tokens_per_s=50, min_tokens=16, alpha=1.5, max_tokens=512)
    one, four = (scale.mean_rollout_s(tail, n, draws=4000) for n in (1, 4))
    assert 16 / 50 < one < four < 512 / 50


def test_expected_rates_cap_busy_nodes_at_the_partitions():
    assert scale.expected_rates(16, 4, 4, 2.0) == (32.0, 8.0)
    assert scale.expected_rates(2, 4, 4, 2.0) == (4.0, 4.0)


def test_window_rate_and_arrival_rate():
    times, counts = [0.5, 1.0, 3.0, 5.0, 9.5], [32, 32, 32, 32, 32]
    assert scale.window_rate(times, counts, 1.0, 9.0) == 96 / 8
    # arrivals 1.0, 3.0, 5.0: two batches after the first in 4 s
    assert scale.arrival_rate(times, counts, 1.0, 9.0) == 64 / 4
    assert scale.arrival_rate(times, counts, 6.0, 10.0) == 32 / 4  # one arrival: the window
    with pytest.raises(ValueError):
        scale.window_rate(times, counts, 2.0, 2.0)


def test_settled_when_stable_with_every_partition_owned_by_the_members():
    S = scale.Snapshot
    snaps = [S(0.0, "STABLE", {"a": [0, 1], "b": [2, 3]}),          # before the event
             S(1.0, "STABLE", {"a": [0, 1], "b": [2, 3]}),          # join not seen yet
             S(1.5, "PREPARING_REBALANCING", {"a": [0, 1], "b": [2, 3], "c": []}),
             S(2.0, "STABLE", {"a": [0], "b": [2], "c": [3]}),      # partition 1 unowned
             S(2.5, "STABLE", {"a": [0, 1], "b": [2], "c": [3]})]
    assert scale.settled_at(snaps, 0.5, 3, 4) == 2.5
    assert scale.settled_at(snaps, 0.0, 2, 4) == 0.0
    assert scale.settled_at(snaps, 0.5, 4, 4) is None
    # more members than partitions: some own nothing, every partition is still owned
    assert scale.settled_at([S(1.0, "STABLE", {"a": [0], "b": []})], 0.0, 2, 1) == 1.0
    assert scale.first_after([1.0, 2.0, 3.0], 2.0) == 3.0
    assert scale.first_after([1.0], 2.0) is None


def test_sleep_engine_fits_the_single_turn_workflow():
    model = scale.TokenModel(tokens_per_s=1e6, min_tokens=3, alpha=1.2, max_tokens=40)
    engine = scale.SleepEngine(model, seed=5)
    gens = engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=20, n=3))
    assert [len(row) for row in gens] == [3, 3]
    lengths = [len(g.token_ids) for row in gens for g in row]
    assert all(3 <= n <= 20 for n in lengths)
    assert engine.tokens_generated == sum(lengths)
    assert engine.seconds_generating == pytest.approx(max(lengths) / 1e6)
    wf = make_workflow("single_turn", max_new_tokens=8)
    seqs = wf.run(make_task({"prompt": "1+2=", "answer": "3"}), {"actor": engine}, 4)
    assert len(seqs) == 4 and all(s.versions and max(s.versions) == 0 for s in seqs)


def test_cell_topology_parses_with_more_nodes_than_partitions():
    model = scale.TokenModel(max_tokens=256)
    doc = scale.cell_topology(BASE, "bench-scale-x", nodes=64, partitions=4, model=model)
    topo = parse_topology(doc)
    assert topo.run == "bench-scale-x" and topo.feeder is None and topo.eval is None
    for t in ("tasks.source", "tasks", "trajectories.raw", "trajectories", "samples.actor"):
        assert topo.topic(t).partitions == 4
    assert topo.processors["admission"].options["pool_capacity"] == 64
    assert topo.pools["local"].nodes == 4
    assert topo.pools["local"].workflows["single_turn"].max_new_tokens == 256
    assert BASE["run"] == "default"  # the base is not changed


def test_processor_plan_replicates_all_but_admission():
    plan = scale.plan_processors(["admission", "staleness", "router", "batcher"], 3)
    assert plan.count(("admission", "r0")) == 1 and len(plan) == 1 + 3 * 3
    assert ("batcher", "r2") in plan and ("admission", "r1") not in plan


def _row(nodes, parts, rate, **extra):
    return {"nodes": nodes, "partitions": parts, "replicas": 1, "trajectories_per_s": rate,
            "busy_nodes_mean": min(nodes, parts), "in_flight_mean": 2 * min(nodes, parts),
            "processors": {}, "cpu_cores": {}, **extra}


def test_plateau_is_where_throughput_stops_following_the_nodes_and_says_why():
    rows = [_row(1, 4, 2.0), _row(4, 4, 7.9), _row(16, 4, 8.1),
            _row(1, 16, 2.0), _row(4, 16, 8.0),
            _row(16, 16, 12.0, processors={"batcher/r0": {"busy_fraction": 0.9}},
                 cpu_cores={"machine_busy_fraction": 0.97, "broker": 0.9}),
            {"nodes": 64, "partitions": 16, "replicas": 1, "error": "x"}]
    by = {(p["partitions"], p["replicas"]): p for p in scale.plateaus(rows)}
    assert by[(4, 1)]["stops_at_nodes"] == 16
    assert by[(4, 1)]["why"] == ["12 of 16 nodes idle: 4 partitions of tasks"]
    assert by[(16, 1)]["stops_at_nodes"] == 16 and by[(16, 1)]["peak_per_s"] == 12.0
    why = " ".join(by[(16, 1)]["why"])
    assert "batcher/r0 busy 90%" in why and "machine CPU 97%" in why and "broker" in why
    assert scale.plateaus([_row(1, 16, 2.0), _row(4, 16, 8.0)])[0]["stops_at_nodes"] is None


def test_admission_is_named_when_nodes_idle_without_tasks():
    row = _row(8, 8, 5.0, busy_nodes_mean=3.0, in_flight_mean=4.0)
    assert any(r.startswith("admission: 4 tasks in flight") for r in scale.reasons(row))


def test_grid_flags():
    args = scale.parse_args(["--nodes", "1,4", "--partitions", "2", "--replicas", "1,2"])
    assert args.nodes == [1, 4] and args.partitions == [2] and args.replicas == [1, 2]
    assert args.mean_rollout_s > 0
    quick = scale.parse_args(["--quick"])
    assert quick.nodes == [1, 4] and quick.duration == 20.0
    with pytest.raises(argparse.ArgumentTypeError, match="whole numbers"):
        scale.int_list("1,x")
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1"):
        scale.int_list("0,4")
    with pytest.raises(SystemExit):
        scale.parse_args(["--min-tokens", "0"])


def test_records_table_divides_by_the_trajectories_made():
    row = {"nodes": 2, "partitions": 2, "replicas": 1, "raas_trajectories_per_s": 10.0,
           "window_s": 10.0, "tx_per_s": {"total": 5.0},
           "records": {"appended_per_s": 40.0, "data_per_trajectory": 0.5,
                       "appended_per_trajectory": 4.0,
                       "per_topic": {"bench-scale-2n2p1r-abc.trajectories.raw":
                                     {"data": 25, "appended": 50},
                                     "__transaction_state": {"data": 0, "appended": 350},
                                     "bench-scale-2n2p1r-abc.dlq": {"data": 0, "appended": 0}}}}
    text = scale.records_table(row)
    assert "| trajectories.raw | 0.250 | 0.500 |" in text
    assert "| __transaction_state | 0.000 | 3.500 |" in text and "dlq" not in text
    assert text.splitlines()[-1] == "| all | 0.500 | 4.000 |"


def test_admission_figures_between_two_statuses():
    first = {"admission/admitted": 100.0, "admission/bound_pool": 30.0}
    last = {"admission/admitted": 160.0, "admission/bound_pool": 40.0,
            "admission/bound_pool_max": 50.0, "admission/held": 7.0}
    assert scale.admission_figures(first, last, 30.0) == {
        "admitted_per_s": 2.0, "bound_pool": 40.0, "bound_pool_max": 50.0, "held": 7.0}
    assert scale.admission_figures({}, {"runtime/transactions": 3.0}, 1.0) == {}
