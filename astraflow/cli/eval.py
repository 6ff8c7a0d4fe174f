"""``astraflow eval run``: the held-out evaluator of one policy.

Its settings are the topology's ``eval:`` with the policy's own ``eval:`` over it (and the
policy's role, model, chat format and dtype); each flag overrides one of them
(``astraflow.config.overrides.EVAL_FLAGS``). ``astraflow.eval.evaluator`` runs it.
"""

from __future__ import annotations

import argparse
from typing import Any

from astraflow.cli.args import add_command, add_group, add_run_options
from astraflow.cli.context import component_topology
from astraflow.cli.flags import add_flags, given
from astraflow.config.overrides import EVAL_FLAGS

_EXAMPLES = [
    "astraflow eval run -t topology/default.yaml --policy actor",
    "astraflow eval run -t topology/default.yaml --once",
    "astraflow eval run -t topology/solver-verifier.yaml --policy verifier "
    "--model runs/solver-verifier/verifier --size 50",
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``eval`` command group (``eval run``) to ``subparsers``."""
    verbs = add_group(subparsers, "eval", help="held-out evaluation of published weight versions",
                      dest="eval_command", examples=_EXAMPLES[:1])
    r = add_command(
        verbs, "run", help="evaluate every N-th version as it is published",
        description="Follow weights.<policy>, rebuild every N-th version bit-exactly, score "
        "greedy answers on the held-out prompts and publish the accuracy on <run>.status "
        "(metric eval/accuracy). What it scores and how often is the topology's eval: with "
        "the policy's own eval: over it; a flag of the same name overrides.",
        examples=_EXAMPLES)
    add_run_options(r)
    r.add_argument("--policy", default="actor", help="policy name (default actor)")
    r.add_argument("--once", action="store_true", help="evaluate the latest version and exit")
    r.add_argument("--history", metavar="OUT.json",
                   help="evaluate every N-th version already published, write the "
                   "accuracy-versus-version curve to OUT.json (and OUT.png) and exit; nothing "
                   "is published (`astraflow replay eval`)")
    r.add_argument("--public-key", metavar="FILE", help="verify the weights with this public "
                   "key (PEM): a manifest it did not sign is refused (default: "
                   "$ASTRAFLOW_WEIGHTS_PUBLIC_KEY, else the topology's weight_signing)")
    add_flags(r, EVAL_FLAGS)
    r.set_defaults(func=cmd_eval_run)
    return subparsers.choices["eval"]


def settings(args: argparse.Namespace, topo: Any = None) -> Any:
    """The ``EvalSettings`` of ``eval run``: the topology's (``topo``, else the file of
    ``--topology``) with the flags given applied (``ValueError`` names a refused flag)."""
    from astraflow.config.components import eval_settings

    topo = component_topology(args, topo)
    return eval_settings(topo, args.policy, given(args, EVAL_FLAGS))


def cmd_eval_run(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.eval.evaluator import run_evaluator

    topo = args.loaded_topology
    try:
        s = settings(args, topo)
    except ValueError as e:
        raise SystemExit(f"astraflow eval run: {e}") from None
    config = kafka_config(args, topo.component_kafka(f"eval.{s.policy}"))
    return run_evaluator(s, topo, config, once=args.once, history=args.history,
                         public_key=getattr(args, "public_key", None))
