"""bench/async_vs_sync.py and bench/sync_loop.py: the per-task long-tail delay, the bench's
topologies and figures (no Kafka, no model), and the synchronous loop for two iterations
on tiny models (no Kafka)."""

from __future__ import annotations

import copy
import json
import statistics
from pathlib import Path

import pytest
import yaml

from astraflow.cli.components import configuration
from astraflow.config.topology import parse_topology
from astraflow.launch.plan import plan_processes
from astraflow.raas.workflows import latency as latency_module
from astraflow.raas.workflows import make_workflow
from astraflow.raas.workflows.latency import Latency
from astraflow.wire.records import Task
from tests.conftest import load_bench
from tests.fakes import ScriptedEngine

REPO = Path(__file__).resolve().parents[2]
bench = load_bench("async_vs_sync")
sync_loop = bench.sync_loop
BASES = {case: yaml.safe_load((REPO / path).read_text()) for case, path in bench.CASES.items()}
PARETO = {"dist": "pareto", "scale_s": 0.5, "alpha": 1.5, "max_s": 60.0, "seed": 3,
          "per_task": True}


def _task(task_id: str, workflow: str = "single_turn", **payload) -> Task:
    return Task(task_id=task_id, prompt_id=f"p-{task_id}", workflow=workflow,
                payload=json.dumps({"prompt": "37+45=", "answer": "82", **payload}),
                source="test", policies=["solver", "verifier"] if workflow != "single_turn"
                else ["actor"])


# --- the per-task delay --------------------------------------------------------------------


def test_a_per_task_delay_depends_on_the_seed_and_the_task_alone():
    a, b = Latency(**PARETO), Latency(**PARETO)
    first = a.for_task("run.p1-e0-1")
    for i in range(50):  # other tasks, other instances: nothing shifts
        a.for_task(f"t{i}")
        a.draw()
    assert a.for_task("run.p1-e0-1") == first == b.for_task("run.p1-e0-1")
    assert a.for_task("run.p1-e0-2") != first
    assert Latency(**{**PARETO, "seed": 4}).for_task("run.p1-e0-1") != first
    # without per_task, a task's delay is the next draw of the shared generator
    shared = {**PARETO, "per_task": False}
    assert Latency(**shared).for_task("x") == Latency(**shared).draw()


def test_per_task_pareto_delays_are_long_tailed_and_capped():
    lat = Latency(**{**PARETO, "max_s": 20.0})
    draws = sorted(lat.for_task(f"task-{i}") for i in range(20000))
    scale, alpha = PARETO["scale_s"], PARETO["alpha"]
    assert draws[0] >= scale and draws[-1] <= 20.0
    # median scale * 2^(1/alpha); P(X > 10 scale) = 10^-alpha (about 3 %)
    assert statistics.median(draws) == pytest.approx(scale * 2 ** (1 / alpha), rel=0.05)
    tail = sum(d > 10 * scale for d in draws) / len(draws)
    assert tail == pytest.approx(10 ** -alpha, rel=0.15)
    assert draws[-1] == 20.0  # the cap is reached: a long tail


@pytest.fixture
def slept(monkeypatch) -> list[float]:
    """What the workflows' delays slept (without sleeping)."""
    out: list[float] = []
    monkeypatch.setattr(latency_module.time, "sleep", out.append)
    return out


def test_single_turn_waits_for_the_slowest_task_of_its_batch(slept):
    wf = make_workflow("single_turn", max_new_tokens=4, env_latency=PARETO)
    tasks = [_task(f"t{i}") for i in range(5)]
    eng = ScriptedEngine("actor", ["82"] * 10)
    out = wf.run_batch(tasks, {"actor": eng}, 2)
    assert all(len(seqs) == 2 for seqs in out)
    assert slept == [max(Latency(**PARETO).for_task(f"t{i}") for i in range(5))]
    wf.run(tasks[3], {"actor": ScriptedEngine("actor", ["82"])}, 1)
    assert slept[-1] == Latency(**PARETO).for_task("t3")  # the same task waits the same


def test_solve_verify_waits_for_its_tasks_environment(slept):
    wf = make_workflow("solve_verify", max_new_tokens=4, env_latency=PARETO)
    solver = ScriptedEngine("solver", ["82", "73", "82"])  # the retry of the rejected one
    verifier = ScriptedEngine("verifier", ["y", "n"])
    seqs = wf.run(_task("sv-1", "solve_verify"), {"solver": solver, "verifier": verifier}, 2)
    assert len(seqs) == 5
    assert slept == [Latency(**PARETO).for_task("sv-1")]


