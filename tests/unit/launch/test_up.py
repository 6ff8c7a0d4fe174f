"""`astraflow up`'s decisions that need no broker: when, and how, a tiny model is
(re)written -- `model init` for a solver, `model init-role` for a verifier/selector, both
judged by the recipe they leave in INIT_RECIPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow.cli.main import build_parser
from astraflow.config.topology import PolicySpec, parse_topology
from astraflow.launch import up as launcher
from astraflow.launch.up import (
    MissingModel,
    _model_init_command,
    _tiny_model_outdated,
    _write_tiny_models,
)
from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE, init_recipe

REPO = Path(__file__).resolve().parents[3]


def _warm(spec: PolicySpec, **update) -> PolicySpec:
    """``spec`` with ``update`` applied to its warm start."""
    return spec.model_copy(update={"warm_start": spec.warm_start.model_copy(update=update)})


def _written_by(spec: PolicySpec) -> None:
    """Leave the recipe `model init` would leave for ``spec`` in its model directory."""
    args = build_parser().parse_args(_model_init_command(spec))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / INIT_RECIPE).write_text(json.dumps(init_recipe(args)))


def test_tiny_model_is_rewritten_only_when_its_recipe_changes(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start={"steps": 2000, "slip": 0.7})
    assert _tiny_model_outdated(spec) == ""  # no recipe: not ours, or not written yet
    _written_by(spec)
    assert _tiny_model_outdated(spec) == ""
    # the recipe records what shapes the model, not where it lives
    recipe = json.loads((tmp_path / "m" / INIT_RECIPE).read_text())
    assert recipe["warm_start_steps"] == 2000 and recipe["carry_slip"] == 0.7
    assert "dir" not in recipe

    for changed in (
        _warm(spec, slip=0.5),
        _warm(spec, steps=100),
        _warm(spec, levels="1"),
    ):
        why = _tiny_model_outdated(changed)
        assert why.startswith("the topology changed how it is made"), why
    assert "carry_slip 0.7 -> 0.5" in _tiny_model_outdated(_warm(spec, slip=0.5))
    # a model the user brought is never rewritten
    assert _tiny_model_outdated(
        _warm(spec, slip=0.5).model_copy(update={"init_tiny": False})) == ""


def test_an_option_added_after_the_model_was_written_counts_as_its_default(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start={"steps": 2000, "slip": 0.7})
    _written_by(spec)
    recipe_file = tmp_path / "m" / INIT_RECIPE
    recipe = json.loads(recipe_file.read_text())
    for key in ("retry_share", "retry_slip"):  # options a newer `model init` has
        del recipe[key]
    recipe_file.write_text(json.dumps(recipe))
    assert _tiny_model_outdated(spec) == ""
    why = _tiny_model_outdated(_warm(spec, retry_share=0.25))
    assert "retry_share 0.0 -> 0.25" in why, why


def test_a_verifier_is_written_by_init_role_with_the_topologys_slip(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier",
                      warm_start={"steps": 300, "levels": "1"})
    cmd = _model_init_command(spec)
    assert cmd[:5] == ["model", "init-role", str(tmp_path / "v"), "--role", "verifier"]
    args = build_parser().parse_args(cmd)
    assert args.func.__name__ == "cmd_model_init_role"
    # init-role's own default slip is 0.5; the topology's default, 0, is what counts
    assert args.carry_slip == 0.0 and args.warm_start_steps == 300 and args.levels == "1"
    recipe = init_recipe(args)
    assert recipe["role"] == "verifier" and recipe["model_command"] == "init-role"
    assert {"label_noise", "levels", "seed", "carry_slip", "train_size"} <= set(recipe)
    assert "dir" not in recipe
    solver = _model_init_command(spec.model_copy(update={"role": "solver"}))
    assert solver[:3] == ["model", "init", str(tmp_path / "v")] and "--role" not in solver


def test_a_role_model_is_rewritten_only_when_its_recipe_changes(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier",
                      warm_start={"steps": 300, "levels": "1"})
    assert _tiny_model_outdated(spec) == ""
    _written_by(spec)
    assert _tiny_model_outdated(spec) == ""
    for changed, change in (
        (spec.model_copy(update={"role": "selector"}), "role verifier -> selector"),
        (_warm(spec, steps=400), "warm_start_steps 300 -> 400"),
        (_warm(spec, slip=0.5), "carry_slip 0.0 -> 0.5"),
        (_warm(spec, levels="1,2"), "levels 1 -> 1,2"),
        (_warm(spec, label_noise=0.1), "label_noise 0.02 -> 0.1"),
        (_warm(spec, seed=3), "seed 0 -> 3"),
        (spec.model_copy(update={"role": "solver"}), "model_command init-role -> init"),
    ):
        why = _tiny_model_outdated(changed)
        assert why.startswith("the topology changed how it is made") and change in why, why
    # a solver's model turned into a verifier's
    solver = spec.model_copy(update={"role": "solver", "model": str(tmp_path / "s")})
    _written_by(solver)
    assert "model_command init -> init-role" in _tiny_model_outdated(
        solver.model_copy(update={"role": "verifier"}))
    # a role model with only the recipe file of an older astraflow is rewritten once
    (tmp_path / "v" / INIT_RECIPE).rename(tmp_path / "v" / OLD_ROLE_RECIPE)
    assert "older `model init-role`" in _tiny_model_outdated(spec)
    assert _tiny_model_outdated(spec.model_copy(update={"init_tiny": False})) == ""
    (tmp_path / "v" / OLD_ROLE_RECIPE).unlink()
    assert _tiny_model_outdated(spec) == ""  # no recipe at all: not ours, left alone


def _solver_verifier(tmp_path) -> dict:
    data = yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())
    for name, spec in data["policies"].items():
        spec["model"] = str(tmp_path / name)
    return data


def test_up_writes_every_policys_model_the_same_way(tmp_path, monkeypatch):
    """One mechanism for all policies: missing or outdated models are written by the
    command `_model_init_command` gives, and only those."""
    ran: list[list[str]] = []

    def fake_run(cmd, check):  # what `model init` / `init-role` leave behind
        assert cmd[:3] == [launcher.sys.executable, "-m", "astraflow.cli.main"] and check
        ran.append(cmd[3:])
        args = build_parser().parse_args(cmd[3:])
        Path(args.dir).mkdir(parents=True, exist_ok=True)
        (Path(args.dir) / "config.json").write_text("{}")
        (Path(args.dir) / INIT_RECIPE).write_text(json.dumps(init_recipe(args)))

    monkeypatch.setattr(launcher.subprocess, "run", fake_run)
    data = _solver_verifier(tmp_path)
    topo = parse_topology(data)
    assert _write_tiny_models(topo) is True
    assert [c[:2] for c in ran] == [["model", "init"], ["model", "init-role"]]
    assert ran[1][ran[1].index("--role") + 1] == "verifier"
    assert ran[1][ran[1].index("--carry-slip") + 1] == "0.0"
    ran.clear()
    assert _write_tiny_models(topo) is False and ran == []  # nothing changed

    data["policies"]["verifier"]["warm_start"] = {"steps": 200, "levels": "1"}
    assert _write_tiny_models(parse_topology(data)) is True
    assert ran == [_model_init_command(parse_topology(data).policies["verifier"])]
    ran.clear()

    # a model without a recipe is never rewritten; a missing one up may not write is an error
    (tmp_path / "solver" / INIT_RECIPE).unlink()
    data["policies"]["solver"]["warm_start"]["steps"] = 10
    assert _write_tiny_models(parse_topology(data)) is False and ran == []
    data["policies"]["verifier"].update(model=str(tmp_path / "elsewhere"), init_tiny=False)
    with pytest.raises(MissingModel, match="verifier"):
        _write_tiny_models(parse_topology(data))
    assert ran == []


def test_an_imported_policy_never_starts_from_a_tiny_model_left_at_its_path(tmp_path,
                                                                          monkeypatch):
    ran: list[list[str]] = []
    monkeypatch.setattr(launcher.subprocess, "run",
                        lambda cmd: ran.append(cmd) or launcher.subprocess.CompletedProcess(
                            cmd, 0))
    spec = parse_topology({"run": "r", "policies": {"solver": {
        "model": str(tmp_path / "solver"), "init_tiny": False,
        "import_from": "smollm2"}}}).policies["solver"]
    assert launcher.write_policy_model("solver", spec) is True  # nothing there: imported
    assert ran[0][3:5] == ["model", "import"]
    (tmp_path / "solver").mkdir()
    (tmp_path / "solver" / "config.json").write_text("{}")
    assert launcher.write_policy_model("solver", spec) is False  # a model there: kept
    (tmp_path / "solver" / INIT_RECIPE).write_text("{}")  # ... unless it is a tiny one
    with pytest.raises(MissingModel, match="solver: .* holds a tiny model .* smollm2"):
        launcher.write_policy_model("solver", spec)
    assert len(ran) == 1


# --- the plan: each component's command line from the typed topology -------------------

def _flags(cmd: list[str]):
    """``cmd`` (an ``astraflow`` command line of the plan) parsed by the real CLI."""
    assert cmd[:3] == [launcher.sys.executable, "-m", "astraflow.cli.main"]
    return build_parser().parse_args(cmd[3:])


def test_the_default_plan_is_the_one_before_the_typed_topology():
    """topology/default.yaml's plan, flag for flag as `up` started it when the file carried
    argv lists (trainer_args, raas_args, feeder.args)."""
    from astraflow.config.topology import load_topology

    path = "topology/default.yaml"
    plan = {n: c[3:] for n, c in launcher.plan_processes(
        load_topology(REPO / path), path).items()}
    assert plan == {
        "trainer-actor": ["trainer", "run", "--topology", path, "--policy", "actor", "--model",
                          "runs/default/model", "--lr", "0.0001", "--anchor-interval", "10",
                          "--temperature", "1.0", "--top-p", "1.0", "--max-staleness", "4"],
        **{f"processor-{n}": ["processor", "run", n, "--topology", path, "--instance", "up"]
           for n in ("admission", "staleness", "router", "batcher")},
        "raas-local-0": ["raas", "run", "--topology", path, "--pool", "local", "--instance",
                         "local-0", "--n-samples", "8", "--policy-model",
                         "actor=runs/default/model", "--workflow-options",
                         'single_turn={"temperature": 1.0, "max_new_tokens": 8}'],
        "feeder": ["feeder", "run", "--topology", path, "--rate", "60.0", "--epochs", "0",
                   "--levels", "1,2"],
        "eval-actor": ["eval", "run", "--topology", path, "--policy", "actor", "--model",
                       "runs/default/model", "--every", "5", "--size", "200",
                       "--max-new-tokens", "8"],
    }


def test_max_staleness_is_set_once_per_policy():
    from astraflow.config.topology import load_topology

    topo = load_topology(REPO / "topology" / "solver-verifier.yaml")
    plan = launcher.plan_processes(topo, "t.yaml")
    for policy in ("solver", "verifier"):
        assert _flags(plan[f"trainer-{policy}"]).max_staleness == 16
        assert topo.processors[f"batcher-{policy}"].options["max_staleness"] == 16
    assert topo.processors["staleness"].options["max_staleness"] == 16
    data = _solver_verifier_data()
    data["policies"]["solver"]["max_staleness"] = 3
    data["policies"]["verifier"]["max_staleness"] = 3
    topo = parse_topology(data)
    assert _flags(launcher.plan_processes(topo, "t")["trainer-solver"]).max_staleness == 3
    assert topo.processors["batcher-verifier"].options["max_staleness"] == 3
    del data["policies"]["solver"]["max_staleness"]  # the one default
    with pytest.raises(Exception, match=r"processors.staleness: .*solver 4, verifier 3"):
        parse_topology(data)


def _solver_verifier_data() -> dict:
    return yaml.safe_load((REPO / "topology" / "solver-verifier.yaml").read_text())


def test_every_typed_trainer_field_reaches_its_trainer_flag():
    """Each TrainerSpec field set to a non-default value comes out as that value of the
    `trainer run` flag; unset ones leave the trainer's own defaults."""
    from astraflow.config.topology import TrainerSpec

    values = dict(lr=0.5, anchor_interval=7, state_interval=3, state_max_lag=2,
                  keep_optimizer=5, keep_versions=0, seed=9, weight_decay=0.1,
                  adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6, max_grad_norm=0.5,
                  clip_low=0.1, clip_high=0.3, tis_cap=3.0, micro_batch_tokens=512,
                  autocast="bf16", gradient_checkpointing=True, forward_on="master",
                  dtype="bf16", publish_dtype="same", device="cuda", threads=2,
                  deterministic=True, max_steps=11, blob_store="file:///b", state_dir="/s",
                  loss="decoupled_ppo", tis_mask=True, backend="megatron", minibatches=4)
    assert set(values) | {"std_normalize", "share_prompt", "micro_batch_size",
                          "m2_threshold"} == set(TrainerSpec.model_fields)
    data = _solver_verifier_data()
    data["policies"]["solver"]["trainer"] = {**values, "std_normalize": False,
                                             "share_prompt": False}
    plan = launcher.plan_processes(parse_topology(data), "t")
    args = vars(_flags(plan["trainer-solver"]))
    assert {k: args[k] for k in values} == values
    assert args["no_std_normalize"] and args["no_share_prompt"]
    # the verifier sets only lr and anchor_interval: the rest is the trainer's default
    default = vars(build_parser().parse_args(["trainer", "run", "--topology", "t", "--policy",
                                              "verifier", "--model", "m"]))
    verifier = vars(_flags(plan["trainer-verifier"]))
    assert {k for k in default if default[k] != verifier[k]} == {
        "model", "lr", "max_staleness"}
    # m2po reads m2_threshold (the other losses refuse it: see test_topology)
    data["policies"]["solver"]["trainer"] = {"loss": "m2po", "m2_threshold": 0.01}
    args = vars(_flags(launcher.plan_processes(parse_topology(data), "t")["trainer-solver"]))
    assert (args["loss"], args["m2_threshold"]) == ("m2po", 0.01)


