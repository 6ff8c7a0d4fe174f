"""Held-out scores of the ``code_tests`` roles on a chat model (``astraflow eval run
--role coder|tester``), on the held-out split of ``astraflow.tasks.code``, greedy, with
the prompts the workflow sends:

* coder (the solver): the share of held-out specs whose function passes every hidden
  test, run in the sandbox;
* tester (the test generator): the workflow's mutation reward without solver attempts,
  averaged: the share of its asserts the reference passes times the share of the
  reference's live mutants (those the hidden tests tell apart from it) that those valid
  asserts catch. The reference and its mutants are ours (``tasks.mutants``): evaluated
  in this process on the asserts' literal arguments.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.models.evaluation import generate_answers
from astraflow.sandbox import normalise, run_function
from astraflow.tasks.code import (
    CodeProblem,
    chat_generator_prompt,
    chat_solver_prompt,
    code_problems,
    evaluate_reference,
)
from astraflow.tasks.code_parsing import extract_program, parse_assert_tests
from astraflow.tasks.mutants import mutants

CODE_ROLES = ("coder", "tester")
SANDBOX = {"cpu_s": 1.0, "mem_mb": 256, "timeout_s": 5.0}


def _value(params: tuple[str, ...], expr: str, args: list[Any]) -> tuple[bool, Any]:
    """``(ok, value)`` of one of our expressions on ``args`` (normalised)."""
    try:
        return True, normalise(evaluate_reference(params, expr, tuple(args)))
    except Exception:  # noqa: BLE001 - a mutant may raise on any input
        return False, None


def passes_all(program: str, p: CodeProblem) -> bool:
    """Whether ``program`` (a chat solver's function) passes every hidden test of ``p``
    in the sandbox."""
    if not program:
        return False
    run = run_function(program, "f", [list(a) for a, _ in p.tests], **SANDBOX)
    return all(c is not None and c.ok and c.value == normalise(x)
               for c, (_, x) in zip(run.cases, p.tests))


def mutation_reward(reply: str, p: CodeProblem, max_tests: int = 8) -> float:
    """The tester's held-out reward for ``reply`` on ``p`` (module doc); 0 when it has no
    assert line."""
    parsed = parse_assert_tests(reply, "f", len(p.params), max_tests)
    if parsed is None:
        return 0.0
    tests, read = parsed
    valid = [(a, x) for a, x in tests if _value(p.params, p.expr, a) == (True, x)]
    live = [m for m in mutants(p.expr)
            if any(_value(p.params, m, list(a)) != (True, normalise(x)) for a, x in p.tests)]
    if not live:
        return len(valid) / read
    killed = sum(any(_value(p.params, m, a) != (True, x) for a, x in valid) for m in live)
    return len(valid) / read * killed / len(live)


def code_role_scorer(role: str, levels: list[int], n: int, chat: Any,
                     max_new_tokens: int = 64) -> Callable[[Any, Any], float]:
    """``score(model, tokenizer)`` of a ``role`` of ``CODE_ROLES`` on ``n`` held-out
    specs of ``levels``, prompts built by ``chat`` (an ``astraflow.models.chat.ChatFormat``)."""
    if role not in CODE_ROLES:
        raise ValueError(f"unknown code role {role!r} (known: {', '.join(CODE_ROLES)})")
    problems = code_problems(levels, "eval", n)
    make = chat_solver_prompt if role == "coder" else chat_generator_prompt

    def score(model: Any, tokenizer: Any) -> float:
        prompts = [chat.prompt_text(tokenizer, {"prompt": make(p.spec, p.params)})
                   for p in problems]
        replies = generate_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
        if role == "coder":
            scores = [float(passes_all(extract_program(r, "f"), p))
                      for r, p in zip(replies, problems)]
        else:
            scores = [mutation_reward(r, p) for r, p in zip(replies, problems)]
        return sum(scores) / len(scores)

    return score


__all__ = ["CODE_ROLES", "code_role_scorer", "mutation_reward", "passes_all"]
