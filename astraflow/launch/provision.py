"""The models ``astraflow up`` provides before it starts a run: a tiny model written (or
rewritten when the topology changed its recipe) with ``astraflow model init``, a packaged
GGUF imported, or ``MissingModel`` naming what to do."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astraflow.config.overrides import WARM_START_FLAGS
from astraflow.config.topology import PolicySpec, Topology
from astraflow.launch.plan import astraflow_command

# the recipe a `model init` (`model init-role`) command line leaves (its parsed options:
# astraflow.models.recipe.init_recipe), given by the command line's parser
RecipeOf = Callable[[list[str]], dict[str, Any]]


class MissingModel(Exception):
    """A policy's model is missing and ``astraflow up`` may not write it."""


def write_tiny_models(topo: Topology, recipe_of: RecipeOf | None = None) -> bool:
    """Write the tiny model of every policy that lacks one or (given ``recipe_of``) whose
    recipe the topology changed (``model_init_command``: ``model init`` or ``model
    init-role``, one at a time); True if any was written. MissingModel for a missing model
    that ``up`` may not write (``init_tiny: false``)."""
    wrote = False
    for policy, spec in topo.policies.items():
        wrote = write_policy_model(policy, spec, recipe_of) or wrote
    return wrote


def write_policy_model(policy: str, spec, recipe_of: RecipeOf | None = None) -> bool:
    """Write (or import) the model of one policy as its topology entry says, unless it is
    there (and, given ``recipe_of``, up to date); True if it was written."""
    if spec.import_from:
        return import_model(policy, spec)
    stale = tiny_model_outdated(spec, recipe_of) if recipe_of is not None else ""
    if not stale and Path(spec.model, "config.json").exists():
        return False
    if not spec.init_tiny:
        raise MissingModel(f"policy {policy}: no model at {spec.model}")
    what = "default" if spec.role == "solver" else spec.role
    print(f"writing the tiny {what} model for {policy} to {spec.model} (warm start "
          f"{spec.warm_start.steps} steps, carry slip {spec.warm_start.slip})"
          f"{': ' + stale if stale else ''}", flush=True)
    subprocess.run(astraflow_command(*model_init_command(spec)), check=True)
    return True


def import_model(policy: str, spec) -> bool:
    """Import the policy's pretrained model (``import_from``) when its directory has none;
    True if it was imported."""
    from astraflow.models.recipe import INIT_RECIPE

    if Path(spec.model, "config.json").exists():
        if Path(spec.model, INIT_RECIPE).exists():  # a tiny model, not this import
            raise MissingModel(
                f"policy {policy}: {spec.model} holds a tiny model written by `astraflow "
                f"model init` ({INIT_RECIPE}), not one imported from {spec.import_from}; "
                f"delete that directory or give the policy another `model:`")
        return False
    source = (["--gguf", spec.import_from] if spec.import_from.endswith(".gguf")
              else [spec.import_from])
    print(f"importing {spec.import_from} for {policy} into {spec.model}", flush=True)
    done = subprocess.run(astraflow_command("model", "import", *source, spec.model))
    if done.returncode:
        raise MissingModel(f"policy {policy}: importing {spec.import_from} failed")
    return True


def model_init_command(spec: PolicySpec) -> list[str]:
    """The ``astraflow`` arguments that write the tiny model of ``spec``: ``model init``
    (the solver's answer format) or, for a verifier/selector, ``model init-role``; each
    warm-start setting the file gives as its flag (``WARM_START_FLAGS``).

    ``--warm-start-steps`` and ``--carry-slip`` are always passed: the topology's
    ``warm_start`` (default 0 each) decides, not the command's own default
    (``init-role``'s slip is 0.5).
    """
    ws = spec.warm_start
    common: list[str] = []
    for flag in WARM_START_FLAGS:
        value = getattr(ws, flag.field)
        if value is None or value is False:
            continue
        common += [flag.name] if value is True else [flag.name, str(value)]
    if spec.role != "solver":
        return ["model", "init-role", spec.model, "--role", spec.role, *common]
    return ["model", "init", spec.model, *common]


def tiny_model_outdated(spec, recipe_of: RecipeOf) -> str:
    """Why the tiny model at ``spec.model`` must be rewritten ("" when it need not be).

    Only a model that ``astraflow model init`` or ``model init-role`` wrote (both leave
    their recipe file) and whose recipe differs from what the topology asks for -- the
    command included, so a solver model becomes a verifier's and back -- is rewritten;
    any other model is left alone. ``recipe_of(argv)``: the recipe the command line
    ``argv`` leaves (its parser is the command line's: ``astraflow.cli.up``).
    """
    from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE

    if not spec.init_tiny:
        return ""
    recipe_file = Path(spec.model, INIT_RECIPE)
    if not recipe_file.is_file():
        if Path(spec.model, OLD_ROLE_RECIPE).is_file():
            return f"written by an older `model init-role` ({OLD_ROLE_RECIPE}, no {INIT_RECIPE})"
        return ""
    try:
        recipe = json.loads(recipe_file.read_text())
    except (OSError, ValueError):
        return ""
    command = model_init_command(spec)
    want = recipe_of(command)
    # an option added after the model was written counts as its default
    defaults = recipe_of([*command[:3], *(["--role", spec.role] if spec.role != "solver"
                                         else [])])
    diff = [f"{k} {recipe.get(k, defaults.get(k))} -> {v}" for k, v in want.items()
            if recipe.get(k, defaults.get(k)) != v]
    return "the topology changed how it is made (" + ", ".join(diff) + ")" if diff else ""
