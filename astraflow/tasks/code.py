"""Seeded synthetic code tasks: write a one-expression Python function from a short spec.

Every task is a function ``f`` of one int (``x``), two ints (``x, y``) or a list of ints
(``xs``) described in a few words, with a reference solution that is one expression and
hidden test cases (argument lists and expected results). Prompts and answers are short and
use only characters the tiny char-level tokenizer knows, so the embedded default model can
play both roles of the ``code_tests`` workflow:

* solver prompt ``"multiply x by 3 then add 1\\ndef f(x): return "``, answer ``x*3+1``;
* test-generator prompt ``"multiply x by 3 then add 1\\ntests of f(x): "``, answer e.g.
  ``f(2)==7;f(0)==1``.

Levels (distinct specs in brackets):

1. one int, one operation: add, subtract, multiply by a constant [45]
2. one int, two operations or a builtin: ``x*a+b``, ``(x+a)*b``, ``x*x+k``, ``x%k``,
   ``x//k``, ``abs(x-k)`` [178]
3. two ints: ``x+y``, ``x*y+k``, ``max``/``min``, ``a*x+b*y``, ``x-y`` [85]
4. a list of ints: ``sum``, ``len``, ``max``, ``min``, reversed, sorted, first item, count
   of a value, every item times a constant [31]

The split is a function of the spec text only (as for arithmetic): held-out eval specs never
appear in train. Hidden tests are seeded by the spec, so a spec always has the same tests.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from astraflow.tasks.base import prompt_id
from astraflow.tasks.split import check_split, draw_split, hash_split, parse_levels

LEVELS = (1, 2, 3, 4)
EVAL_FRACTION = 0.1
N_TESTS = 5
FUNC = "f"

# What the trusted reference expressions may call (they are ours, never model output).
_REF_BUILTINS = {"abs": abs, "max": max, "min": min, "sum": sum, "len": len, "sorted": sorted}


@dataclass(frozen=True)
class CodeProblem:
    """One task: ``spec`` in words, parameter names, reference expression, hidden tests."""

    spec: str
    params: tuple[str, ...]
    expr: str
    level: int
    tests: tuple[tuple[tuple[Any, ...], Any], ...] = ()

    @property
    def signature(self) -> str:
        return f"{FUNC}({', '.join(self.params)})"

    @property
    def reference(self) -> str:
        """The reference solution as Python source."""
        return reference_source(self.params, self.expr)

    @property
    def prompt(self) -> str:
        """The solver's prompt; its answer is the expression (``answer``)."""
        return solver_prompt(self.spec, self.params)

    @property
    def prompt_id(self) -> str:
        return prompt_id(self.prompt)

    def payload(self) -> dict[str, Any]:
        """The task payload the ``code_tests`` workflow reads (JSON-able)."""
        return {
            "prompt": self.prompt,
            "answer": self.expr,
            "spec": self.spec,
            "func": FUNC,
            "params": list(self.params),
            "reference": self.reference,
            "tests": [[list(args), expected] for args, expected in self.tests],
            "level": self.level,
            "source": f"code-L{self.level}",
            "prompt_id": self.prompt_id,
        }


def solver_prompt(spec: str, params: Iterable[str], func: str = FUNC) -> str:
    """``"<spec>\\ndef f(x): return "``: the solver completes the expression."""
    return f"{spec}\ndef {func}({', '.join(params)}): return "


def generator_prompt(spec: str, params: Iterable[str], func: str = FUNC) -> str:
    """``"<spec>\\ntests of f(x): "``: the generator writes ``f(1)==2;...``."""
    return f"{spec}\ntests of {func}({', '.join(params)}): "


def chat_solver_prompt(spec: str, params: Iterable[str], func: str = FUNC) -> str:
    """The solver's instruction for a chat model: write the whole function."""
    return (f"Write a Python function `def {func}({', '.join(params)}):` for this task: "
            f"{spec}. Reply with the code only.")


def chat_generator_prompt(spec: str, params: Iterable[str], func: str = FUNC,
                          tests: int = 3) -> str:
    """The test generator's instruction for a chat model: assert lines, numbers only."""
    params = list(params)
    example = ", ".join("[1, 2]" if p == "xs" else str(i + 1) for i, p in enumerate(params))
    return (f"A Python function `{func}({', '.join(params)})` should do this: {spec}.\n"
            f"Write {tests} test cases for it, one per line, each of the form "
            f"`assert {func}({example}) == RESULT` with the right RESULT. Reply with the "
            "asserts only.")


def reference_source(params: Iterable[str], expr: str, func: str = FUNC) -> str:
    """Python source defining ``func(params)`` as ``return expr``."""
    return f"def {func}({', '.join(params)}): return {expr}\n"


def split_of(spec: str, eval_fraction: float = EVAL_FRACTION) -> str:
    """``"eval"`` for about ``eval_fraction`` of all specs, else ``"train"`` (deterministic)."""
    return hash_split(spec, b"code-split:", eval_fraction)


def evaluate_reference(params: tuple[str, ...], expr: str, args: tuple[Any, ...]) -> Any:
    """The value of one of OUR reference expressions (trusted; not for model output)."""
    env = dict(zip(params, args))
    return eval(expr, {"__builtins__": _REF_BUILTINS}, env)  # our own templates only


# --- templates ----------------------------------------------------------------------------
_Template = Callable[[random.Random], tuple[str, tuple[str, ...], str]]


