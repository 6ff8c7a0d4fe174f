"""`astraflow up`'s decisions that need no broker: when, and how, a tiny model is
(re)written -- `model init` for a solver, `model init-role` for a verifier/selector, both
judged by the recipe they leave in INIT_RECIPE."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow import launcher
from astraflow.cli import build_parser
from astraflow.launcher import (
    MissingModel,
    _model_init_command,
    _tiny_model_outdated,
    _write_tiny_models,
)
from astraflow.model import INIT_RECIPE, init_recipe
from astraflow.roles import OLD_ROLE_RECIPE
from astraflow.topology import PolicySpec, parse_topology

REPO = Path(__file__).resolve().parents[1]


def _written_by(spec: PolicySpec) -> None:
    """Leave the recipe `model init` would leave for ``spec`` in its model directory."""
    args = build_parser().parse_args(_model_init_command(spec))
    Path(args.dir).mkdir(parents=True, exist_ok=True)
    (Path(args.dir) / INIT_RECIPE).write_text(json.dumps(init_recipe(args)))


def test_tiny_model_is_rewritten_only_when_its_recipe_changes(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start_steps=2000, warm_start_slip=0.7)
    assert _tiny_model_outdated(spec) == ""  # no recipe: not ours, or not written yet
    _written_by(spec)
    assert _tiny_model_outdated(spec) == ""
    # the recipe records what shapes the model, not where it lives
    recipe = json.loads((tmp_path / "m" / INIT_RECIPE).read_text())
    assert recipe["warm_start_steps"] == 2000 and recipe["carry_slip"] == 0.7
    assert "dir" not in recipe

    for changed in (
        spec.model_copy(update={"warm_start_slip": 0.5}),
        spec.model_copy(update={"warm_start_steps": 100}),
        spec.model_copy(update={"init_args": ["--levels", "1"]}),
    ):
        why = _tiny_model_outdated(changed)
        assert why.startswith("the topology changed how it is made"), why
    assert "carry_slip 0.7 -> 0.5" in _tiny_model_outdated(
        spec.model_copy(update={"warm_start_slip": 0.5}))
    # a model the user brought is never rewritten
    assert _tiny_model_outdated(
        spec.model_copy(update={"init_tiny": False, "warm_start_slip": 0.5})) == ""


def test_an_option_added_after_the_model_was_written_counts_as_its_default(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "m"), warm_start_steps=2000, warm_start_slip=0.7)
    _written_by(spec)
    recipe_file = tmp_path / "m" / INIT_RECIPE
    recipe = json.loads(recipe_file.read_text())
    for key in ("retry_share", "retry_slip"):  # options a newer `model init` has
        del recipe[key]
    recipe_file.write_text(json.dumps(recipe))
    assert _tiny_model_outdated(spec) == ""
    why = _tiny_model_outdated(spec.model_copy(update={"init_args": ["--retry-share", "0.25"]}))
    assert "retry_share 0.0 -> 0.25" in why, why


def test_a_verifier_is_written_by_init_role_with_the_topologys_slip(tmp_path):
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier", warm_start_steps=300,
                      init_args=["--levels", "1"])
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
    spec = PolicySpec(model=str(tmp_path / "v"), role="verifier", warm_start_steps=300,
                      init_args=["--levels", "1"])
    assert _tiny_model_outdated(spec) == ""
    _written_by(spec)
    assert _tiny_model_outdated(spec) == ""
    for update, change in (
        ({"role": "selector"}, "role verifier -> selector"),
        ({"warm_start_steps": 400}, "warm_start_steps 300 -> 400"),
        ({"warm_start_slip": 0.5}, "carry_slip 0.0 -> 0.5"),
        ({"init_args": ["--levels", "1,2"]}, "levels 1 -> 1,2"),
        ({"init_args": ["--levels", "1", "--label-noise", "0.1"]}, "label_noise 0.02 -> 0.1"),
        ({"init_args": ["--levels", "1", "--seed", "3"]}, "seed 0 -> 3"),
        ({"role": "solver"}, "model_command init-role -> init"),  # now a solver's model
    ):
        why = _tiny_model_outdated(spec.model_copy(update=update))
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
        assert cmd[:3] == [launcher.sys.executable, "-m", "astraflow.cli"] and check
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

    data["policies"]["verifier"]["warm_start_steps"] = 200
    data["policies"]["verifier"]["init_args"] = ["--levels", "1"]
    assert _write_tiny_models(parse_topology(data)) is True
    assert ran == [_model_init_command(parse_topology(data).policies["verifier"])]
    ran.clear()

    # a model without a recipe is never rewritten; a missing one up may not write is an error
    (tmp_path / "solver" / INIT_RECIPE).unlink()
    data["policies"]["solver"]["warm_start_steps"] = 10
    assert _write_tiny_models(parse_topology(data)) is False and ran == []
    data["policies"]["verifier"].update(model=str(tmp_path / "elsewhere"), init_tiny=False)
    with pytest.raises(MissingModel, match="verifier"):
        _write_tiny_models(parse_topology(data))
    assert ran == []
