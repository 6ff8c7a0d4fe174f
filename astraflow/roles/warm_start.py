"""A tiny model warm-started on a role's format from the fallible teacher
(``astraflow.roles.teacher``): ``model init-role``'s work."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from astraflow.models.loading import load_policy
from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE
from astraflow.models.tiny import init_model, save_trained
from astraflow.models.warm_start import warm_start
from astraflow.roles.formats import ROLES
from astraflow.roles.scoring import role_scorer
from astraflow.roles.teacher import role_examples


def init_role_model(
    dir: str | Path,
    role: str,
    *,
    steps: int = 1600,
    slip: float = 0.5,
    noise: float = 0.02,
    levels: Iterable[int] = (1, 2),
    train_size: int = 20000,
    lr: float = 2e-3,
    batch_size: int = 64,
    seed: int = 0,
    size: str = "tiny",
    eval_size: int = 200,
    blind: bool = False,
    log: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """Write a tiny model to ``dir`` warm-started for ``steps`` supervised steps on the
    role's format (``astraflow.roles.teacher``); returns metrics and the held-out role
    accuracy.

    Removes the recipe an earlier model left in ``dir`` (it no longer describes what is
    there); ``blind``: the verifier's two-turn format (``verifier_examples``). ``astraflow
    model init-role`` then writes its own, ``init_recipe(args)`` in
    ``INIT_RECIPE`` as ``model init`` does, which ``astraflow up`` compares with the
    topology to decide whether the model must be rewritten.
    """
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    if blind and role != "verifier":
        raise ValueError(f"only a verifier can be blind, not a {role}")
    levels = list(levels)
    t0 = time.time()
    path = init_model(dir, seed=seed, size=size)
    model, tok = load_policy(path)
    result: dict[str, Any] = {"dir": str(path), "role": role, "size": size,
                              "params": sum(p.numel() for p in model.parameters())}
    if steps > 0:
        examples = _teacher_examples(role, levels, train_size, seed=seed, slip=slip,
                                     noise=noise, blind=blind)
        result["metrics"] = warm_start(model, tok, examples, steps=steps, lr=lr,
                                       batch_size=batch_size, seed=seed, log=log)
        save_trained(model, tok, path)
    if eval_size > 0:
        result["eval_accuracy"] = role_scorer(role, levels, eval_size, blind=blind)(model, tok)
        result["eval_prompts"] = eval_size
    for old in (INIT_RECIPE, OLD_ROLE_RECIPE):
        (path / old).unlink(missing_ok=True)
    result["seconds"] = time.time() - t0
    return result


def _teacher_examples(role: str, levels: list[int], train_size: int, *, seed: int,
                      slip: float, noise: float, blind: bool) -> list[dict[str, Any]]:
    """The role's warm-start examples on ``train_size`` train problems drawn with repeats."""
    from astraflow.tasks.arithmetic import train_problems

    problems = train_problems(levels, n=train_size, seed=seed, unique=False)
    return role_examples(role, problems, max(train_size, 1), seed=seed, slip=slip,
                         noise=noise, **({"blind": True} if blind else {}))

__all__ = ["init_role_model"]
