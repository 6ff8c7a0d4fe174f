"""Seeded synthetic arithmetic with difficulty levels and a hash-based train/eval split.

Prompts are compact (``"37+45="``) and answers are short integers (at most 4 characters),
so a tiny model generates a whole answer in a handful of tokens.

Levels (the number of distinct prompts in brackets):

1. ``a+b``, one-digit operands [100]
2. ``a+b`` or ``a-b``, two-digit operands and a two-digit answer, so every prompt has the
   same layout (``37+45=82``, ``82-37=45``) [~6 500]
3. ``a+b+c`` with one-digit operands, or the two-digit ``a+b``/``a-b`` that level 2 leaves
   out (three-digit sums, one-digit differences) [~6 700]
4. three-digit ``a+b``/``a-b``, one-digit ``a*b``, two-digit times one-digit ``a*b``

Subtraction never goes negative. Levels 1 and 2 are the default mix.

``carry_slip_answer`` is the answer of a pupil who forgets every carry and borrow
(``7+5=2``, ``38+45=73``, ``53-17=46``). The embedded default warm-starts the tiny model on
a *slipping teacher* (``with_carry_slips``): on problems that need a carry or borrow the
teacher gives the slipped answer with probability ``slip`` and the right one otherwise.
The warm-started model thus knows the format and every digit that needs no carry, and
holds the right answer in its distribution without preferring it; exact rewards are what
tells it which of its answers are right. This stands in for the pretrained LLM of a real
run, which likewise "almost" solves its tasks before RL.

The split is a function of the prompt text only (SHA-256 of the prompt), so the held-out
eval prompts never appear in train, whatever the seed, level mix or number of samples.
"""

from __future__ import annotations

import random
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from astraflow.tasks.base import prompt_id
from astraflow.tasks.split import check_split, draw_split, hash_split, parse_levels

LEVELS = (1, 2, 3, 4)
_BINARY = re.compile(r"(\d+)([+*-])(\d+)=")
EVAL_FRACTION = 0.1


@dataclass(frozen=True)
class ArithProblem:
    prompt: str
    answer: str
    level: int

    @property
    def prompt_id(self) -> str:
        return prompt_id(self.prompt)

    def payload(self) -> dict[str, Any]:
        return {
            "prompt": self.prompt,
            "answer": self.answer,
            "level": self.level,
            "source": f"arith-L{self.level}",
            "prompt_id": self.prompt_id,
        }


def split_of(prompt: str, eval_fraction: float = EVAL_FRACTION) -> str:
    """``"eval"`` for about ``eval_fraction`` of all prompts, else ``"train"`` (deterministic)."""
    return hash_split(prompt, b"split:", eval_fraction)


def _binop(a: int, op: str, b: int) -> ArithProblem:
    if op == "+":
        v = a + b
    elif op == "-":
        v = a - b
    else:
        v = a * b
    return ArithProblem(f"{a}{op}{b}=", str(v), 0)


def _two_digit_pair(rng: random.Random, fits: Callable[[int, str, int], bool]) -> ArithProblem:
    while True:
        a, b = rng.randint(10, 99), rng.randint(10, 99)
        op = "+" if rng.random() < 0.5 else "-"
        if op == "-":
            a, b = max(a, b), min(a, b)
        if fits(a, op, b):
            return _binop(a, op, b)


def _fixed_width(a: int, op: str, b: int) -> bool:
    v = a + b if op == "+" else a - b
    return 10 <= v <= 99


