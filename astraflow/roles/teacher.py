"""The fallible teacher of the role warm starts: wrong answers a solver makes, and
supervised verifier, selector and solver-retry examples.

Candidates are right half of the time; wrong ones are a forgotten carry or borrow
(``astraflow.tasks.arithmetic``) or a near miss (off by one or ten, two digits swapped).
The teacher's own answer forgets the carry with probability ``slip`` where the problem has
one, and its verdict (pick) follows its own answer, so it approves a forgotten carry and
rejects the right answer -- a blind spot on exactly the solver's typical error. With
probability ``noise`` the verdict (pick) is flipped.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from astraflow.roles.formats import (
    APPROVE,
    OWN_END,
    PICK_SEP,
    REJECT,
    ROLES,
    retry_prompt,
    select_prompt,
    verify_prompt,
)


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


__all__ = ["retry_examples", "role_examples", "selector_examples", "verifier_examples",
           "wrong_answer"]
