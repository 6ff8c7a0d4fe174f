"""Workflows: how a task becomes trajectories.

* ``base``: the ``Workflow`` interface (and ``BatchWorkflow``), ``TaskError``.
* ``registry``: ``register_workflow``, ``make_workflow``, ``WORKFLOWS``.
* ``inputs``, ``sequences``, ``scoring``, ``latency``: what the workflows share.
* one module per workflow: ``single_turn``, ``tool_calc``, ``code_tests``,
  ``solve_verify``, ``solve_select`` (``two_policy``: the common part of the last two).

A new workflow is a module here with a class decorated ``@register_workflow("name")``,
named in ``registry.BUILTIN_MODULES`` and imported below; its ``Options`` is the model of
its options in ``astraflow.config.options`` (named in ``WORKFLOW_OPTIONS``), which its
``__init__`` receives, checked, with every default applied.
"""

# the shipped workflows register themselves on import: WORKFLOWS is complete once the
# package is imported
from astraflow.raas.workflows import (  # noqa: F401
    code_tests,
    single_turn,
    solve_select,
    solve_verify,
    tool_calc,
)
from astraflow.raas.workflows.base import BatchWorkflow, TaskError, Workflow
from astraflow.raas.workflows.latency import Latency
from astraflow.raas.workflows.registry import (
    WORKFLOWS,
    load_builtin_workflows,
    make_workflow,
    register_workflow,
)

__all__ = [
    "WORKFLOWS",
    "BatchWorkflow",
    "Latency",
    "TaskError",
    "Workflow",
    "load_builtin_workflows",
    "make_workflow",
    "register_workflow",
]