def _level1(r: random.Random) -> tuple[str, tuple[str, ...], str]:
    k = r.randint(1, 15)
    kind = r.randrange(3)
    if kind == 0:
        return f"add {k} to x", ("x",), f"x+{k}"
    if kind == 1:
        return f"subtract {k} from x", ("x",), f"x-{k}"
    return f"multiply x by {k}", ("x",), f"x*{k}"


def _level2(r: random.Random) -> tuple[str, tuple[str, ...], str]:
    a, b = r.randint(2, 9), r.randint(1, 9)
    kind = r.randrange(6)
    if kind == 0:
        return f"multiply x by {a} then add {b}", ("x",), f"x*{a}+{b}"
    if kind == 1:
        return f"add {b} to x then multiply by {a}", ("x",), f"(x+{b})*{a}"
    if kind == 2:
        return f"square x then add {b}", ("x",), f"x*x+{b}"
    if kind == 3:
        return f"x modulo {a}", ("x",), f"x%{a}"
    if kind == 4:
        return f"x divided by {a} rounded down", ("x",), f"x//{a}"
    return f"distance from x to {b}", ("x",), f"abs(x-{b})"


def _level3(r: random.Random) -> tuple[str, tuple[str, ...], str]:
    a, b = r.randint(2, 9), r.randint(1, 9)
    kind = r.randrange(6)
    xy = ("x", "y")
    if kind == 0:
        return "add x and y", xy, "x+y"
    if kind == 1:
        return "subtract y from x", xy, "x-y"
    if kind == 2:
        return f"multiply x by y then add {b}", xy, f"x*y+{b}"
    if kind == 3:
        return "the larger of x and y", xy, "max(x,y)"
    if kind == 4:
        return "the smaller of x and y", xy, "min(x,y)"
    return f"{a} times x plus {b} times y", xy, f"{a}*x+{b}*y"


def _level4(r: random.Random) -> tuple[str, tuple[str, ...], str]:
    k = r.randint(2, 9)
    xs = ("xs",)
    return r.choice(
        [
            ("the sum of xs", xs, "sum(xs)"),
            ("the length of xs", xs, "len(xs)"),
            ("the largest item of xs", xs, "max(xs)"),
            ("the smallest item of xs", xs, "min(xs)"),
            ("xs reversed", xs, "xs[::-1]"),
            ("xs sorted", xs, "sorted(xs)"),
            ("the first item of xs", xs, "xs[0]"),
            (f"how many times {k} is in xs", xs, f"xs.count({k})"),
            (f"each item of xs times {k}", xs, f"[v*{k} for v in xs]"),
            (f"the sum of xs plus {k}", xs, f"sum(xs)+{k}"),
        ]
    )


_TEMPLATES: dict[int, _Template] = {1: _level1, 2: _level2, 3: _level3, 4: _level4}


def _test_inputs(spec: str, params: tuple[str, ...], n: int) -> list[tuple[Any, ...]]:
    """``n`` distinct argument tuples, seeded by the spec."""
    r = random.Random(f"code-tests:{spec}")
    out: list[tuple[Any, ...]] = []
    tries = 0
    while len(out) < n and tries < 100 * n:
        tries += 1
        if params == ("xs",):
            args: tuple[Any, ...] = ([r.randint(0, 9) for _ in range(r.randint(1, 5))],)
        elif len(out) == 0:
            args = tuple(0 if i == 0 else r.randint(1, 9) for i in range(len(params)))
        else:
            args = tuple(r.randint(-9, 20) for _ in params)
        if args not in out:
            out.append(args)
    return out


def generate_problem(level: int, rng: random.Random, n_tests: int = N_TESTS) -> CodeProblem:
    """One random problem of ``level`` drawn with ``rng``, with its hidden tests."""
    template = _TEMPLATES.get(level)
    if template is None:
        raise ValueError(f"unknown code level {level} (known: {list(LEVELS)})")
    spec, params, expr = template(rng)
    tests = tuple(
        (args, evaluate_reference(params, expr, args))
        for args in _test_inputs(spec, params, n_tests)
    )
    return CodeProblem(spec, params, expr, level, tests)


def code_problems(
    levels: int | Iterable[int] | str = (1, 2),
    split: str = "train",
    n: int = 1000,
    seed: int = 0,
    *,
    unique: bool = True,
    n_tests: int = N_TESTS,
    eval_fraction: float = EVAL_FRACTION,
) -> list[CodeProblem]:
    """``n`` problems of ``split`` (``train``/``eval``) drawn uniformly from ``levels``,
    seeded. With ``unique`` no spec repeats, so the result is shorter than ``n`` when the
    split has fewer distinct specs."""
    check_split(split)
    lv = parse_levels(levels, LEVELS, "code")
    rng = random.Random(f"code:{seed}:{split}:{','.join(map(str, lv))}")
    return draw_split(
        lambda: generate_problem(rng.choice(lv), rng, n_tests),
        lambda p: p.spec,
        lambda spec: split_of(spec, eval_fraction),
        split,
        n,
        unique=unique,
        max_misses=2000,
    )


def code_payloads(
    levels: int | Iterable[int] | str = (1, 2), split: str = "train", n: int = 1000, seed: int = 0
) -> list[dict[str, Any]]:
    """Payloads of ``code_problems(levels, split, n, seed)`` (what the feeder sends)."""
    return [p.payload() for p in code_problems(levels, split, n, seed)]


__all__ = [
    "FUNC",
    "LEVELS",
    "chat_generator_prompt",
    "chat_solver_prompt",
    "CodeProblem",
    "code_payloads",
    "code_problems",
    "evaluate_reference",
    "generate_problem",
    "generator_prompt",
    "reference_source",
    "solver_prompt",
    "split_of",
]