def test_warm_start_feeder_pool_and_eval_fields_reach_their_flags():
    data = _solver_verifier_data()
    data["policies"]["solver"]["warm_start"].update(levels=[1, 2, 3], lr=0.01, batch_size=16,
                                                    train_size=100, eval_size=10)
    data["feeder"].update(seed=3, count=50, size=10, split="eval", from_start=True,
                          dataset={"path": "d.jsonl", "prompt_field": "q"})
    data["pools"]["local"].update(device="cuda", prefix_cache_mib=0, session_timeout_ms=9000,
                                  follow_weights=False, engine_options={"dtype": "float16"},
                                  speed=0.3)
    data["eval"] = {"levels": "1", "size": 30}
    topo = parse_topology(data)
    init = build_parser().parse_args(_model_init_command(topo.policies["solver"]))
    assert (init.levels, init.lr, init.batch_size, init.train_size, init.eval_size,
            init.warm_start_until, init.seed, init.retry_share) == (
        "1,2,3", 0.01, 16, 100, 10, 0.9, 1, 0.25)
    verifier = build_parser().parse_args(_model_init_command(topo.policies["verifier"]))
    assert verifier.blind and verifier.label_noise == 0.15 and verifier.carry_slip == 0.0
    plan = launcher.plan_processes(topo, "t")
    feeder = _flags(plan["feeder"])
    assert (feeder.seed, feeder.count, feeder.size, feeder.split, feeder.from_start,
            feeder.dataset, feeder.prompt_field, feeder.policy, feeder.workflow) == (
        3, 50, 10, "eval", True, "d.jsonl", "q", ["solver", "verifier"], "solve_verify")
    raas = _flags(plan["raas-local-0"])
    assert (raas.device, raas.prefix_cache_mib, raas.session_timeout_ms,
            raas.no_follow_weights, raas.engine_options, raas.tasks_per_transaction,
            raas.speed) == ("cuda", 0.0, 9000, True, {"dtype": "float16"}, 8, 0.3)
    assert dict(raas.workflow_options)["solve_verify"] == {
        "temperature": 1.0, "max_new_tokens": 8, "blind": True, "verdicts_per_prompt": 4}
    solver, verifier = _flags(plan["eval-solver"]), _flags(plan["eval-verifier"])
    assert (solver.every, solver.size, solver.levels, solver.blind) == (5, 30, "1", False)
    assert (verifier.every, verifier.size, verifier.blind, verifier.role) == (
        20, 30, True, "verifier")


