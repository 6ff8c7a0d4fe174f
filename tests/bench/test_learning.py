"""bench/learning.py without Kafka or a model: on a multi-policy topology every policy's
evaluator settings (its role's metric) and the table of held-out scores against version 0;
on one policy the seeded topologies, the validation split, the sweep's choice, the
intervals over seeds, the times to the target and the results page."""

from __future__ import annotations

import argparse
import copy
import json
import math
import statistics
from pathlib import Path

import pytest
import yaml

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


# --- the one-policy bench: seeds, data split, sweep choice, statistics, report ----------------
def smollm2_doc(tmp_path):
    return bench.bench_topology(REPO / "topology" / "smollm2.yaml", tmp_path)[1]


def test_seeded_topology_seeds_sampling_trainer_and_feeder_and_nothing_else(tmp_path):
    doc = smollm2_doc(tmp_path)
    before = copy.deepcopy(doc)
    seeded = bench.seeded_topology(doc, 2)
    assert doc == before  # a pure function of its arguments
    topo = load_topology(bench.write_topology(seeded, tmp_path, "seed 2"))
    assert topo.pools["local"].workflows["single_turn"].seed == 2
    assert topo.policies["actor"].trainer.seed == 2 and topo.feeder.seed == 2
    changed = copy.deepcopy(seeded)
    changed["pools"]["local"]["workflows"]["single_turn"].pop("seed")
    changed["policies"]["actor"]["trainer"].pop("seed")
    changed["feeder"].pop("seed")
    assert changed == before
    assert bench.seeded_topology(doc, 2) == seeded  # the same seed, the same topology
    assert bench.seeded_topology(doc, 3) != seeded


def test_seeded_topology_seeds_a_pool_without_workflow_options():
    doc = {"pools": {"p": {"nodes": 1}}, "policies": {"a": {}}, "feeder": None}
    seeded = bench.seeded_topology(doc, 5)
    assert seeded["pools"]["p"]["workflows"] == {"single_turn": {"seed": 5}}
    assert seeded["policies"]["a"]["trainer"]["seed"] == 5 and seeded["feeder"]["seed"] == 5


def test_the_shared_reward_and_the_swept_lr_reach_the_topology(tmp_path):
    doc = smollm2_doc(tmp_path)
    run_doc = bench.with_lr(bench.with_reward(doc, "first_integer"), 1e-4)
    topo = load_topology(bench.write_topology(run_doc, tmp_path, "test"))
    assert topo.pools["local"].workflows["single_turn"].reward == "first_integer"
    assert topo.policies["actor"].trainer.lr == 1e-4
    assert doc["policies"]["actor"]["trainer"]["lr"] == 1e-5  # the input is left alone


def test_the_validation_split_is_disjoint_from_test_and_training_and_repeats():
    rows = [{"prompt": f"What is {a}+{b}?", "answer": str(a + b)}
            for a in range(10, 60) for b in range(10, 60)]
    train, val = bench.split_validation(rows, set())
    assert 0 < len(val) < len(rows) and len(train) + len(val) == len(rows)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in val}
    assert bench.split_validation(rows, set()) == (train, val)  # a function of the prompts
    test = {val[0]["prompt"], val[1]["prompt"]}
    train2, val2 = bench.split_validation(rows, test)
    assert not test & {r["prompt"] for r in val2}  # a test prompt never validates ...
    assert val2 == val[2:] and len(train2) == len(train) + 2  # ... it stays in training
    # the same rows in another order: the same split, in that order
    assert bench.split_validation(rows[::-1], set())[1] == val[::-1]


def test_the_default_sweeps_sit_around_each_systems_usual_lr():
    assert bench.astraflow_lrs(3e-5) == [1e-5, 3e-5, 1e-4]
    assert bench.TRL_LRS == (2e-6, 5e-6, 1e-5) and bench.TRL_LR in bench.TRL_LRS


