"""The workflow registry: a workflow class registers by name with
``@register_workflow("name")``; the RaaS node looks up ``task.workflow`` and builds it with
the options it was given for that name (``make_workflow(name, **options)``).

A workflow class declares its options as a model (``Options``, one of
``astraflow.config.options``): ``make_workflow`` checks the given options against it and
passes the typed object to the class (``cls(options, checker=...)``), so each option has
one default, the model's. A class without ``Options`` takes the options as keywords."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import ValidationError

from astraflow.config.sections import _format_errors
from astraflow.raas.workflows.base import Checker, TaskError, Workflow

# the shipped workflows' modules (astraflow.raas.workflows.<module>), loaded on first use
BUILTIN_MODULES = ("single_turn", "tool_calc", "code_tests", "solve_verify", "solve_select",
                   "agent", "verifiers_env", "openenv_env")

WORKFLOWS: dict[str, type] = {}


def register_workflow(name: str) -> Callable[[type], type]:
    """Class decorator: make a workflow class available under ``name``."""

    def wrap(cls: type) -> type:
        cls.name = name
        WORKFLOWS[name] = cls
        return cls

    return wrap


def load_builtin_workflows() -> dict[str, type]:
    """Every shipped workflow, registered: each module registers its class when imported,
    which happens here, on use (they import this module, so it cannot import them)."""
    import importlib

    for module in BUILTIN_MODULES:
        importlib.import_module(f"astraflow.raas.workflows.{module}")
    return WORKFLOWS


def make_workflow(name: str, checker: Checker | None = None, **options: Any) -> Workflow:
    """An instance of the workflow registered as ``name`` with ``options`` (a topology's
    keys; ``checker``: a reward callable, for the workflows that take one); raises
    ``TaskError`` if none is registered, ``ValueError`` naming the key of a bad option."""
    load_builtin_workflows()
    cls = WORKFLOWS.get(name)
    if cls is None:
        raise TaskError(f"unknown workflow {name!r} (known: {sorted(WORKFLOWS)})")
    extra = {"checker": checker} if checker is not None else {}
    model = getattr(cls, "Options", None)
    if model is None:
        return cls(**options, **extra)
    try:
        typed = model(**options)
    except ValidationError as e:
        raise ValueError(_format_errors(e)) from None
    return cls(typed, **extra)


__all__ = ["BUILTIN_MODULES", "WORKFLOWS", "load_builtin_workflows", "make_workflow",
           "register_workflow"]
