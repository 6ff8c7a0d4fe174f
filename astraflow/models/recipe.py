"""What made a model: the ``model init`` (``model init-role``) options written next to
its weights, which ``astraflow up`` compares with the command it would run.

``SolverInit`` and ``RoleInit`` declare those options once, with their defaults (the
commands' flags take theirs from here); ``recipe`` is what a model written with them
records, key for key what the command line of the same options records.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from types import SimpleNamespace
from typing import Any

# written by `astraflow model init` (and `model init-role`) next to the weights
INIT_RECIPE = "astraflow_init.json"
# Before `model init-role` wrote its recipe to INIT_RECIPE, it wrote it here; `astraflow up`
# rewrites a role model that has only this one.
OLD_ROLE_RECIPE = "astraflow_role.json"


def init_recipe(args: Any) -> dict[str, Any]:
    """What made a model: the parsed ``model init`` (or ``model init-role``) options that
    shape it (``args``: the parsed namespace), the command included (not its path).

    Both commands write it to ``INIT_RECIPE`` in the model directory; ``astraflow up``
    parses the command it would run the same way and rewrites the model when they differ.
    """
    skip = {"dir", "func", "json", "verbose", "loaded_topology", "eval_size"}
    return {
        k: v
        for k, v in sorted(vars(args).items())
        if k not in skip and isinstance(v, (str, int, float, bool, type(None)))
    }


@dataclass(frozen=True)
class SolverInit:
    """How ``model init`` writes a tiny model: the solver's answer format, optionally
    warm-started on the arithmetic train split."""

    size: str = "tiny"
    seed: int = 0
    warm_start_steps: int = 0  # supervised steps on the arithmetic train split
    # keep the learning rate up until greedy accuracy on carry-free train prompts reaches
    # this (checked every 100 steps), then decay and stop; warm_start_steps: the most steps
    warm_start_until: float | None = None
    lr: float = 2e-3
    batch_size: int = 64
    levels: str = "1,2"  # arithmetic levels, comma-separated
    train_size: int = 20000  # train prompts drawn (with repeats) for the warm start
    eval_size: int = 200  # held-out prompts scored after it
    carry_slip: float = 0.0  # the teacher forgets the carry/borrow with this probability
    retry_share: float = 0.0  # share of examples in solve_verify's retry format
    retry_slip: float = 0.0  # the teacher's carry slip on a retry example

    command = "init"


@dataclass(frozen=True)
class RoleInit:
    """How ``model init-role`` writes a tiny model warm-started on a verifier's or a
    selector's format (``astraflow.roles.warm_start``)."""

    role: str
    warm_start_steps: int = 1600
    carry_slip: float = 0.5  # the teacher's own answer forgets the carry/borrow
    label_noise: float = 0.02  # the teacher's verdict (pick) is flipped
    blind: bool = False  # verifier: its own answer before it is shown the candidate
    levels: str = "1,2"
    size: str = "tiny"
    seed: int = 0
    lr: float = 2e-3
    batch_size: int = 64
    train_size: int = 20000
    eval_size: int = 200

    command = "init-role"


def recipe(opts: SolverInit | RoleInit) -> dict[str, Any]:
    """The recipe a model written with ``opts`` records: ``init_recipe`` of the parsed
    command line of the same options (``model init`` or ``model init-role``; its
    global ``--debug`` off), so that models written by the command and by a direct call
    compare equal."""
    return init_recipe(SimpleNamespace(command="model", model_command=opts.command,
                                       debug=False, **asdict(opts)))


__all__ = ["INIT_RECIPE", "OLD_ROLE_RECIPE", "RoleInit", "SolverInit", "init_recipe",
           "recipe"]
