"""``model init-role``: added to the ``model`` command group of ``astraflow.cli.model``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from astraflow.cli.args import add_command, add_group, verbs_of
from astraflow.errors import AstraflowError
from astraflow.models.recipe import INIT_RECIPE, init_recipe
from astraflow.roles.formats import ROLES
from astraflow.roles.warm_start import init_role_model

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
    p.add_argument("--warm-start-steps", type=int, default=1600, metavar="N")
    p.add_argument("--carry-slip", type=float, default=0.5, metavar="P",
                   help="the teacher's own answer forgets the carry/borrow with probability P")
    p.add_argument("--label-noise", type=float, default=0.02, metavar="P",
                   help="the teacher's verdict (pick) is flipped with probability P")
    p.add_argument("--blind", action="store_true",
                   help="verifier: the two-turn format, its own answer before it is shown "
                   "the candidate ('37+45=' -> '82|', then '73?' -> 'n')")
    p.add_argument("--levels", default="1,2")
    p.add_argument("--size", default="tiny")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--train-size", type=int, default=20000, metavar="N")
    p.add_argument("--eval-size", type=int, default=200, metavar="N")
    p.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    p.set_defaults(func=cmd_model_init_role)
    return p


def cmd_model_init_role(args: argparse.Namespace) -> int:
    from astraflow.models.staging import check_replaceable, staged_dir

    for name in ("carry_slip", "label_noise"):
        if not 0.0 <= getattr(args, name) <= 1.0:
            print(f"astraflow: --{name.replace('_', '-')} must be in [0, 1]", file=sys.stderr)
            return 2
    try:
        check_replaceable(Path(args.dir))
        with staged_dir(args.dir) as tmp:
            result = _init_role_in(tmp, args)
    except (AstraflowError, ValueError) as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps({**result, "dir": args.dir}, sort_keys=True, default=str))
    return 0


def _init_role_in(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``model init-role`` writing into ``path`` (the staged directory), recipe included."""
    result = init_role_model(
        path, args.role, steps=args.warm_start_steps, slip=args.carry_slip,
        noise=args.label_noise, levels=[int(x) for x in args.levels.split(",") if x.strip()],
        train_size=args.train_size, lr=args.lr, batch_size=args.batch_size, seed=args.seed,
        size=args.size, eval_size=args.eval_size, blind=args.blind,
        log=lambda m: print(m, flush=True))
    m = result.get("metrics")
    text = f"wrote {args.role} model ({result['params'] / 1e6:.2f}M parameters) to {args.dir}"
    if m:
        text += (f"; warm start {args.warm_start_steps} steps in {m['seconds']:.1f}s, loss "
                 f"{m['loss_first']:.3f} -> {m['loss_last']:.3f}")
    if "eval_accuracy" in result:
        text += (f"; held-out {args.role} accuracy {result['eval_accuracy']:.1%} on "
                 f"{result['eval_prompts']} prompts")
    print(text, flush=True)
    # what made the model, as `model init` records it: `astraflow up` compares the recipe of
    # the command it would run with this one
    recipe = init_recipe(args)
    (path / INIT_RECIPE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    return result


__all__ = ["cmd_model_init_role", "register"]
