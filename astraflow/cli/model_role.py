"""``model init-role``: added to the ``model`` command group of ``astraflow.cli.model``."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from astraflow.cli.args import add_command, add_group, verbs_of
from astraflow.errors import AstraflowError
from astraflow.models.recipe import RoleInit
from astraflow.roles.formats import ROLES

_D = RoleInit(role=ROLES[0])  # each option's default, declared once

_EXAMPLES = [
    "astraflow model init-role runs/sv/verifier --role verifier --blind --label-noise 0.15",
    "astraflow model init-role runs/sv/selector --role selector --warm-start-steps 2000",
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``model init-role`` to the ``model`` command group (``astraflow.cli.model``)."""
    msub = verbs_of(subparsers, "model") or add_group(
        subparsers, "model", help="policy models", dest="model_command", examples=_EXAMPLES)
    p = add_command(
        msub, "init-role",
        help="write a tiny model warm-started on a verifier/selector format",
        examples=_EXAMPLES,
        description=(
            "Write a tiny causal LM to DIR warm-started for --warm-start-steps supervised "
            "steps on the format of a verifier ('37+45=82?' -> '82y': own answer, then "
            "y/n) or of a selector ('37+45=82|73>' -> '82:1': own answer, then the pick), "
            "from a teacher whose own answer forgets the carry with probability "
            "--carry-slip and whose verdict is flipped with probability --label-noise; "
            "then print the held-out verdict (pick) accuracy."
        ),
    )
    p.add_argument("dir", metavar="DIR", help="the model directory to write")
    p.add_argument("--role", required=True, choices=ROLES)
    p.add_argument("--warm-start-steps", type=int, default=_D.warm_start_steps, metavar="N")
    p.add_argument("--carry-slip", type=float, default=_D.carry_slip, metavar="P",
                   help="the teacher's own answer forgets the carry/borrow with probability P")
    p.add_argument("--label-noise", type=float, default=_D.label_noise, metavar="P",
                   help="the teacher's verdict (pick) is flipped with probability P")
    p.add_argument("--blind", action="store_true",
                   help="verifier: the two-turn format, its own answer before it is shown "
                   "the candidate ('37+45=' -> '82|', then '73?' -> 'n')")
    p.add_argument("--levels", default=_D.levels)
    p.add_argument("--size", default=_D.size)
    p.add_argument("--seed", type=int, default=_D.seed)
    p.add_argument("--lr", type=float, default=_D.lr)
    p.add_argument("--batch-size", type=int, default=_D.batch_size)
    p.add_argument("--train-size", type=int, default=_D.train_size, metavar="N")
    p.add_argument("--eval-size", type=int, default=_D.eval_size, metavar="N")
    p.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    p.set_defaults(func=cmd_model_init_role)
    return p


def cmd_model_init_role(args: argparse.Namespace) -> int:
    """``astraflow model init-role`` (``astraflow.roles.tiny_models.write_role_model``)."""
    from astraflow.roles.tiny_models import write_role_model

    opts = RoleInit(**{f.name: getattr(args, f.name) for f in dataclasses.fields(RoleInit)})
    try:
        result = write_role_model(args.dir, opts)
    except (AstraflowError, ValueError) as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result, "dir": args.dir}, sort_keys=True, default=str))
    return 0


__all__ = ["cmd_model_init_role", "register"]
