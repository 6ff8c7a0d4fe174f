"""Role formats of multi-policy workflows: verifier and selector.

The tiny character-level model (256 positions, ``astraflow.model.CHARSET``) needs compact
prompts, so every role has a one-line format built from the arithmetic prompt
(``"37+45="``) and the solver's answer(s):

================  ============================  ==========================================
role              prompt                        completion
================  ============================  ==========================================
solver            ``37+45=``                    ``82`` (the arithmetic format)
verifier          ``37+45=82?``                 ``82y`` / ``73n``: its own answer, then
                                                ``y`` (approve) or ``n`` (reject)
blind verifier    ``37+45=``, then ``73?``      ``82|`` (its own answer, first turn), then
                                                ``n`` after the candidate (second turn)
solver, retry     ``37+45=82?n 37+45=``         a new answer, e.g. ``83``
selector          ``37+45=82|83>``              ``82:1``: its own answer, then ``1`` or
                                                ``2`` (the answer it picks)
================  ============================  ==========================================

The retry prompt replays the rejected answer and the verifier's verdict, then asks the
problem again. The judges *recompute, then judge*: their own answer comes first and is
optional for the parsers. ``parse_verdict`` skips a leading number and reads ``y``/``n``;
``parse_pick`` reads ``1``/``2`` after the last ``:`` (or at the start); anything else is
unparseable. Why the recomputation: the tiny model does not learn a bare ``y``/``n`` verdict
from supervised examples (after 1,600 warm-start steps, half of them on answers, it
answered 72 % of held-out problems but its verdicts stayed at chance), while with its own
answer first it compares the two answers without a single inconsistency and its verdicts
are as good as its arithmetic -- which RL on the verdict reward then improves.

It did not: shown the candidate first, the RL-trained verifier came to copy it as its
"own" answer (right on 27 % of wrong candidates), so its verdict stopped checking
anything, and the verdict token drifted towards whichever verdict the training mix
favoured. The *blind* verifier (``blind=True`` in ``verifier_examples``, ``solve_verify``,
``role_scorer``; ``--blind`` in ``model init-role`` and ``eval run``) cannot copy: it
answers the problem before the candidate is appended (``37+45=`` -> ``82|``, then
``73?``, not trained on, -> ``n``; one sequence ``37+45=82|73?n``). Its reward still
scores only the verdict, but now both its own answer and its comparison are what earns it.

Warm start. ``astraflow model init`` teaches a fresh tiny model the solver's format only.
``astraflow model init-role DIR --role verifier|selector`` (``init_role_model``) writes a
tiny model warm-started on the role's format instead, from a *fallible teacher*, so that
RL has something to learn (the verifier's counterpart of the solver's slipping teacher):

* candidates are right half of the time; wrong ones are the mistakes a solver makes:
  the answer with a carry or borrow forgotten (``astraflow.tasks.arithmetic``), or a near
  miss (off by one or ten, two digits swapped);
* the teacher's own answer forgets the carry with probability ``slip`` (where the problem
  has one), and its verdict (pick) follows its own answer: it then approves (picks) a
  forgotten carry and rejects the right answer -- a blind spot on exactly the solver's
  typical error, as a pretrained judge would have;
* with probability ``noise`` the verdict (pick) is flipped.

``role_scorer`` builds the held-out evaluation of a role (``astraflow eval run --role``):
the verdict accuracy on held-out problems with balanced right/wrong candidates (always
"y" scores 0.5), or the pick accuracy on pairs of one right and one wrong answer.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError

ROLES = ("verifier", "selector")  # roles with their own format (the solver's is the default)
APPROVE, REJECT = "y", "n"
PICK_SEP = ":"
OWN_END = "|"  # ends the blind verifier's own answer (its first turn)
_NUMBER_PREFIX = re.compile(r"^\s*-?[\d.,]*\s*")


# --- formats ------------------------------------------------------------------------------
def verify_prompt(prompt: str, answer: str) -> str:
    """``"37+45="``, ``"82"`` -> ``"37+45=82?"``."""
    return f"{prompt}{answer}?"


def blind_verdict_context(prompt: str, own: str, candidate: str) -> str:
    """``"37+45="``, ``"82"``, ``"73"`` -> ``"37+45=82|73?"``: what a blind verifier has
    seen when it gives its verdict (its own answer, ``OWN_END``, then the candidate)."""
    return f"{prompt}{own}{OWN_END}{candidate}?"


def own_answer(text: str) -> str | None:
    """The blind verifier's own answer in its first turn's text (``"82|"`` -> ``"82"``),
    None when the turn did not end it with ``OWN_END``."""
    return text.split(OWN_END, 1)[0].strip() if OWN_END in text else None


def retry_prompt(prompt: str, answer: str, verdict: str = REJECT) -> str:
    """``"37+45="``, ``"82"`` -> ``"37+45=82?n 37+45="``: the rejected try, then the problem."""
    return f"{verify_prompt(prompt, answer)}{verdict} {prompt}"


def select_prompt(prompt: str, first: str, second: str) -> str:
    """``"37+45="``, ``"82"``, ``"83"`` -> ``"37+45=82|83>"``."""
    return f"{prompt}{first}|{second}>"


def _first_char(text: str) -> str:
    from astraflow.tasks.check import cut_at_stop

    stripped = cut_at_stop(text).strip()
    return stripped[:1].lower()


def parse_verdict(text: str) -> bool | None:
    """True for an approval (``y``, ``82y``), False for a rejection (``n``, ``73n``), None
    otherwise. A leading number (the verifier's own answer) is skipped."""
    c = _first_char(_NUMBER_PREFIX.sub("", _first_line(text)))
    return True if c == APPROVE else False if c == REJECT else None


def parse_pick(text: str) -> int | None:
    """1 or 2 (the answer the selector picked: ``1``, ``82:1``), None when unparseable."""
    c = _first_char(_first_line(text).rsplit(PICK_SEP, 1)[-1])
    return int(c) if c in ("1", "2") else None


def _first_line(text: str) -> str:
    from astraflow.tasks.check import cut_at_stop

    return cut_at_stop(text).strip().split("\n", 1)[0]


def candidate_answer(completion: str, max_chars: int = 12) -> str:
    """What the other roles are shown of a solver completion: its final number (at most
    ``max_chars`` characters), or "" when it has none."""
    from astraflow.tasks.check import extract_final_number

    got = extract_final_number(completion)
    return (got or "")[:max_chars]


# --- wrong answers and warm-start examples --------------------------------------------------
def _fields(problem: Any) -> tuple[str, str, int]:
    if isinstance(problem, dict):
        return str(problem["prompt"]), str(problem["answer"]), int(problem.get("level", 0))
    return str(problem.prompt), str(problem.answer), int(getattr(problem, "level", 0))


def _carry_slip(prompt: str, answer: str) -> str | None:
    """The answer with the carries/borrows forgotten, when that is a different answer."""
    try:
        from astraflow.tasks.arithmetic import ArithProblem, carry_slip_answer
    except ImportError:  # an older arithmetic module: near misses only
        return None
    slipped = carry_slip_answer(ArithProblem(prompt, answer, 0))
    return slipped if slipped != answer else None


def _near_miss(answer: str, rng: random.Random) -> str:
    try:
        v = int(answer)
    except ValueError:
        return answer + "1"
    options = [v + 1, v - 1, v + 10, v - 10]
    if len(answer) >= 2 and answer[-1] != answer[-2]:
        options.append(int(answer[:-2] + answer[-1] + answer[-2]))
    options = [o for o in options if o >= 0 and o != v]
    return str(rng.choice(options))


def wrong_answer(prompt: str, answer: str, rng: random.Random,
                 carry_share: float = 0.5) -> tuple[str, str]:
    """``(wrong answer, kind)``: kind ``"carry"`` (a forgotten carry/borrow, drawn with
    probability ``carry_share`` where one exists) or ``"near"`` (a near miss)."""
    slipped = _carry_slip(prompt, answer)
    if slipped is not None and rng.random() < carry_share:
        return slipped, "carry"
    return _near_miss(answer, rng), "near"


def _teacher_answer(prompt: str, answer: str, slip: float, rng: random.Random) -> str:
    """The teacher's own answer: the right one, or the carry forgotten with probability
    ``slip`` where the problem has a carry."""
    slipped = _carry_slip(prompt, answer)
    return slipped if slipped is not None and rng.random() < slip else answer


def _draws(kind: str, problems: Sequence[Any], n: int, seed: int):
    """``n`` times ``(rng, prompt, answer, level)`` of a problem drawn with repeats, from
    one rng seeded by ``kind`` and ``seed``."""
    if not problems:
        raise ValueError(f"{kind}_examples needs problems")
    rng = random.Random(f"{kind}:{seed}")
    for _ in range(n):
        yield (rng, *_fields(problems[rng.randrange(len(problems))]))


def verifier_examples(
    problems: Sequence[Any],
    n: int,
    *,
    seed: int = 0,
    p_right: float = 0.5,
    slip: float = 0.0,
    noise: float = 0.0,
    think: bool = True,
    blind: bool = False,
) -> list[dict[str, Any]]:
    """``n`` verdict examples ``{"prompt": "37+45=82?", "answer": "82y", "truth": bool}``.

    Problems are drawn with repeats; candidates are right with probability ``p_right``.
    The teacher's own answer slips with probability ``slip`` (module doc), its verdict is
    whether the candidate equals its own answer, flipped with probability ``noise``
    (``truth`` keeps the real verdict). ``think=False`` leaves the own answer out.

    ``blind=True``: examples of the two-turn format, ``{"prompt": "37+45=", "segments":
    [["82|", 1], ["73?", 0], ["n", 1]], "answer": "n", ...}``: the own answer is written
    before the candidate is shown; the candidate is context, not trained on.
    """
    out = []
    for rng, prompt, answer, level in _draws("verifier", problems, n, seed):
        if rng.random() < p_right:
            cand, kind = answer, "right"
        else:
            cand, kind = wrong_answer(prompt, answer, rng)
        own = _teacher_answer(prompt, answer, slip, rng)
        label = own == cand
        if rng.random() < noise:
            label = not label
        verdict = APPROVE if label else REJECT
        if blind:
            out.append({"prompt": prompt, "answer": verdict, "own": own, "candidate": cand,
                        "segments": [[own + OWN_END, 1], [cand + "?", 0], [verdict, 1]],
                        "truth": cand == answer, "kind": kind, "level": level})
            continue
        out.append({"prompt": verify_prompt(prompt, cand),
                    "answer": (own if think else "") + verdict,
                    "truth": cand == answer, "kind": kind, "level": level})
    return out


def retry_examples(
    problems: Sequence[Any], n: int, *, seed: int = 0, slip: float = 0.0
) -> list[dict[str, Any]]:
    """``n`` solver retry examples ``{"prompt": "37+45=73?n 37+45=", "answer": "82"}``.

    The rejected answer is a mistake a solver makes (``wrong_answer``: a forgotten carry or
    a near miss); the teacher answers the problem again and forgets the carry with
    probability ``slip`` (so it may repeat a forgotten carry). This teaches the solver
    the retry format of ``solve_verify`` the way a pretrained model can take feedback;
    problems are drawn with repeats.
    """
    out = []
    for rng, prompt, answer, level in _draws("retry", problems, n, seed):
        rejected, kind = wrong_answer(prompt, answer, rng)
        out.append({"prompt": retry_prompt(prompt, rejected),
                    "answer": _teacher_answer(prompt, answer, slip, rng),
                    "truth": answer, "kind": kind, "level": level})
    return out


def selector_examples(
    problems: Sequence[Any],
    n: int,
    *,
    seed: int = 0,
    slip: float = 0.0,
    noise: float = 0.0,
    think: bool = True,
) -> list[dict[str, Any]]:
    """``n`` pick examples ``{"prompt": "37+45=82|73>", "answer": "82:1", "truth": 1|2}``:
    one right and one wrong answer in random order. The teacher picks the answer equal to
    its own (which slips with probability ``slip``; a random one when neither is), then
    the other one with probability ``noise``. ``think=False`` leaves the own answer out."""
    out = []
    for rng, prompt, answer, level in _draws("selector", problems, n, seed):
        wrong, kind = wrong_answer(prompt, answer, rng)
        right_slot = 1 if rng.random() < 0.5 else 2
        pair = (answer, wrong) if right_slot == 1 else (wrong, answer)
        own = _teacher_answer(prompt, answer, slip, rng)
        label = pair.index(own) + 1 if own in pair else rng.choice((1, 2))
        if rng.random() < noise:
            label = 3 - label
        out.append({"prompt": select_prompt(prompt, *pair),
                    "answer": (f"{own}{PICK_SEP}" if think else "") + str(label),
                    "truth": right_slot, "kind": kind, "level": level})
    return out


def role_examples(role: str, problems: Sequence[Any], n: int, **kw: Any) -> list[dict[str, Any]]:
    if role == "verifier":
        return verifier_examples(problems, n, **kw)
    if role == "selector":
        return selector_examples(problems, n, **kw)
    raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")


def role_eval_examples(role: str, levels: Iterable[int] = (1, 2), n: int = 200,
                       seed: int = 1234) -> list[dict[str, Any]]:
    """Held-out role examples ``{"prompt", "label"}`` with the true verdict (``y``/``n``)
    or pick (``1``/``2``): one per held-out problem; verifier candidates alternate
    right/wrong (balanced), selector pairs hold one right answer (first or second in turn)."""
    from astraflow.tasks.arithmetic import eval_problems

    problems = eval_problems(list(levels), n=n, seed=seed)
    rng = random.Random(f"role-eval:{role}:{seed}")
    out = []
    for i, p in enumerate(problems):
        if role == "verifier":
            truth = i % 2 == 0
            cand = p.answer if truth else wrong_answer(p.prompt, p.answer, rng)[0]
            out.append({"prompt": verify_prompt(p.prompt, cand), "problem": p.prompt,
                        "candidate": cand, "label": APPROVE if truth else REJECT,
                        "level": p.level})
        elif role == "selector":
            wrong = wrong_answer(p.prompt, p.answer, rng)[0]
            slot = 1 + i % 2
            pair = (p.answer, wrong) if slot == 1 else (wrong, p.answer)
            out.append({"prompt": select_prompt(p.prompt, *pair), "label": str(slot),
                        "level": p.level})
        else:
            raise ValueError(f"unknown role {role!r} (known: {', '.join(ROLES)})")
    return out


def score_role(role: str, completion: str, label: str) -> float:
    """1.0 when the completion's verdict/pick equals ``label``, else 0.0."""
    if role == "verifier":
        got = parse_verdict(completion)
        return float(got is not None and got == (label == APPROVE))
    got_pick = parse_pick(completion)
    return float(got_pick is not None and str(got_pick) == label)


def blind_verdicts(model, tokenizer, examples: Sequence[dict[str, Any]],
                   max_new_tokens: int = 8, batch_size: int = 64) -> list[tuple[str | None, str]]:
    """Greedy two-turn verdicts of a blind verifier on ``examples`` (``"problem"``,
    ``"candidate"``): ``(own answer or None, verdict text)`` each; the verdict text is ""
    when the first turn did not end its own answer."""
    from astraflow.model import generate_answers

    end = tokenizer(OWN_END, add_special_tokens=False)["input_ids"]
    firsts = generate_answers(model, tokenizer, [e["problem"] for e in examples],
                              max_new_tokens=max_new_tokens, batch_size=batch_size,
                              stop_ids=end)
    owns = [own_answer(t) for t in firsts]
    asked = [i for i, own in enumerate(owns) if own is not None]
    verdicts = generate_answers(
        model, tokenizer,
        [blind_verdict_context(examples[i]["problem"], owns[i], examples[i]["candidate"])
         for i in asked], max_new_tokens=max_new_tokens, batch_size=batch_size)
    out: list[tuple[str | None, str]] = [(own, "") for own in owns]
    for i, text in zip(asked, verdicts):
        out[i] = (owns[i], text)
    return out


def evaluate_role(model, tokenizer, role: str, examples: Sequence[dict[str, Any]],
                  max_new_tokens: int = 8, batch_size: int = 64, blind: bool = False) -> float:
    """Greedy verdict (pick) accuracy of ``model`` on ``examples`` (``role_eval_examples``);
    ``blind``: a verifier of the two-turn format (``blind_verdicts``)."""
    from astraflow.model import generate_answers

    if not examples:
        raise ValueError("evaluate_role needs examples")
    if blind:
        if role != "verifier":
            raise ValueError(f"only a verifier can be blind, not a {role}")
        completions = [v for _, v in blind_verdicts(model, tokenizer, examples,
                                                    max_new_tokens, batch_size)]
    else:
        completions = generate_answers(model, tokenizer, [e["prompt"] for e in examples],
                                       max_new_tokens=max_new_tokens, batch_size=batch_size)
    return sum(score_role(role, c, e["label"]) for c, e in zip(completions, examples)) / len(
        examples)


def role_scorer(role: str, levels: Iterable[int] = (1, 2), n: int = 200,
                max_new_tokens: int = 8, blind: bool = False) -> Callable[[Any, Any], float]:
    """``score(model, tokenizer) -> accuracy`` on the role's held-out examples (the
    evaluator's ``--role``; ``blind``: its ``--blind``)."""
    examples = role_eval_examples(role, levels, n)

    def score(model, tokenizer) -> float:
        return evaluate_role(model, tokenizer, role, examples, max_new_tokens, blind=blind)

    return score


# --- warm start ----------------------------------------------------------------------------
# Before `model init-role` wrote its recipe to `model init`'s file (INIT_RECIPE), it wrote
# it here; `astraflow up` rewrites a role model that has only this one.
OLD_ROLE_RECIPE = "astraflow_role.json"


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
    role's format (see the module doc); returns metrics and the held-out role accuracy.

    Removes the recipe an earlier model left in ``dir`` (it no longer describes what is
    there); ``blind``: the verifier's two-turn format (``verifier_examples``). ``astraflow
    model init-role`` then writes its own, ``init_recipe(args)`` in
    ``INIT_RECIPE`` as ``model init`` does, which ``astraflow up`` compares with the
    topology to decide whether the model must be rewritten.
    """
    from astraflow.model import (
        INIT_RECIPE,
        init_model,
        load_policy,
        save_tokenizer,
        warm_start,
    )
    from astraflow.tasks.arithmetic import train_problems

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
        problems = train_problems(levels, n=train_size, seed=seed, unique=False)
        examples = role_examples(role, problems, max(train_size, 1), seed=seed, slip=slip,
                                 noise=noise, **({"blind": True} if blind else {}))
        metrics = warm_start(model, tok, examples, steps=steps, lr=lr, batch_size=batch_size,
                             seed=seed, log=log)
        model.save_pretrained(path)
        if (path / "tokenizer.json").is_file():
            save_tokenizer(tok, path)
        result["metrics"] = metrics
    if eval_size > 0:
        result["eval_accuracy"] = role_scorer(role, levels, eval_size, blind=blind)(model, tok)
        result["eval_prompts"] = eval_size
    for old in (INIT_RECIPE, OLD_ROLE_RECIPE):
        (path / old).unlink(missing_ok=True)
    result["seconds"] = time.time() - t0
    return result


# --- CLI ----------------------------------------------------------------------------------
def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add ``model init-role`` to the ``model`` command group (``astraflow.model``)."""
    model = subparsers.choices.get("model")
    if model is None:
        model = subparsers.add_parser("model", help="policy models")
        msub = model.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    else:
        msub = next(a for a in model._actions if isinstance(a, argparse._SubParsersAction))
    p = msub.add_parser(
        "init-role",
        help="write a tiny model warm-started on a verifier/selector format",
        description=(
            "Write a tiny causal LM to DIR warm-started for --warm-start-steps supervised "
            "steps on the format of a verifier ('37+45=82?' -> '82y': own answer, then "
            "y/n) or of a selector ('37+45=82|73>' -> '82:1': own answer, then the pick), "
            "from a teacher whose own answer forgets the carry with probability "
            "--carry-slip and whose verdict is flipped with probability --label-noise; "
            "then print the held-out verdict (pick) accuracy."
        ),
    )
    p.add_argument("dir", metavar="DIR")
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
    from astraflow.staging import check_replaceable, staged_dir

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
    from astraflow.model import INIT_RECIPE, init_recipe

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


__all__ = [
    "APPROVE",
    "OLD_ROLE_RECIPE",
    "OWN_END",
    "REJECT",
    "ROLES",
    "blind_verdict_context",
    "blind_verdicts",
    "candidate_answer",
    "evaluate_role",
    "init_role_model",
    "own_answer",
    "parse_pick",
    "parse_verdict",
    "register",
    "retry_prompt",
    "retry_examples",
    "role_eval_examples",
    "role_examples",
    "role_scorer",
    "score_role",
    "select_prompt",
    "selector_examples",
    "verifier_examples",
    "verify_prompt",
]
