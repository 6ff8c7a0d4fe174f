"""Writing a policy's tiny model: ``model init`` (the solver's answer format, optionally
warm-started, ``SolverInit``) and ``model init-role`` (a verifier's or a selector's,
``RoleInit``), the commands' work and what ``astraflow up`` calls directly.

A model is written under a temporary name next to its directory and renamed into place
once complete, its recipe (``astraflow.models.recipe``) included, so an interrupted write
never leaves a model a later run could take for a finished one. Progress goes to ``log``
(default: stdout, flushed), as the commands print it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from astraflow.models.errors import ModelError
from astraflow.models.evaluation import evaluate
from astraflow.models.loading import load_policy
from astraflow.models.recipe import INIT_RECIPE, RoleInit, SolverInit, recipe
from astraflow.models.tiny import init_model, save_trained
from astraflow.models.warm_start import warm_start

Log = Callable[[str], None]


def _print(line: str) -> None:
    print(line, flush=True)


def parse_levels(text: str) -> list[int]:
    """``"1,2"`` -> ``[1, 2]``."""
    return [int(x) for x in text.split(",") if x.strip()]


def write_tiny_model(dir: str | Path, opts: SolverInit | RoleInit,
                     log: Log = _print) -> dict[str, Any]:
    """Write the tiny model ``opts`` describes to ``dir`` (``write_solver_model`` or
    ``write_role_model``); its result."""
    if isinstance(opts, RoleInit):
        return write_role_model(dir, opts, log)
    return write_solver_model(dir, opts, log)


def write_solver_model(dir: str | Path, opts: SolverInit,
                       log: Log = _print) -> dict[str, Any]:
    """``model init``: a freshly initialised tiny model at ``dir``, warm-started for
    ``opts.warm_start_steps`` supervised steps when that is above 0; its size and, after a
    warm start, its metrics and held-out accuracy. ``AstraflowError`` (``ModelError``)
    for a directory that holds something else or a bad option."""
    from astraflow.models.staging import check_replaceable, staged_dir

    t0 = time.time()
    final = Path(dir)
    check_replaceable(final)
    with staged_dir(final) as path:
        init_model(path, seed=opts.seed, size=opts.size)
        model, tok = load_policy(path)
        nparams = sum(p.numel() for p in model.parameters())
        log(f"wrote {opts.size} model ({nparams / 1e6:.2f}M parameters) to {final} "
            f"in {time.time() - t0:.1f}s")
        result: dict[str, Any] = {"dir": str(final), "size": opts.size, "params": nparams}
        if opts.warm_start_steps > 0:
            result.update(warm_start_solver(model, tok, opts, log))
            save_trained(model, tok, path)
        _write_recipe(path, opts)
    return result


def warm_start_solver(model: Any, tok: Any, opts: SolverInit,
                      log: Log = _print) -> dict[str, Any]:
    """``model init``'s supervised warm start of ``model`` in place (the arithmetic train
    split, the teacher's carry slips and retry examples as ``opts`` says); its metrics."""
    from astraflow.roles.teacher import retry_examples
    from astraflow.tasks.arithmetic import (
        carry_slip_answer,
        eval_problems,
        train_problems,
        with_carry_slips,
    )

    levels = parse_levels(opts.levels)
    # Drawn with repeats so every level gets its share of the steps, however few
    # distinct train prompts it has (level 1 has about 90).
    train = train_problems(levels, n=opts.train_size, seed=opts.seed, unique=False)
    if opts.carry_slip:
        train = with_carry_slips(train, opts.carry_slip, seed=opts.seed)
    retries: list[dict[str, Any]] = []
    if opts.retry_share > 0:
        if not opts.retry_share < 1:
            raise ModelError("--retry-share must be below 1")
        n_retry = round(len(train) * opts.retry_share / (1 - opts.retry_share))
        retries = retry_examples(train, n_retry, seed=opts.seed, slip=opts.retry_slip)
    evals = eval_problems(levels, n=opts.eval_size)
    until = None
    if opts.warm_start_until is not None:
        target = opts.warm_start_until
        # train-split prompts the teacher always answers right (no carry to slip on)
        check = [p for p in train_problems(levels, n=400, seed=opts.seed + 1)
                 if carry_slip_answer(p) == p.answer or not opts.carry_slip][:200]

        def until() -> bool:
            acc = evaluate(model, tok, check)
            log(f"warm start check: {acc:.1%} on {len(check)} carry-free train "
                f"prompts (target {target:.0%})")
            return acc >= target

    metrics = warm_start(model, tok, [*train, *retries], steps=opts.warm_start_steps,
                         lr=opts.lr, batch_size=opts.batch_size, seed=opts.seed,
                         log=log, until=until)
    if until is not None and not metrics["criterion_met"]:
        log(f"warm start: the check never passed in {opts.warm_start_steps} steps; "
            "RL starts from a model that has not learned the format well")
    per: dict[int, float] = {}
    acc = evaluate(model, tok, evals, per_level=per)
    levels_txt = " ".join(f"L{lv}={a:.1%}" for lv, a in per.items())
    log(f"warm start: {metrics['steps']:.0f} steps in {metrics['seconds']:.1f}s, loss "
        f"{metrics['loss_first']:.3f} -> {metrics['loss_last']:.3f}; held-out eval "
        f"accuracy {acc:.1%} on {len(evals)} prompts ({levels_txt})")
    result: dict[str, Any] = {"metrics": metrics, "eval_accuracy": acc,
                              "eval_per_level": per, "eval_prompts": len(evals)}
    if retries:
        retry_acc = evaluate(model, tok, retry_examples(evals, len(evals), seed=opts.seed))
        log(f"retry format: held-out accuracy {retry_acc:.1%} after a rejected answer")
        result["eval_retry_accuracy"] = retry_acc
    return result