def test_pool_engine_options_pass_on_only_what_the_file_sets():
    data = _solver_verifier_data()
    data["pools"]["local"].update(engine="vllm", engine_options={"cpus": 1, "kv_cache_gib": 1})
    raas = _flags(launcher.plan_processes(parse_topology(data), "t")["raas-local-0"])
    assert raas.engine == "vllm" and raas.engine_options == {"cpus": 1, "kv_cache_gib": 1}


def test_up_ends_with_a_few_lines_and_where_the_summary_is(tmp_path):
    from astraflow.launch.up import closing_lines

    summary = {"run": "r-2", "seconds": 61.2, "staleness_dropped": 3.0, "restarts": {},
               "policies": {"actor": {"version": 12, "train_reward": 0.5, "eval_accuracy": 0.25,
                                      "eval_version": 10}},
               "plot": str(tmp_path / "summary.png")}
    text = closing_lines(summary, tmp_path)
    assert len(text.splitlines()) == 4
    assert "actor: version 12, train reward 0.500, held-out accuracy 0.250 at v10" in text
    assert str(tmp_path / "summary.json") in text and "restarts: none" in text


def test_stale_drops_are_counted_per_stage_in_the_line_and_the_closing_lines(tmp_path):
    from astraflow.launch.up import Progress, closing_lines
    from astraflow.wire.records import ComponentStatus

    progress = Progress()
    for cid, kind, metrics in (
            ("staleness/a", "processor", {"staleness/dropped": 4.0}),
            ("staleness/b", "processor", {"staleness/dropped": 1.0}),
            ("batcher/a", "processor", {"batcher/dropped_stale": 2.0}),
            ("staleness/a", "processor", {"staleness/dropped": 6.0}),  # newer: replaces 4
            ("trainer.actor/0", "trainer", {"trainer/stale_dropped_total": 3.0,
                                            "trainer/stale_dropped_groups": 1.0})):
        progress.fold(ComponentStatus(component_id=cid, kind=kind, host="h", policy="actor",
                                      metrics=metrics))
    assert progress.drops_by_stage() == {"filter": 7.0, "batcher": 2.0, "trainer": 3.0}
    assert progress.stale_dropped == 12.0
    assert "stale drops filter 7 batcher 2 trainer 3" in progress.line(0)
    summary = {"run": "r", "seconds": 1.0, "staleness_dropped": 12.0, "restarts": {},
               "staleness_dropped_by_stage": progress.drops_by_stage(), "policies": {}}
    assert "dropped: 12 (filter 7, batcher 2, trainer 3)" in closing_lines(summary, tmp_path)


def test_a_runs_plots_are_drawn_from_its_summary(tmp_path):
    import json

    from astraflow.cli.main import main

    series = [{"t": 5.0 * i, "version/actor": float(i), "reward/actor": 0.1 * i,
               "staleness_mean/actor": 1.5, "stale_dropped": float(i), "lag/tasks": 30.0 - i}
              for i in range(6)]
    summary = {"run": "r", "versions": {"actor": 5}, "series": series,
               "eval": {"actor": [{"t": 10.0, "version": 2, "accuracy": 0.3}]}}
    (tmp_path / "r").mkdir()
    (tmp_path / "r" / "summary.json").write_text(json.dumps(summary))
    assert main(["run", "plot", "r", "--runs-dir", str(tmp_path)]) == 0
    for name in ("summary.png", "plots/versions.png", "plots/staleness.png", "plots/lag.png"):
        assert (tmp_path / "r" / name).stat().st_size > 1000
    assert main(["plot", "missing", "--runs-dir", str(tmp_path)]) == 2
