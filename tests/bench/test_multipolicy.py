"""bench/multipolicy.py: the solver-alone topology it derives and the figures it reports
(no Kafka, no model)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.config.topology import parse_topology
from astraflow.launch.plan import plan_processes
from astraflow.launch.provision import model_init_command
from tests.conftest import load_bench

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("multipolicy")

TOGETHER = yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())


def _first_node(topo):
    """The ``NodeOptions`` of the first node ``astraflow up`` starts for ``topo`` (its
    command line in up's plan, as ``raas run`` builds them)."""
    return configuration(plan_processes(topo, "x.yaml")["raas-local-0"][3:], topo).options


def test_alone_topology_is_the_same_solver_without_the_verifier():
    doc = bench.alone_topology(TOGETHER)
    alone, together = parse_topology(doc), parse_topology(TOGETHER)
    assert alone.run == "solver-verifier-alone" and list(alone.policies) == ["solver"]
    # the same model recipe, trainer and pool: only the model's place differs
    a, t = alone.policies["solver"], together.policies["solver"]
    assert model_init_command(a)[3:] == model_init_command(t)[3:]
    assert (a.trainer, a.max_staleness) == (t.trainer, t.max_staleness)
    assert a.model != t.model
    assert not [n for n in alone.topics if "verifier" in n]
    assert set(alone.processors) == {"admission", "staleness", "router", "batcher-solver"}
    assert alone.processors["staleness"].options["policies"] == ["solver"]
    assert alone.processors["router"].outputs == ["samples.solver"]
    procs = plan_processes(alone, "alone.yaml")
    assert not [n for n in procs if "verifier" in n]
    node = _first_node(alone)
    assert node.tasks_per_transaction == TOGETHER["pools"]["local"]["tasks_per_transaction"]
    # the solver's sampling options only: nothing of the verifier's
    assert list(node.workflow_options) == ["single_turn"]
    assert node.workflow_options["single_turn"] == {"temperature": 1.0,  # the policy's
                                                    "max_new_tokens": 8}
    feeder = alone.feeder
    assert feeder.workflow == "single_turn"
    assert feeder.policies == ["solver"] and feeder.rate == 60
    assert TOGETHER["policies"]["verifier"]  # the input is not modified


def test_the_real_model_solver_alone_keeps_its_reward_and_evaluations_can_be_denser():
    doc = yaml.safe_load((REPO / "topology" / "smollm2-solver-verifier.yaml").read_text())
    alone = parse_topology(bench.evaluated_every(bench.alone_topology(doc), 5))
    opts = _first_node(alone).workflow_options["single_turn"]
    assert opts["reward"] == doc["pools"]["local"]["workflows"]["solve_verify"]["reward"]
    assert "verdict_weight" not in opts and "judge_reward" not in opts
    assert alone.eval.every_versions == 5
    assert alone.run == "smollm2-solver-verifier-alone"
    assert alone.policies["solver"].model == "runs/smollm2-solver-verifier-alone/solver"
    together = parse_topology(bench.evaluated_every(doc, 5))
    assert together.eval.every_versions == 5
    assert bench.evaluated_every(doc, None) is doc


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


def test_seeded_topologies_parse_and_seed_the_feeder_and_trainers_not_sampling():
    for doc in (TOGETHER, bench.alone_topology(TOGETHER)):
        topo = parse_topology(bench.seeded(doc, 7))
        assert topo.feeder.seed == 7
        assert {p.trainer.seed for p in topo.policies.values()} == {7}
        options = _first_node(topo).workflow_options
        assert options  # one seed for every generate call: the same draws
        assert not [name for name, opts in options.items() if "seed" in opts]
    assert "seed" not in (TOGETHER.get("feeder") or {})  # the input is not modified


def test_evaluations_are_placed_at_the_training_cpu_seconds_spent_by_then():
    # epoch 1000: the run's processes start; 1 CPU-s a second before, 2 after
    series = [(990.0, 0.0, 0.0), (1000.0, 10.0, 12.0), (1010.0, 30.0, 40.0),
              (1020.0, 50.0, 70.0)]
    summary = {"started_at": 1000.0, "eval": {"solver": [
        {"t": 0.0, "version": 0, "accuracy": 0.5}, {"t": 5.0, "version": 3, "accuracy": 0.6},
        {"t": 20.0, "version": 9, "accuracy": 0.7}]}}
    out = bench.with_cpu(summary, series)
    assert [x["cpu"] for x in out["eval"]["solver"]] == [0.0, 10.0, 40.0]
    assert out["cores_in_use"] == 2.0 and out["cpu_training_s"] == 40.0
    f = bench.curve_figures(out["eval"]["solver"], [10.0], 1, 0.65, [15.0, 40.0])
    assert f["at_cpu"] == {"15": 0.6, "40": 0.7} and f["cpu_to_target"] == 40.0
    # a run that spent less than a checkpoint has no figure there
    assert bench.curve_figures(out["eval"]["solver"], [], 1, 0.65, [15.0, 41.0],
                               cpu_spent=40.0)["at_cpu"] == {"15": 0.6}


def test_a_process_trees_cpu_counts_children_and_leaves_out_evaluators(tmp_path):
    import subprocess
    import sys
    import time

    spin = "import time\nt=time.process_time()\nwhile time.process_time()-t<0.3: pass\n"
    child = subprocess.Popen([sys.executable, "-c", spin + "import time; time.sleep(30)"])
    try:
        deadline = time.monotonic() + 20
        while bench.tree_cpu(child.pid)[0] < 0.3:
            assert time.monotonic() < deadline, bench.tree_cpu(child.pid)
        train, total = bench.tree_cpu(child.pid)
        assert train == total >= 0.3
    finally:
        child.kill()
        child.wait()
    assert bench.not_training("python -m astraflow.cli.main eval run --topology t.yaml")
    assert bench.not_training("/usr/lib/jvm/bin/java -Xmx1g kafka.Kafka p")
    assert not bench.not_training("python -m astraflow.cli.main trainer run --policy solver")


def test_intervals_over_seeds_and_the_paired_difference():
    m, h = bench.mean_ci([0.5, 0.6, 0.7])
    assert m == pytest.approx(0.6) and h == pytest.approx(4.303 * 0.1 / 3 ** 0.5)
    assert bench.mean_ci([0.5]) == (0.5, None)
    runs = [{"kind": k, "seed": s, "solver": {"final": f}} for k, s, f in
            [("alone", 0, 0.5), ("together", 0, 0.6), ("alone", 1, 0.7), ("together", 1, 0.7),
             ("together", 2, 0.9)]]  # seed 2 has no pair: left out
    alone, together, diff = bench._paired(runs, lambda r: r["solver"]["final"])
    assert alone == [0.5, 0.7] and together == [0.6, 0.7]
    assert diff == pytest.approx([0.1, 0.0])


def test_the_json_is_written_after_every_run(tmp_path, monkeypatch):
    """An interrupted bench keeps the runs it finished: --out is rewritten after each."""
    calls: list[str] = []

    def fake_up(topology, duration, runs_dir, log):
        calls.append(Path(topology).name)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return {}

    monkeypatch.setattr(bench, "run_up", fake_up)
    monkeypatch.setattr(bench, "figures", lambda summary, args: {"final": 0.5})
    out = tmp_path / "mp.json"
    with pytest.raises(KeyboardInterrupt):
        bench.main(["--runs-dir", str(tmp_path / "runs"), "--out", str(out), "--seeds", "3"])
    data = json.loads(out.read_text())
    assert calls == ["bench-multipolicy-alone-s3.yaml", "bench-multipolicy-together-s3.yaml"]
    assert data["seeds"] == [3]
    assert data["runs"] == [{"name": "alone seed 3", "kind": "alone", "seed": 3, "final": 0.5}]