def test_sweep_lrs_and_trl_options_parse_and_reject_bad_input():
    assert bench.parse_sweep_lrs(["trl=2e-6,5e-6", "astraflow=1e-4"]) == {
        "trl": [2e-6, 5e-6], "astraflow": [1e-4]}
    for bad, msg in (("trl", "SYSTEM=LR"), ("verl=1e-5", "SYSTEM=LR"),
                     ("trl=fast", "must be numbers"), ("trl=-1e-5", "positive")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_sweep_lrs([bad])
    options = bench.parse_trl_options(["beta=[0.0, 0.04]", "loss_type=dr_grpo",
                                       "num_generations=16"])
    assert options == {"num_generations": [16], "max_completion_length": [8],
                       "beta": [0.0, 0.04], "loss_type": ["dr_grpo"],
                       "bf16": [bench.trl_base()["bf16"]]}
    for bad, msg in (("beta", "KEY=VALUE"), ("learning_rate=1e-5", "--sweep-lrs"),
                     ("seed=3", "--seeds"), ("beta=[]", "empty list")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_trl_options([bad])


def test_astraflow_options_name_topology_paths_and_set_them():
    doc = {"processors": {"batcher": {"options": {"batch_size": 4}}},
           "policies": {"actor": {"trainer": {"lr": 3e-5}}}}
    options = bench.parse_astraflow_options(
        ["processors.batcher.options.batch_size=[1, 2]", "policies.actor.temperature=0.9"],
        doc)
    assert options == {"processors.batcher.options.batch_size": [1, 2],
                       "policies.actor.temperature": [0.9]}
    grid = bench.sweep_grid([1e-5], options)
    assert [g["processors.batcher.options.batch_size"] for g in grid] == [1, 2]
    run_doc = bench.with_options(bench.with_lr(doc, 1e-5), grid[0])
    assert run_doc["processors"]["batcher"]["options"]["batch_size"] == 1
    assert run_doc["policies"]["actor"] == {"trainer": {"lr": 1e-5}, "temperature": 0.9}
    assert doc["processors"]["batcher"]["options"]["batch_size"] == 4  # not changed
    for bad, msg in (("batch_size", "PATH=VALUE"),
                     ("processors.sorter.options.k=1", "no 'processors.sorter.options'"),
                     ("policies.actor.trainer.lr=1e-4", "--sweep-lrs"),
                     ("run=other", "set by the bench"),
                     ("processors.batcher.options.batch_size=[]", "empty list")):
        with pytest.raises(ValueError, match=msg):
            bench.parse_astraflow_options([bad], doc)


def test_the_sweep_grid_and_the_setting_without_a_sweep():
    grid = bench.sweep_grid([1e-6, 2e-6], {"beta": [0.0, 0.1], "num_generations": [8]})
    assert grid == [{"lr": 1e-6, "beta": 0.0, "num_generations": 8},
                    {"lr": 1e-6, "beta": 0.1, "num_generations": 8},
                    {"lr": 2e-6, "beta": 0.0, "num_generations": 8},
                    {"lr": 2e-6, "beta": 0.1, "num_generations": 8}]
    assert bench.sweep_grid([3e-5], {}) == [{"lr": 3e-5}]
    base = bench.parse_trl_options([])
    assert bench.unswept_setting(None, 5e-6, base) == {"lr": 5e-6, **bench.trl_base()}
    assert bench.unswept_setting([1e-5, 2e-5], 5e-6, base)["lr"] == 5e-6  # the usual one
    assert bench.unswept_setting([7e-6], 5e-6, base)["lr"] == 7e-6  # the one given
    with pytest.raises(ValueError, match="beta list several values"):
        bench.unswept_setting(None, 5e-6, {"beta": [0.0, 0.1]})


def row(lr, strict, lenient, **options):
    return {"system": "trl", "setting": {"lr": lr, **options},
            "scores": {"strict": strict, "lenient": lenient}}


def test_the_sweep_chooses_the_best_validation_score_then_training_reward_then_smaller_lr():
    rows = [row(1e-5, 0.30, 0.40), row(2e-6, 0.10, 0.45), row(5e-6, 0.20, 0.45)]
    assert bench.choose_setting(rows, "lenient") == {"lr": 2e-6}  # tie at 0.45: smaller
    assert bench.choose_setting(rows[::-1], "lenient") == {"lr": 2e-6}  # whatever the order
    assert bench.choose_setting(rows, "strict") == {"lr": 1e-5}  # the metric asked for
    same_lr = [row(5e-6, 0.0, 0.2, beta=0.0), row(5e-6, 0.0, 0.2, beta=0.1)]
    assert bench.choose_setting(same_lr, "lenient") == {"lr": 5e-6, "beta": 0.0}  # earlier
    with pytest.raises(ValueError, match="no runs"):
        bench.choose_setting([], "lenient")
    # all at 0 % held out (a sweep too short to learn the task): the training reward
    # near the end decides, and a run without one loses to any that has one
    zeros = [{**row(1e-5, 0.0, 0.0), "train_reward": 0.05},
             {**row(3e-5, 0.0, 0.0), "train_reward": 0.20},
             {**row(1e-4, 0.0, 0.0), "train_reward": None}, row(2e-6, 0.0, 0.0)]
    assert bench.choose_setting(zeros, "lenient") == {"lr": 3e-5}
    assert bench.choose_setting(zeros[2:], "lenient") == {"lr": 2e-6}  # neither: smaller lr
    assert bench.choose_setting([{**zeros[0], "scores": {"lenient": 0.01}}, zeros[1]],
                                "lenient") == {"lr": 1e-5}  # the held-out score first
    table = bench.sweep_table([*rows, *[{**r, "system": "astraflow"} for r in same_lr]],
                              {"trl": {"lr": 2e-6}, "astraflow": {"lr": 5e-6, "beta": 0.1}})
    lines = table.splitlines()
    assert lines[3] == "| trl | 2e-06 | - | 10.0 % | 45.0 % | yes |"
    assert lines[2].endswith("| 40.0 % |  |")
    assert lines[6] == "| astraflow | 5e-06 | beta 0.1 | 0.0 % | 20.0 % | yes |"


def test_a_setting_run_with_several_seeds_counts_by_its_means():
    seeded = [{**row(1e-5, 0.0, 0.125), "seed": 0, "train_reward": 0.2},
              {**row(1e-5, 0.0, 0.01), "seed": 1, "train_reward": None},
              {**row(5e-6, 0.0, 0.075), "seed": 0, "train_reward": 0.1},
              {**row(5e-6, 0.0, 0.075), "seed": 1, "train_reward": 0.3}]
    means = bench.setting_means(seeded)
    assert [m["setting"] for m in means] == [{"lr": 1e-5}, {"lr": 5e-6}]  # first seen
    assert means[0]["seeds"] == [0, 1] and means[0]["scores"]["lenient"] == \
        pytest.approx(0.0675)
    assert means[0]["train_reward"] == pytest.approx(0.2)  # a run without one is left out
    assert means[1]["train_reward"] == pytest.approx(0.2)
    # seed 0 alone would choose 1e-5 (12.5 % against 7.5 %); over both seeds 5e-6 wins
    assert bench.choose_setting(seeded[::2], "lenient") == {"lr": 1e-5}
    assert bench.choose_setting(seeded, "lenient") == {"lr": 5e-6}
    # the same setting under two systems stays two settings
    assert len(bench.setting_means([seeded[0], {**seeded[1], "system": "astraflow"}])) == 2
    lines = bench.sweep_table(seeded, {"trl": {"lr": 5e-6}}).splitlines()
    assert lines[0] == ("| system | lr | options | seeds | validation strict | "
                        "validation lenient | chosen |")
    assert lines[2] == "| trl | 1e-05 | - | 2 | 0.0 % | 6.8 % |  |"
    assert lines[3] == "| trl | 5e-06 | - | 2 | 0.0 % | 7.5 % | yes |"
    assert len(lines) == 4


def test_the_sweep_runs_every_setting_with_each_seed_and_keeps_finished_ones(tmp_path,
                                                                              monkeypatch):
    # validation scores by (lr, seed): 1e-5 wins seed 0 by luck, 5e-6 wins on the mean
    lenient = {(1e-5, 0): 0.125, (1e-5, 1): 0.01, (5e-6, 0): 0.075, (5e-6, 1): 0.075}
    ran = []

    def one_run(system, doc, setting, seed, duration, checkpoints, runs_dir, scorer):
        ran.append((setting["lr"], seed))
        score = {"strict": 0.0, "lenient": lenient[setting["lr"], seed]}
        return {"scores": {bench.key(duration): score}, "at": {bench.key(duration): "v3"},
                "commit": "abc", "train_reward": 0.1}

    monkeypatch.setattr(bench, "one_run", one_run)
    monkeypatch.setattr(bench, "make_scorer", lambda doc, dataset=None, size=None, usual=False: {
        "size": 200, "scores": lambda state: {"strict": 0.0, "lenient": 0.0}})
    args = argparse.Namespace(seed0=0, sweep_seeds=2, sweep_duration=300.0,
                              sweep_metric="lenient", val_size=None, runs_dir=tmp_path)
    grids = {"trl": [{"lr": 1e-5}, {"lr": 5e-6}]}
    path = tmp_path / "progress.json"

    def sweep():
        progress = bench.Progress(path, {"c": 1}, {"trl": {"grid": grids["trl"]}}, True)
        return bench.run_sweep(args, {}, ["trl"], grids, {"validation": "v.jsonl"}, progress)

    out = sweep()
    assert ran == [(1e-5, 0), (5e-6, 0), (1e-5, 1), (5e-6, 1)]  # seed by seed
    assert out["seeds"] == [0, 1] and len(out["rows"]) == 4
    assert out["chosen"]["trl"] == {"lr": 5e-6}
    assert "| trl | 5e-06 | - | 2 | 0.0 % | 7.5 % | yes |" in out["table"]
    again = sweep()  # a resumed sweep runs nothing again, and chooses the same
    assert len(ran) == 4 and again["chosen"] == out["chosen"]
    args.sweep_seeds = 1  # one seed: seed 0's luck decides
    assert sweep()["chosen"]["trl"] == {"lr": 1e-5} and len(ran) == 4


def test_late_mean_is_the_second_half_of_the_rewards_in_order():
    assert bench.late_mean([0.0, 0.0, 1.0, 0.5]) == pytest.approx(0.75)
    assert bench.late_mean([0.0, 0.2, 0.4]) == pytest.approx(0.3)  # the middle one is late
    assert bench.late_mean([0.4]) == pytest.approx(0.4)
    assert bench.late_mean([]) is None


def test_resume_keeps_finished_runs_and_refuses_other_settings(tmp_path):
    path = tmp_path / "bench-learning" / "progress.json"
    common = {"duration": 1800.0, "checkpoints": [300.0, 1800.0]}
    own = {"trl": {"grid": [{"lr": 5e-6}]}, "astraflow": {"grid": [{"lr": 3e-5}]}}
    first = bench.Progress(path, common, own, resume=True)  # nothing yet: starts empty
    assert first.find("run", "trl", {"lr": 5e-6}, 0) is None
    first.add("sweep", {"system": "trl", "seed": 0, "setting": {"lr": 5e-6}, "scores": {}})
    first.add("run", {"system": "trl", "seed": 0, "setting": {"lr": 5e-6}, "scores": {"x": 1}})
    first.add("run", {"system": "astraflow", "seed": 0, "setting": {"lr": 3e-5},
                      "scores": {"x": 2}})

    again = bench.Progress(path, copy.deepcopy(common), copy.deepcopy(own), resume=True)
    assert again.find("run", "trl", {"lr": 5e-6}, 0)["scores"] == {"x": 1}
    assert again.find("sweep", "trl", {"lr": 5e-6}, 0) is not None
    assert again.find("run", "trl", {"lr": 5e-6}, 1) is None  # another seed
    assert again.find("run", "trl", {"lr": 1e-5}, 0) is None  # another setting
    assert again.find("run", "astraflow", {"lr": 5e-6}, 0) is None  # another system

    assert bench.Progress(path, common, own, resume=False).runs == []  # without --resume
    with pytest.raises(SystemExit, match=r"other settings \(checkpoints, duration\)"):
        bench.Progress(path, {**common, "duration": 600.0, "checkpoints": [600.0]}, own, True)

    # TRL's own settings changed: TRL starts over, AstraFlow keeps its run
    trl_changed = {**own, "trl": {"grid": [{"lr": 5e-6}], "step": "another"}}
    kept = bench.Progress(path, common, trl_changed, resume=True)
    assert kept.find("run", "trl", {"lr": 5e-6}, 0) is None
    assert kept.find("sweep", "trl", {"lr": 5e-6}, 0) is None
    assert kept.find("run", "astraflow", {"lr": 3e-5}, 0)["scores"] == {"x": 2}
    # the grid widened (its top rate won): the runs of the rates still in it are kept
    wider = {**own, "astraflow": {"grid": [{"lr": 3e-5}, {"lr": 1e-4}]}}
    widened = bench.Progress(path, common, wider, resume=True)
    assert widened.find("run", "astraflow", {"lr": 3e-5}, 0)["scores"] == {"x": 2}
    narrower = {**own, "astraflow": {"grid": [{"lr": 1e-4}]}}
    assert bench.Progress(path, common, narrower, resume=True).find(
        "run", "astraflow", {"lr": 3e-5}, 0) is None
    # a bench of one system keeps the other's runs in the file for a later bench of both
    alone = bench.Progress(path, common, {"trl": own["trl"]}, resume=True)
    alone.add("run", {"system": "trl", "seed": 1, "setting": {"lr": 5e-6}, "scores": {}})
    both = bench.Progress(path, common, own, resume=True)
    assert both.find("run", "astraflow", {"lr": 3e-5}, 0) is not None
    assert both.find("run", "trl", {"lr": 5e-6}, 1) is not None


def test_reuse_lends_another_benchs_runs_of_the_same_task(tmp_path):
    run_settings = {"duration": 1800.0, "checkpoints": [300.0, 1800.0], "data": "d"}
    shipped = tmp_path / "shipped.json"  # a --no-sweep bench at one setting per system
    other = bench.Progress(shipped, {**run_settings, "sweep": False},
                           {"trl": {"grid": [{"lr": 5e-6}], "step": "one prompt"},
                            "astraflow": {"grid": [{"lr": 1e-5}]}}, resume=True)
    other.add("run", {"system": "trl", "seed": 0, "setting": {"lr": 5e-6}, "scores": {"x": 1}})
    other.add("run", {"system": "astraflow", "seed": 0, "setting": {"lr": 1e-5},
                      "scores": {"x": 2}, "topology_sha256": "abc"})
    other.add("run", {"system": "astraflow", "seed": 1, "setting": {"lr": 1e-5},
                      "scores": {"x": 3}})  # from before runs recorded their topology
    own = {"trl": {"grid": [{"lr": 2e-6}, {"lr": 5e-6}], "step": "one prompt"},
           "astraflow": {"grid": [{"lr": 1e-5}, {"lr": 3e-5}]}}
    path = tmp_path / "default.json"
    progress = bench.Progress(path, {**run_settings, "sweep": True}, own, resume=True)
    progress.reuse(shipped)
    assert progress.find("run", "trl", {"lr": 2e-6}, 0) is None  # not the setting it ran
    assert progress.find("run", "trl", {"lr": 5e-6}, 1) is None  # not the seed
    assert progress.find("sweep", "trl", {"lr": 5e-6}, 0) is None  # a sweep run is its own
    lent = progress.find("run", "trl", {"lr": 5e-6}, 0)
    assert lent["scores"] == {"x": 1} and lent["reused_from"] == str(shipped)
    # kept in this bench's own file, so a --resume without --reuse keeps it too
    resumed = bench.Progress(path, {**run_settings, "sweep": True}, own, resume=True)
    assert resumed.find("run", "trl", {"lr": 5e-6}, 0)["reused_from"] == str(shipped)
    assert resumed.find("run", "astraflow", {"lr": 1e-5}, 0) is None  # never asked for

    # a system whose own settings differ (what a TRL step trains) lends nothing
    steps = bench.Progress(tmp_path / "b.json", {**run_settings, "sweep": True},
                           {**own, "trl": {**own["trl"], "step": "another"}}, resume=True)
    steps.reuse(shipped, topology="abc")
    assert steps.find("run", "trl", {"lr": 5e-6}, 0) is None
    assert steps.find("run", "astraflow", {"lr": 1e-5}, 0)["scores"] == {"x": 2}
    assert steps.find("run", "astraflow", {"lr": 1e-5}, 1) is None
    # an AstraFlow run of other topology settings behind the same path is not lent
    edited = bench.Progress(tmp_path / "e.json", {**run_settings, "sweep": True}, own,
                            resume=True)
    edited.reuse(shipped, topology="abd")
    assert edited.find("run", "astraflow", {"lr": 1e-5}, 0) is None
    assert edited.find("run", "trl", {"lr": 5e-6}, 0)["scores"] == {"x": 1}
    doc = {"run": "r", "policies": {"actor": {"trainer": {"lr": 1e-5}}}}
    same = {"policies": {"actor": {"trainer": {"lr": 1e-5}}}, "run": "r"}
    assert bench.topology_digest(doc) == bench.topology_digest(same)  # key order aside
    assert bench.topology_digest(doc) != bench.topology_digest(bench.with_lr(doc, 3e-5))
    # other run settings: refused, naming them
    shorter = bench.Progress(tmp_path / "c.json", {**run_settings, "duration": 600.0}, own,
                             resume=True)
    with pytest.raises(SystemExit, match=r"--reuse .*other settings \(duration\)"):
        shorter.reuse(shipped)
    with pytest.raises(SystemExit, match="--reuse .*missing.json"):
        shorter.reuse(tmp_path / "missing.json")


def test_mean_interval_is_students_t_over_the_seeds():
    mean, half = bench.mean_interval([0.2, 0.4, 0.6])
    assert mean == pytest.approx(0.4)
    assert half == pytest.approx(4.303 * 0.2 / math.sqrt(3))  # t(0.975, 2 df), sd 0.2
    assert bench.mean_interval([0.1, 0.3])[1] == pytest.approx(12.706 * math.sqrt(0.02)
                                                              / math.sqrt(2))
    assert bench.mean_interval([0.35]) == (0.35, None)
    assert bench.mean_interval([0.5] * 4) == (0.5, 0.0)
    with pytest.raises(ValueError, match="at least one"):
        bench.mean_interval([])
    assert bench.interval_text(0.315, 0.042) == "31.5 % ±4.2"
    assert bench.interval_text(0.315, None) == "31.5 % (n=1)"


def run(system, seed, lenient, strict=0.0):
    return {"system": system, "seed": seed,
            "scores": {t: {"strict": strict, "lenient": x} for t, x in lenient.items()}}


RUNS = [run("astraflow", 0, {"300": 0.1, "600": 0.5}),
        run("astraflow", 1, {"300": 0.3, "600": 0.4}),
        run("trl", 0, {"300": 0.6, "600": 0.7}),
        run("trl", 1, {"300": 0.2, "600": 0.55})]


def test_the_curves_table_puts_both_systems_and_metrics_side_by_side():
    curve = bench.curves(RUNS, ["astraflow", "trl"], [300.0, 600.0])
    assert curve["astraflow"]["lenient"]["300"]["mean"] == pytest.approx(0.2)
    assert curve["trl"]["lenient"]["600"]["n"] == 2
    table = bench.curves_table(curve, {"strict": 0.0, "lenient": 0.01}, [300.0, 600.0])
    lines = table.splitlines()
    assert lines[0] == ("| t (s) | astraflow strict | astraflow lenient | trl strict "
                        "| trl lenient |")
    assert lines[2] == "| 0 | 0.0 % | 1.0 % | 0.0 % | 1.0 % |"
    half = 12.706 * statistics.stdev([0.1, 0.3]) / math.sqrt(2)
    assert lines[3].split(" | ")[2] == f"20.0 % ±{100 * half:.1f}"
    one = bench.curves(RUNS[:1], ["astraflow"], [300.0])
    assert bench.curves_table(one, {"strict": 0, "lenient": 0}, [300.0]).splitlines()[3] \
        == "| 300 | 0.0 % (n=1) | 10.0 % (n=1) |"


def test_time_to_target_per_seed_and_the_ratio_of_the_means():
    assert bench.time_to(RUNS[0]["scores"], "lenient", 0.5) == 600.0
    assert bench.time_to(RUNS[1]["scores"], "lenient", 0.5) is None
    times = bench.times_to_target(RUNS, ["astraflow", "trl"], 0.5)
    assert times["systems"]["astraflow"] == {"seconds": {0: 600.0, 1: None}, "reached": 1,
                                             "n": 2, "mean": 600.0, "floor": 600.0}
    assert times["systems"]["trl"]["mean"] == 450.0 and times["ratio"] == pytest.approx(4 / 3)
    lines = bench.times_table(times).splitlines()
    assert lines[2] == "| astraflow | 600 s | not reached | 600 s (1 of 2) | >= 600 s |"
    assert lines[3] == "| trl | 300 s | 600 s | 450 s (2 of 2) | 450 s |"
    assert lines[-2] == "AstraFlow / TRL, ratio of the means: 1.33"
    # astraflow's unreached seed is later than 600 s: the true ratio is at least 600 / 450
    assert times["bound"] == {"ratio": pytest.approx(4 / 3), "side": ">="}
    assert lines[-1] == ("With the seeds that never reached it at their last checkpoint: "
                         "at least 1.33")
    alone = bench.times_to_target(RUNS[:2], ["astraflow"], 0.9)
    assert alone["ratio"] is None and alone["systems"]["astraflow"]["mean"] is None
    assert bench.times_table(alone).splitlines()[-1].endswith("- (not reached by both)")


def test_the_ratio_bound_takes_the_side_of_the_system_whose_seeds_fell_short():
    def times(reached: int, n: int, floor: float) -> dict:
        return {"reached": reached, "n": n, "floor": floor}

    assert bench.ratio_bound(times(4, 4, 1050.0), times(3, 4, 1425.0)) \
        == {"ratio": pytest.approx(1050 / 1425), "side": "<="}
    assert bench.ratio_bound(times(2, 2, 900.0), times(2, 2, 600.0))["side"] == "="
    assert bench.ratio_bound(times(1, 2, 900.0), times(1, 2, 600.0)) is None  # both short
    assert bench.ratio_bound(times(0, 2, 1800.0), times(2, 2, 600.0)) is None
    assert bench.ratio_bound(None, times(2, 2, 600.0)) is None


def test_the_pace_counts_updates_and_samples_by_checkpoint_and_the_first_update():
    doc = yaml.safe_load((REPO / "topology" / "smollm2.yaml").read_text())
    per = bench.samples_per_update(doc, {"trl": {"lr": 1e-5, "num_generations": 8}})
    assert per == {"astraflow": 4 * 8, "trl": 8, "trl-usual": 8}  # 4 groups of 8; 1 x 8
    chosen = {"astraflow": {"lr": 1e-5, bench.batch_path(doc): 2},
              "trl-usual": {"lr": 1e-5, "prompts": 4}}
    assert bench.samples_per_update(doc, chosen) == {"astraflow": 16, "trl": 8, "trl-usual": 32}
    assert bench.samples_per_update(doc, {"trl": {"per_device_train_batch_size": 16}})["trl"] \
        == 16
    assert [bench.updates_at(x) for x in ("v49", "step 78", None, "v0")] == [49, 78, 0, 0]
    runs = [{**RUNS[0], "at": {"300": "v40", "600": "v90"}, "first_update_s": 20.0},
            {**RUNS[1], "at": {"300": "v50", "600": None}},
            {**RUNS[2], "at": {"300": "step 80", "600": "step 170"}, "first_update_s": 14.0},
            {**RUNS[3], "at": {"300": "step 70"}, "first_update_s": 16.0}]
    paces = bench.pace(runs, ["astraflow", "trl"], [300.0, 600.0], per)
    assert paces["astraflow"]["checkpoints"]["300"] == {"updates": 45.0, "samples": 1440.0,
                                                      "n": 2}
    assert paces["astraflow"]["checkpoints"]["600"]["updates"] == 45.0  # none yet counts 0
    assert paces["trl"]["checkpoints"]["600"] == {"updates": 170.0, "samples": 1360.0, "n": 1}
    assert (paces["astraflow"]["first_update_s"], paces["astraflow"]["first_n"]) == (20.0, 1)
    assert paces["trl"]["first_update_s"] == 15.0
    lines = bench.pace_table(paces, [300.0, 600.0]).splitlines()
    assert lines[0] == ("| t (s) | astraflow updates | astraflow samples | trl updates "
                        "| trl samples |")
    assert lines[2] == "| 300 | 45 | 1,440 | 75 | 600 |"
    assert lines[-2] == "Samples an update trains: astraflow 32, trl 8."
    assert lines[-1] == ("First update after the start: astraflow 20 s (1 of 2 seeds record "
                         "it), trl 15 s (2 of 2 seeds record it).")


@pytest.mark.parametrize("flags,bf16", [({"amx_bf16", "avx512_bf16"}, True), (set(), False)])
def test_trl_computes_in_bf16_where_astraflows_best_precision_would(flags, bf16, monkeypatch):
    import astraflow.models.precision as precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    assert bench.trl_base() == {**bench.TRL_BASE, "bf16": bf16}
    assert bench.parse_trl_options(["bf16=false"])["bf16"] == [False]  # still the user's


def test_trl_runs_its_own_options_its_lr_and_the_seed():
    setup = {"prompts": 4, "temperature": 1.0}
    kw = bench.trl_config_kwargs(setup, {"lr": 5e-6, **bench.TRL_BASE}, 2, Path("/x"))
    assert kw["learning_rate"] == 5e-6 and kw["seed"] == 2
    assert (kw["num_generations"], kw["max_completion_length"], kw["beta"]) == (8, 8, 0.0)
    assert kw["per_device_train_batch_size"] == 8  # one prompt, 8 generations
    kw = bench.trl_config_kwargs(setup, {"lr": 1e-5, "num_generations": 4,
                                         "loss_type": "dr_grpo",
                                         "scale_rewards": "none"}, 0, Path("/x"))
    assert kw["per_device_train_batch_size"] == 4 and kw["loss_type"] == "dr_grpo"
    assert kw["scale_rewards"] == "none"
    kw = bench.trl_config_kwargs(setup, {"lr": 1e-5, "per_device_train_batch_size": 8}, 0,
                                 Path("/x"))
    assert kw["per_device_train_batch_size"] == 8
    kw = bench.trl_config_kwargs(setup, {"lr": 1e-5, "prompts": 4, **bench.TRL_BASE}, 0,
                                 Path("/x"))
    assert kw["per_device_train_batch_size"] == 32 and "prompts" not in kw  # 4 prompts x 8


def sweep_args(**over):
    args = argparse.Namespace(sweep_lrs=[], trl_option=[], astraflow_option=[], sweep=True,
                              sweep_prompts=[1, 2, 4])
    for k, v in over.items():
        setattr(args, k, v)
    return args


def test_the_sweep_varies_prompts_a_step_with_the_lr_for_every_system():
    doc = yaml.safe_load((REPO / "topology" / "smollm2.yaml").read_text())
    grids = bench.settings_of(sweep_args(), doc, list(bench.SYSTEMS))
    path = bench.batch_path(doc)
    assert path == "processors.batcher.options.batch_size"
    assert {(s["lr"], s[path]) for s in grids["astraflow"]} == {
        (lr, n) for lr in (3.3e-6, 1e-5, 3.3e-5) for n in (1, 2, 4)}
    for system in bench.TRL_SYSTEMS:
        assert {(s["lr"], s["prompts"]) for s in grids[system]} == {
            (lr, n) for lr in bench.TRL_LRS for n in (1, 2, 4)}
    # without a sweep: TRL one prompt a step (its usual), AstraFlow the topology's batch
    fixed = bench.settings_of(sweep_args(sweep=False), doc, ["astraflow", "trl"])
    assert fixed["trl"][0]["prompts"] == 1 and path not in fixed["astraflow"][0]
    # an option that names the step itself is left alone
    own = bench.settings_of(sweep_args(trl_option=["per_device_train_batch_size=16"],
                                       astraflow_option=[f"{path}=[2]"]), doc,
                            ["astraflow", "trl"])
    assert all("prompts" not in s for s in own["trl"])
    assert {s[path] for s in own["astraflow"]} == {2}


def test_the_sweep_runs_the_systems_in_turn_setting_by_setting_and_seed_by_seed():
    grids = {"astraflow": [{"lr": 1}, {"lr": 2}], "trl": [{"lr": 3}, {"lr": 4}, {"lr": 5}]}
    assert bench.sweep_order(["astraflow", "trl"], grids, [0, 1]) == [
        (0, 0, "astraflow"), (0, 0, "trl"), (0, 1, "astraflow"), (0, 1, "trl"), (0, 2, "trl"),
        (1, 0, "astraflow"), (1, 0, "trl"), (1, 1, "astraflow"), (1, 1, "trl"), (1, 2, "trl")]


def test_trl_usual_prompts_plainly_and_is_scored_on_that_prompt(monkeypatch):
    class Tok:
        def apply_chat_template(self, messages, tokenize, add_generation_prompt):
            assert not tokenize and add_generation_prompt
            return "<user>" + "".join(m["content"] for m in messages) + "<assistant>"

    text = bench.usual_prompt(Tok(), {"prompt": "What is 55+20? Answer with the number only."})
    assert text == "<user>What is 55 + 20? Answer with the number only.<assistant>"
    made = []
    monkeypatch.setattr(bench, "make_scorer", lambda doc, dataset=None, size=None, usual=False:
                        made.append(usual) or {"usual": usual})
    scorers = bench.system_scorers({}, ["astraflow", "trl", "trl-usual"])
    assert sorted(made) == [False, True]  # one scorer a kind of prompt
    assert [scorers[s]["usual"] for s in ("astraflow", "trl", "trl-usual")] == [False, False,
                                                                                 True]


def test_a_trl_run_leaves_an_external_broker_alone(monkeypatch):
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "localhost:1")
    assert bench.stop_broker({}) == "external, not stopped"
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP")
    assert bench.stop_broker({"kafka": {"bootstrap_servers": "x:9092"}}) == \
        "external, not stopped"


def test_the_dry_run_prints_the_plan_and_runs_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(bench, "one_run", lambda *a, **k: pytest.fail("a run was started"))
    monkeypatch.setattr(bench, "ensure_model", lambda *a: pytest.fail("the model was loaded"))
    assert bench.main(["--dry-run", "--runs-dir", str(tmp_path), "--sweep-prompts", "1,4",
                       "--seeds", "2"]) == 0
    out = capsys.readouterr().out
    assert "sweep: 18 runs of 300 s" in out  # 3 systems x 3 lrs x 2 prompt counts x 1 seed
    assert "then 6 runs of 1800 s" in out
    assert '"prompts": 4' in out and '"processors.batcher.options.batch_size": 4' in out
    assert '"packages"' in out and '"cpu_flags"' in out


@pytest.mark.parametrize("argv,msg", [
    (["--systems", "astraflow,verl"], "--systems"),
    (["--duration", "60", "--checkpoints", "30,120"], "--checkpoints must lie"),
    (["--seeds", "0"], "--seeds and --sweep-seeds must be at least 1"),
    (["--sweep-seeds", "0"], "--seeds and --sweep-seeds must be at least 1"),
    (["--reward", "nope"], "unknown reward 'nope'"),
    (["--sweep-lrs", "trl=x"], "must be numbers"),
    (["--sweep-metric", "mean"], "--sweep-metric"),
    (["--val-size", "0"], "--val-size must be at least 1"),
])
def test_bad_options_get_a_one_line_error(argv, msg, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["--runs-dir", str(tmp_path), "--systems", "astraflow", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert msg in err[-1]


def test_the_results_page_shows_curves_times_sweep_and_where_the_time_went():
    report = load_bench("report")
    args = argparse.Namespace(checkpoints=[300.0, 600.0], target=0.5)
    runs = [{**r, "where": "astraflow: 40 versions", "steps": 12,
             "at": {"300": "v4" if r["system"] == "astraflow" else "step 9"}} for r in RUNS]
    data = {"bench": "learning", "seeds": [0, 1], "eval_size": 200, "metrics": bench.METRICS,
            "chosen": {"astraflow": {"lr": 3e-5}},
            **bench.results_of(args, ["astraflow", "trl"], runs, {"strict": 0, "lenient": 0},
                               {"astraflow": 32, "trl": 8}),
            "sweep": {"duration_s": 180, "seed": 0, "metric": "lenient", "validation_size": 200,
                      "table": bench.sweep_table([row(2e-6, 0.1, 0.4)], {"trl": {"lr": 2e-6}}),
                      "tied": ["astraflow"]}}
    page = "\n\n".join(report.render("learning", json.loads(json.dumps(data))))
    assert data["table"] in page and data["time_table"] in page
    assert data["pace_table"] in page and "| 300 | 4 | 128 | 9 | 72 |" in page
    assert data["sweep"]["table"] in page
    assert "- seed 0: astraflow: 40 versions" in page and "- seed 1: trl: 12 optimizer steps" \
        in page
    assert "| chosen.astraflow.lr | 3e-05 |" in page
    assert "mean and 95 % interval over 2 seed(s)" in page
    assert "Tied at the top, chosen by the tie rule: astraflow." in page
    assert "Sweep: 180 s a run, seed 0, scored" in page
    data["sweep"]["seeds"] = [0, 1]
    page = "\n\n".join(report.render("learning", json.loads(json.dumps(data))))
    assert "Sweep: 180 s a run, seeds 0, 1 (scores: their mean), scored" in page


def test_a_math_topology_is_scored_and_trained_with_math_verify():
    """smollm2-gsm8k.yaml: both metrics by math-verify (strict: the marked answer), the
    workflow's own reward and completion length; on addition, the workflow's reward (a
    topology without one: first_integer) and TRL's 8 tokens."""
    gsm8k = yaml.safe_load((REPO / "topology" / "smollm2-gsm8k.yaml").read_text())
    addition = yaml.safe_load((REPO / "topology" / "smollm2.yaml").read_text())
    assert bench.task_metrics(gsm8k) == bench.MATH_METRICS
    assert bench.task_defaults(gsm8k) == {"reward": "math_verify", "max_completion_length": 256}
    assert bench.task_metrics(addition) == bench.METRICS
    shaped = addition["pools"]["local"]["workflows"]["single_turn"]["reward"]
    assert bench.task_defaults(addition) == {"reward": shaped, "max_completion_length": 8}
    del addition["pools"]["local"]["workflows"]["single_turn"]["reward"]
    assert bench.task_defaults(addition)["reward"] == "first_integer"
    assert bench.parse_trl_options([], 256)["max_completion_length"] == [256]
    assert bench.parse_trl_options(["max_completion_length=64"], 256)[
        "max_completion_length"] == [64]  # an option given wins
