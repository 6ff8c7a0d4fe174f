"""The workflow registry: a workflow class registers by name with
``@register_workflow("name")``; the RaaS node looks up ``task.workflow`` and builds it with
the options it was given for that name (``make_workflow(name, **options)``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.raas.workflows.base import TaskError, Workflow

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


def make_workflow(name: str, **options: Any) -> Workflow:
    """An instance of the workflow registered as ``name``; raises ``TaskError`` if none."""
    load_builtin_workflows()
    cls = WORKFLOWS.get(name)
    if cls is None:
        raise TaskError(f"unknown workflow {name!r} (known: {sorted(WORKFLOWS)})")
    return cls(**options)


__all__ = ["BUILTIN_MODULES", "WORKFLOWS", "load_builtin_workflows", "make_workflow",
           "register_workflow"]
