"""bench/multipolicy.py: the solver-alone topology it derives and the figures it reports
(no Kafka, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow.launcher import _model_init_command, plan_processes
from astraflow.topology import parse_topology

from .conftest import load_bench

REPO = Path(__file__).resolve().parents[1]
bench = load_bench("multipolicy")

TOGETHER = yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())


def test_alone_topology_is_the_same_solver_without_the_verifier():
    doc = bench.alone_topology(TOGETHER)
    alone, together = parse_topology(doc), parse_topology(TOGETHER)
    assert alone.run == "solver-alone" and list(alone.policies) == ["solver"]
    # the same model recipe, trainer and pool: only the model's place differs
    a, t = alone.policies["solver"], together.policies["solver"]
    assert _model_init_command(a)[3:] == _model_init_command(t)[3:]
    assert (a.trainer, a.max_staleness) == (t.trainer, t.max_staleness)
    assert a.model != t.model
    assert not [n for n in alone.topics if "verifier" in n]
    assert set(alone.processors) == {"admission", "staleness", "router", "batcher-solver"}
    assert alone.processors["staleness"].options["policies"] == ["solver"]
    assert alone.processors["router"].outputs == ["samples.solver"]
    procs = plan_processes(alone, "alone.yaml")
    assert not [n for n in procs if "verifier" in n]
    raas = procs["raas-local-0"]
    k = TOGETHER["pools"]["local"]["tasks_per_transaction"]
    assert raas[raas.index("--tasks-per-transaction") + 1] == str(k)
    assert any(x.startswith("single_turn=") for x in raas)
    # the solver's sampling options only: nothing of the verifier's
    opts = json.loads(next(x for x in raas if x.startswith("single_turn=")).split("=", 1)[1])
    assert opts == {"temperature": 1.0, "max_new_tokens": 8}  # the policy's temperature
    assert not any("solve_verify" in x for x in raas)
    feeder = alone.feeder
    assert feeder.workflow == "single_turn"
    assert feeder.policies == ["solver"] and feeder.rate == 60
    assert TOGETHER["policies"]["verifier"]  # the input is not modified


def test_figures_read_the_curves_at_equal_time():
    curve = [{"t": 10.0, "version": 0, "accuracy": 0.6}, {"t": 40.0, "version": 50,
                                                           "accuracy": 0.8},
             {"t": 70.0, "version": 100, "accuracy": 0.92}, {"t": 90.0, "version": 140,
                                                            "accuracy": 0.9}]
    f = bench.curve_figures(curve, [30.0, 60.0, 100.0], tail=2, target=0.9)
    assert f["at"] == {"30": 0.6, "60": 0.8, "100": 0.9}
    assert f["start"] == 0.6 and f["final"] == pytest.approx(0.91) and f["best"] == 0.92
    assert f["seconds_to_target"] == 70.0 and f["last_version"] == 140
    assert bench.curve_figures(curve, [5.0], 2, 0.99)["at"] == {"5": None}
    assert bench.curve_figures(curve, [5.0], 2, 0.99)["seconds_to_target"] is None
