"""The models ``astraflow up`` (and a trainer whose model is missing) provides before it
starts: a tiny model written (or rewritten when the topology changed its recipe) as
``astraflow model init`` (``model init-role``) writes it, a packaged GGUF imported as
``model import`` does, or ``MissingModel`` naming what to do.

Both are called in this process (``astraflow.roles.tiny_models``,
``astraflow.models.gguf.import_source``), with the commands' output. A warm start trains
here with torch's own thread count (``OMP_NUM_THREADS`` when set), as the command's
process did; a trainer sets its ``threads`` and seed after its model is written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from astraflow.config.overrides import WARM_START_FLAGS
from astraflow.config.topology import PolicySpec, Topology
from astraflow.errors import AstraflowError
from astraflow.models.errors import ModelError
from astraflow.models.gguf import import_source
from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE, RoleInit, SolverInit, recipe
from astraflow.roles.tiny_models import write_tiny_model


class MissingModel(Exception):
    """A policy's model is missing and ``astraflow up`` may not write it."""


def write_tiny_models(topo: Topology, *, rewrite_outdated: bool = False) -> bool:
    """Write the model of every policy that lacks one or (``rewrite_outdated``, as ``up``
    does) whose recipe the topology changed (``write_policy_model``, one at a time); True
    if any was written. MissingModel for a missing model that may not be written
    (``init_tiny: false``)."""
    wrote = False
    for policy, spec in topo.policies.items():
        wrote = write_policy_model(policy, spec, rewrite_outdated=rewrite_outdated) or wrote
    return wrote


def provide_policy_model(topo: Topology, policy: str, path: str) -> None:
    """A trainer whose model directory ``path`` does not exist writes it as the topology's
    entry of ``policy`` says (``model init`` or ``model import``): in a deployment that
    shares nothing but Kafka the trainer is the one component that holds the model on
    disk. Nothing for a policy the topology does not declare; MissingModel."""
    spec = topo.policies.get(policy)
    if spec is None or Path(path, "config.json").exists():
        return
    write_policy_model(policy, spec.model_copy(update={"model": path}))


def write_policy_model(policy: str, spec: PolicySpec, *,
                       rewrite_outdated: bool = False) -> bool:
    """Write (or import) the model of one policy as its topology entry says, unless it is
    there (and, with ``rewrite_outdated``, up to date: ``tiny_model_outdated``); True if it
    was written. The tiny model is written as ``model_init_command(spec)`` would write it
    (``init_options``); MissingModel when it may not be or its writing failed."""
    if spec.import_from:
        return import_model(policy, spec)
    stale = tiny_model_outdated(spec) if rewrite_outdated else ""
    if not stale and Path(spec.model, "config.json").exists():
        return False
    if not spec.init_tiny:
        raise MissingModel(f"policy {policy}: no model at {spec.model}")
    what = "default" if spec.role == "solver" else spec.role
    print(f"writing the tiny {what} model for {policy} to {spec.model} (warm start "
          f"{spec.warm_start.steps} steps, carry slip {spec.warm_start.slip})"
          f"{': ' + stale if stale else ''}", flush=True)
    try:
        write_tiny_model(spec.model, init_options(spec))
    except (AstraflowError, ValueError) as e:  # as the command reports it
        print(f"astraflow: {e}", file=sys.stderr)
        raise MissingModel(f"policy {policy}: writing its tiny model to {spec.model} "
                           "failed") from None
    return True


def import_model(policy: str, spec) -> bool:
    """Import the policy's pretrained model (``import_from``) when its directory has none;
    True if it was imported."""
    if Path(spec.model, "config.json").exists():
        if Path(spec.model, INIT_RECIPE).exists():  # a tiny model, not this import
            raise MissingModel(
                f"policy {policy}: {spec.model} holds a tiny model written by `astraflow "
                f"model init` ({INIT_RECIPE}), not one imported from {spec.import_from}; "
                f"delete that directory or give the policy another `model:`")
        return False
    gguf = spec.import_from.endswith(".gguf")
    print(f"importing {spec.import_from} for {policy} into {spec.model}", flush=True)
    try:
        import_source(None if gguf else spec.import_from, spec.model,
                      gguf=spec.import_from if gguf else None)
    except ModelError as e:  # as `model import` reports it
        print(f"astraflow: {e}", file=sys.stderr)
        raise MissingModel(f"policy {policy}: importing {spec.import_from} failed") from None
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


def init_options(spec: PolicySpec) -> SolverInit | RoleInit:
    """The options that write the tiny model of ``spec``, the typed form of
    ``model_init_command(spec)``: each warm-start setting the file gives over the
    command's own defaults (``--warm-start-steps`` and ``--carry-slip`` always).
    ``ValueError`` for a setting the command has no flag for."""
    ws = spec.warm_start
    given = {}
    for flag in WARM_START_FLAGS:
        value = getattr(ws, flag.field)
        if value is None or value is False:
            continue
        given[flag.dest] = value
    kind = SolverInit if spec.role == "solver" else RoleInit
    unknown = sorted(set(given) - set(kind.__dataclass_fields__))
    if unknown:
        raise ValueError(f"warm_start: {', '.join(unknown)} does not apply to `model "
                         f"{kind.command}`")
    if kind is RoleInit:
        return RoleInit(role=spec.role, **given)
    return SolverInit(**given)


def tiny_model_outdated(spec: PolicySpec) -> str:
    """Why the tiny model at ``spec.model`` must be rewritten ("" when it need not be).

    Only a model that ``astraflow model init`` or ``model init-role`` wrote (both leave
    their recipe file) and whose recipe differs from what the topology asks for
    (``init_options``) -- the command included, so a solver model becomes a verifier's
    and back -- is rewritten; any other model is left alone.
    """
    if not spec.init_tiny:
        return ""
    recipe_file = Path(spec.model, INIT_RECIPE)
    if not recipe_file.is_file():
        if Path(spec.model, OLD_ROLE_RECIPE).is_file():
            return f"written by an older `model init-role` ({OLD_ROLE_RECIPE}, no {INIT_RECIPE})"
        return ""
    try:
        have = json.loads(recipe_file.read_text())
    except (OSError, ValueError):
        return ""
    want = recipe(init_options(spec))
    # an option added after the model was written counts as its default
    defaults = recipe(SolverInit() if spec.role == "solver" else RoleInit(role=spec.role))
    diff = [f"{k} {have.get(k, defaults.get(k))} -> {v}" for k, v in want.items()
            if have.get(k, defaults.get(k)) != v]
    return "the topology changed how it is made (" + ", ".join(diff) + ")" if diff else ""