def write_role_model(dir: str | Path, opts: RoleInit, log: Log = _print) -> dict[str, Any]:
    """``model init-role``: a tiny model at ``dir`` warm-started on ``opts.role``'s format
    (``astraflow.roles.warm_start.init_role_model``); its result. ``ValueError`` for an
    option out of range, ``AstraflowError`` for a directory that holds something else."""
    from astraflow.models.staging import check_replaceable, staged_dir
    from astraflow.roles.warm_start import init_role_model

    for name in ("carry_slip", "label_noise"):
        if not 0.0 <= getattr(opts, name) <= 1.0:
            raise ValueError(f"--{name.replace('_', '-')} must be in [0, 1]")
    check_replaceable(Path(dir))
    with staged_dir(dir) as path:
        result = init_role_model(
            path, opts.role, steps=opts.warm_start_steps, slip=opts.carry_slip,
            noise=opts.label_noise, levels=parse_levels(opts.levels),
            train_size=opts.train_size, lr=opts.lr, batch_size=opts.batch_size,
            seed=opts.seed, size=opts.size, eval_size=opts.eval_size, blind=opts.blind,
            log=log)
        m = result.get("metrics")
        text = f"wrote {opts.role} model ({result['params'] / 1e6:.2f}M parameters) to {dir}"
        if m:
            text += (f"; warm start {opts.warm_start_steps} steps in {m['seconds']:.1f}s, "
                     f"loss {m['loss_first']:.3f} -> {m['loss_last']:.3f}")
        if "eval_accuracy" in result:
            text += (f"; held-out {opts.role} accuracy {result['eval_accuracy']:.1%} on "
                     f"{result['eval_prompts']} prompts")
        log(text)
        # what made the model, as `model init` records it: `astraflow up` compares the
        # recipe of the model it would write with this one
        _write_recipe(path, opts)
    return result


def _write_recipe(path: Path, opts: SolverInit | RoleInit) -> None:
    (path / INIT_RECIPE).write_text(json.dumps(recipe(opts), indent=2, sort_keys=True) + "\n")


__all__ = ["parse_levels", "warm_start_solver", "write_role_model", "write_solver_model",
           "write_tiny_model"]