def test_the_topology_takes_a_per_task_delay_on_both_workflows():
    for case, workflow in (("single", "single_turn"), ("multi", "solve_verify")):
        doc = copy.deepcopy(BASES[case])
        doc["pools"]["local"]["workflows"][workflow]["env_latency"] = PARETO
        topo = parse_topology(doc)
        assert topo.pools["local"].workflows[workflow].given()["env_latency"] == PARETO
        doc["pools"]["local"]["workflows"][workflow]["env_latency"] = {"per_tusk": True}
        with pytest.raises(ValueError, match="per_tusk"):
            parse_topology(doc)


def test_rollout_batch_runs_tasks_in_order_and_fails_only_the_bad_ones():
    from astraflow.raas.node import NodeOptions, RaaSNode

    node = RaaSNode(parse_topology(BASES["single"]), {"actor": ScriptedEngine(
        "actor", ["82", "82", "1", "1"])}, NodeOptions(n_samples=2))
    tasks = [_task("a"), _task("b", workflow="no_such_workflow"), _task("c")]
    a, b, c = node.rollout_batch(tasks)
    assert a.task_id == "a" and c.task_id == "c" and isinstance(b, Exception)
    assert [s.reward for s in a.sequences] == [1.0, 1.0] and a.metrics["rollout/seconds"] >= 0
    assert [s.reward for s in c.sequences] == [0.0, 0.0]
    with pytest.raises(Exception, match="no_such_workflow"):
        node.rollout(tasks[1])


# --- the bench's topologies and figures ----------------------------------------------------


@pytest.mark.parametrize("case", sorted(bench.CASES))
def test_the_long_tail_topology_is_the_base_with_n_nodes_and_a_delay(case):
    base = BASES[case]
    latency = bench.latency_option(0.3, 1.5, 20.0, 7)
    doc = bench.long_tail_topology(base, case, nodes=5, latency=latency, models_dir="/m")
    topo, run = parse_topology(doc), parse_topology(bench.without_eval(doc))
    assert topo.run == run.run == f"bench-avs-{case}"
    assert topo.eval is not None and run.eval is None and "eval" in base
    pool = run.pools["local"]
    assert (pool.nodes, pool.tasks_per_transaction) == (5, 1)
    for typed in pool.workflows.values():
        assert typed.given()["env_latency"] == latency and latency["per_task"] is True
    assert run.topics["tasks"].partitions >= 5
    for policy, spec in run.policies.items():
        assert spec.model == f"/m/{policy}" and spec.trainer.keep_versions == 0
        base_spec = parse_topology(base).policies[policy]
        assert (spec.trainer.lr, spec.max_staleness) == (base_spec.trainer.lr,
                                                        base_spec.max_staleness)
    assert run.processors == parse_topology(base).processors
    procs = plan_processes(run, "x.yaml")
    assert sum(n.startswith("raas-") for n in procs) == 5 and not any(
        n.startswith("eval-") for n in procs)
    node = configuration(procs["raas-local-0"][3:], run)  # what up's first node runs with
    assert node.options.workflow_options and all(
        o["env_latency"] == latency for o in node.options.workflow_options.values())
    assert base["pools"]["local"]["nodes"] == 1  # the base is left alone


def test_figures_of_the_curves():
    assert bench.per_iteration([0.0, 5.0, 6.0, 8.0, 9.0]) == {
        "mean": pytest.approx(4 / 3), "median": 1.0, "p90": 2.0, "n": 3}
    assert bench.per_iteration([0.0, 5.0]) == {}
    sync = [(0.0, 0, 0.6), (10.0, 5, 0.7), (20.0, 10, 0.8), (30.0, 15, 0.75)]
    asyn = [(0.0, 0, 0.6), (3.0, 5, 0.8), (6.0, 10, 0.9), (9.0, 15, 0.9), (12.0, 20, 0.95)]
    assert [round(a, 3) for *_, a in bench.smoothed(sync)] == [0.7, 0.75]
    assert bench.at_time(asyn, 7.0) == (10, 0.9) and bench.at_time(asyn, -1) is None
    cmp_ = bench.compare({"sync": sync, "async": asyn}, levels=(0.6, 0.7, 0.9, 0.99))
    assert cmp_["level"] == pytest.approx(0.75)
    assert cmp_["reached"] == {"sync": (30.0, 15), "async": (6.0, 10)}
    assert cmp_["ratio"] == pytest.approx(5.0)
    # levels above the start that either mode reached, each timed
    assert [t["level"] for t in cmp_["fixed"]] == [0.7, 0.9]
    assert cmp_["fixed"][0]["reached"] == {"sync": (20.0, 10), "async": (6.0, 10)}
    assert cmp_["fixed"][1]["reached"]["sync"] is None and "ratio" not in cmp_["fixed"][1]
    assert bench.compare({"sync": sync[:1], "async": asyn})["best"]["sync"] is None


