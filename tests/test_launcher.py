"""`astraflow up`'s decisions that need no broker: when the tiny model is (re)written."""

from __future__ import annotations

import json
from pathlib import Path

from astraflow.cli import build_parser
from astraflow.launcher import _model_init_command, _tiny_model_outdated
from astraflow.model import INIT_RECIPE, init_recipe
from astraflow.topology import PolicySpec


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