def generate_problem(level: int, rng: random.Random) -> ArithProblem:
    """One random problem of ``level`` drawn with ``rng``."""
    r = rng.randint
    if level == 1:
        p = _binop(r(0, 9), "+", r(0, 9))
    elif level == 2:
        # every prompt has the same layout, dd+dd=dd or dd-dd=dd: learnable fast
        p = _two_digit_pair(rng, _fixed_width)
    elif level == 3:
        if rng.random() < 0.5:
            a, b, c = r(0, 9), r(0, 9), r(0, 9)
            p = ArithProblem(f"{a}+{b}+{c}=", str(a + b + c), 0)
        else:  # the two-digit problems level 2 leaves out: 3-digit sums, 1-digit differences
            p = _two_digit_pair(rng, lambda a, op, b: not _fixed_width(a, op, b))
    elif level == 4:
        x = rng.random()
        if x < 0.3:
            p = _binop(r(100, 999), "+", r(100, 999))
        elif x < 0.6:
            a, b = r(100, 999), r(100, 999)
            p = _binop(max(a, b), "-", min(a, b))
        elif x < 0.8:
            p = _binop(r(0, 9), "*", r(0, 9))
        else:
            p = _binop(r(10, 99), "*", r(2, 9))
    else:
        raise ValueError(f"unknown arithmetic level {level} (known: {list(LEVELS)})")
    return ArithProblem(p.prompt, p.answer, level)


def carry_slip_answer(problem: ArithProblem) -> str:
    """The answer with every carry (``+``) or borrow (``-``) forgotten, column by column.

    Problems of another shape (``a*b``, ``a+b+c``) are returned unchanged: their answer.
    """
    m = _BINARY.fullmatch(problem.prompt)
    if not m or m.group(2) not in "+-":
        return problem.answer
    a, op, b = m.group(1), m.group(2), m.group(3)
    width = max(len(a), len(b))
    da, db = a.zfill(width), b.zfill(width)
    cols = [
        (int(x) + int(y)) % 10 if op == "+" else (int(x) - int(y)) % 10 for x, y in zip(da, db)
    ]
    return "".join(map(str, cols)).lstrip("0") or "0"


def with_carry_slips(
    problems: Iterable[ArithProblem], slip: float, seed: int = 0
) -> list[ArithProblem]:
    """The problems as a slipping teacher answers them (see the module doc), seeded.

    Each problem whose slipped answer differs from the right one gets it with probability
    ``slip``; ``slip=0`` returns the problems unchanged.
    """
    if not 0.0 <= slip <= 1.0:
        raise ValueError(f"slip must be in [0, 1], not {slip}")
    rng = random.Random(f"carry-slip:{seed}")
    out = []
    for p in problems:
        slipped = carry_slip_answer(p)
        if slipped != p.answer and rng.random() < slip:
            p = ArithProblem(p.prompt, slipped, p.level)
        out.append(p)
    return out


def arithmetic_problems(
    levels: int | Iterable[int] | str = (1, 2),
    split: str = "train",
    n: int = 1000,
    seed: int = 0,
    *,
    unique: bool = True,
    weights: Iterable[float] | None = None,
    eval_fraction: float = EVAL_FRACTION,
) -> list[ArithProblem]:
    """``n`` problems of ``split`` (``train``/``eval``) drawn from ``levels``, seeded.

    With ``unique`` (the default) no prompt repeats; a level whose split has fewer distinct
    prompts than asked for contributes what it has, so the result may be shorter than ``n``.
    The level of each problem is drawn with ``weights`` (default: uniform).
    """
    check_split(split)
    lv = parse_levels(levels, LEVELS, "arithmetic")
    w = list(weights) if weights is not None else [1.0] * len(lv)
    if len(w) != len(lv):
        raise ValueError("weights must have one entry per level")
    rng = random.Random(f"arith:{seed}:{split}:{','.join(map(str, lv))}")
    return draw_split(
        lambda: generate_problem(rng.choices(lv, weights=w)[0], rng),
        lambda p: p.prompt,
        lambda prompt: split_of(prompt, eval_fraction),
        split,
        n,
        unique=unique,
        max_misses=5000,
    )


def train_problems(levels=(1, 2), n: int = 5000, seed: int = 0, **kw: Any) -> list[ArithProblem]:
    return arithmetic_problems(levels, "train", n, seed, **kw)


def eval_problems(levels=(1, 2), n: int = 200, seed: int = 1234, **kw: Any) -> list[ArithProblem]:
    """The held-out eval set: a fixed sample (``seed``) of eval-split prompts."""
    return arithmetic_problems(levels, "eval", n, seed, **kw)
