"""What made a model: the ``model init`` (``model init-role``) options written next to
its weights, which ``astraflow up`` compares with the command it would run."""

from __future__ import annotations

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


__all__ = ["INIT_RECIPE", "OLD_ROLE_RECIPE", "init_recipe"]
