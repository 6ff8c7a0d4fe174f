"""The workflow interface: how a task becomes trajectories.

A workflow is one class with ``run(task, engines, n) -> list[Sequence]``; it may call any
of the engines (one per policy) as often as it likes. Every returned ``Sequence`` holds
``token_ids`` = prompt + everything after it, with ``loss_mask`` 1 only on tokens the
policy generated; tokens the policy did not generate (prompt, tool output) have
``loss_mask`` 0, ``logprobs`` 0.0 and ``versions`` -1.

A payload that cannot be used raises ``TaskError``: the node dead-letters the task.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

from astraflow.raas.engine import Engine
from astraflow.wire.records import Sequence, Task

# ``checker(completion, answer) -> reward``
Checker = Callable[[str, str], float]


class TaskError(ValueError):
    """A task this workflow cannot run (bad payload, unknown policy ...): dead-lettered."""


@runtime_checkable
class Workflow(Protocol):
    name: str

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]: ...


class BatchWorkflow(Workflow, Protocol):
    """A workflow that can also roll out several tasks at once: ``run_batch`` gives, per
    task and in order, its sequences or the exception that task raised (a bad payload fails
    its own task only). Each generation phase of the tasks is one ``generate`` call, so a
    node that takes several tasks per transaction (``--tasks-per-transaction``) runs the
    model on bigger batches: fewer, fuller forward passes."""

    def run_batch(
        self, tasks: list[Task], engines: dict[str, Engine], n: int
    ) -> list[list[Sequence] | Exception]: ...


__all__ = ["BatchWorkflow", "Checker", "TaskError", "Workflow"]
