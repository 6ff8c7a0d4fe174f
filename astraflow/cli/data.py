"""``astraflow data generate``: the generated task sets as JSONL files."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from astraflow.tasks.generate import GENERATORS, write_jsonl
from astraflow.tasks.split import SPLITS


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``data`` command group (``data generate``)."""
    from astraflow.cli.args import add_command, add_group

    examples = ["astraflow data generate addition data/addition.eval.jsonl --split eval",
                "astraflow data generate multistep data/multistep.train.jsonl --count 5000"]
    verbs = add_group(subparsers, "data", help="task datasets: generate the bench datasets",
                      dest="data_command", examples=examples[:1])
    g = add_command(
        verbs, "generate", help="write a generated dataset as JSONL",
        description="Write the rows of a generated task set ({prompt, answer, level, "
        "source} per line) to FILE.jsonl, ready for `feeder run --dataset` and `eval run "
        "--dataset`.",
        examples=examples)
    g.add_argument("kind", choices=sorted(GENERATORS), help="which task set")
    g.add_argument("out", metavar="FILE.jsonl", help="where to write it")
    g.add_argument("--split", default="train", choices=SPLITS)
    g.add_argument("--count", type=int, default=0, help="rows (0: all for addition, "
                   "2000 for multistep)")
    g.add_argument("--seed", type=int, default=0)
    g.set_defaults(func=cmd_generate)
    return subparsers.choices["data"]


def cmd_generate(args: argparse.Namespace) -> int:
    gen = GENERATORS[args.kind]
    rows = gen(args.split, args.count, args.seed) if args.count or args.kind == "addition" \
        else gen(args.split, seed=args.seed)
    if not rows:
        print(f"astraflow data generate: no {args.split} rows", file=sys.stderr)
        return 2
    path = write_jsonl(rows, args.out)
    print(f"wrote {len(rows)} {args.kind} rows ({args.split}) to {path}")
    return 0