def test_the_case_table_names_both_modes_and_the_sync_breakdown():
    curves = {"sync": [(0.0, 0, 0.6), (10.0, 5, 0.7), (20.0, 10, 0.8)],
              "async": [(0.0, 0, 0.6), (3.0, 5, 0.8), (6.0, 10, 0.9), (9.0, 15, 0.9)]}
    result = {
        "case": "single", "topology": "t.yaml", "nodes": 8, "tasks_per_iteration": 8,
        "span_s": 20.0,
        "policies": {"actor": {
            "every": 5, "prompts": 200, "curves": curves,
            "versions": {"sync": 10, "async": 15},
            "per_iteration": {"sync": {"mean": 2.0, "median": 1.8, "p90": 4.0},
                              "async": {"mean": 0.5, "median": 0.4, "p90": 1.0}},
            "compare": bench.compare(curves, (0.7,))}},
        "sync_breakdown": {"iteration_s": 2.0, "rollout_s": 1.7, "straggler_s": 1.2,
                           "slots_busy": 0.4, "train_s": 0.25, "load_s": 0.05},
        "async_summary": {"staleness_dropped": 3.0,
                          "staleness_dropped_by_stage": {"filter": 3.0}},
        "async_trainer": {"actor": {"trainer/wait_fraction": 0.6}}}
    text = bench.case_table(result)
    assert "| time per iteration, mean | 2.00s | 0.50s | 4.00x |" in text
    assert "| held-out accuracy at v10 | 80.0% | 90.0% |  |" in text
    assert "waiting on stragglers 1.20s" in text and "stale groups dropped 3" in text
    assert "| time to 70% | 20s (v10) | 6s (v10) | 3.33x |" in text
    assert "| held-out accuracy at v15 | - | 90.0% |  |" in text  # the longer run's last
    line = bench.headline([result])
    assert "single: time per iteration sync/async 4.00x" in line and "70.0% 3.33x" in line
    # the tables come back from the --out file
    back = json.loads(json.dumps([result]))
    assert bench.case_table(bench.rescored(back, [0.7])[0]) == text


# --- the synchronous loop on tiny models (no Kafka) ---------------------------------------


@pytest.mark.slow  # builds tiny models and trains them (about 20 s on 2 cores)
@pytest.mark.parametrize("case", sorted(bench.CASES))
def test_the_sync_loop_runs_two_iterations(case, tmp_path):
    from astraflow.models.tiny import init_model

    latency = bench.latency_option(0.001, 1.5, 0.01, 0)
    doc = bench.long_tail_topology(BASES[case], case, nodes=2, latency=latency,
                                   models_dir=str(tmp_path))
    for policy in doc["policies"]:
        init_model(tmp_path / policy, seed=1)
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(doc))
    topo = parse_topology(doc, source=str(path))
    first = next(iter(topo.policies))
    loop = sync_loop.SyncLoop(topo, str(path), eval_every={first: 1})
    try:
        history = loop.run(iterations=2)
    finally:
        loop.close()
    assert [it.version for it in history] == [1, 2] and loop.version == 2
    assert len(loop.nodes) == 2 and loop.batch_tasks == 8
    for it in history:
        assert it.groups[first] == 8 and it.failed == 0 and set(it.groups) == set(topo.policies)
        assert it.rollout_s >= it.straggler_s >= 0 and 0 < it.busy <= 1
        assert it.train_s > 0 and it.load_s > 0 and it.total_s > 0
    assert {e.version for n in loop.nodes for e in n.engines.values()} == {2}
    assert sorted(loop.snapshots[first]) == [0, 1, 2]
    # the stream goes on where the feeder's would: the 17th task comes next
    feeder = sync_loop.feeder_tasks(topo, str(path))
    assert next(loop.tasks).task_id == [next(feeder) for _ in range(17)][-1].task_id
    assert set(sync_loop.breakdown(history)) >= {"rollout_s", "straggler_s", "train_s",
                                                 "load_s", "slots_busy"}
