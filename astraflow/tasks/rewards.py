"""Rewards as data: a registry of reward functions named in a topology.

A reward scores one completion against its task payload: ``reward(completion, payload) ->
float``. A topology names it as a string (``reward: exact_match``) or a mapping with
options (``reward: {name: format, pattern: "-?\\d+"}``). Registered rewards:

* ``exact_match``: 1 when the completion, cut at the first end-of-sequence marker and
  stripped, equals ``payload["answer"]`` (``case_sensitive``, default true).
* ``numeric``: 1 when the completion's final number (last ``\\boxed{}``, else after
  ``####``, else the last number) equals the answer by value.
* ``first_integer``: 1 when the first number of the completion (cut at the first
  end-of-sequence marker) equals the answer by value: ``82``, ``82.`` and ``82 is the sum``
  earn it for 82; ``37+45=82`` does not (its first number is 37), nor ``8.2``. Thousands
  separators (``1,234``) are read. The lenient check of a task whose answer is a number.
* ``closeness``: partial credit for a near miss, ``max(0, 1 - |got - want| / max(|want|,
  1))`` on the completion's final number (as ``numeric`` extracts it); with ``alone``
  (default false) only when the completion is that number alone. A dense signal where the
  exact answer is rarely sampled.
* ``format``: 1 when the stripped completion fully matches ``pattern`` (a regex).
* ``code_tests``: the fraction of ``payload["tests"]`` (``[[args, expected], ...]``) that
  the completion's function ``payload["func"]`` (default ``f``) passes in the sandbox; 0
  when its run hit the sandbox's process/thread limit (``max_procs``).
* ``math_verify``: 1 when math-verify (``astraflow.tasks.mathverify``) finds the
  completion's final answer equal to ``payload["answer"]``: the rest of the line after its
  last ``####`` when it has one, else the final answer math-verify finds in it
  (``\\boxed{18}``, ``The answer is 18.``, ``$18.00``, ``\\frac{36}{2}``). With
  ``marker_only`` (default false) a completion without ``####`` or ``\\boxed`` scores 0
  (the format the prompt asks for, strictly).
  ``timeout_s`` (default 5) bounds one answer's check, ``mem_mb`` (default 1024) its
  child process's memory; past either it scores 0. Needs ``pip install math-verify``.
* ``reasoning_gym``: the task's own ``score_answer`` (reasoning-gym) on the entry a
  ``reasoning_gym:`` dataset payload was drawn from, of the completion's last
  ``<answer>...</answer>`` (``tag``, default ``answer``; null: the whole completion),
  cut at the first end-of-sequence marker (``astraflow.tasks.reasoning_gym``).
* ``verifiers``: a verifiers environment's rubric (``environment``, ``args``: as the
  ``verifiers`` workflow names it) of the completion as the one assistant answer to the
  row a ``verifiers:`` dataset payload names: the held-out score of the evaluator, which
  samples one answer (``astraflow.tasks.verifiers_data``).
* ``sum``: ``terms`` (a list of reward specs, each with an optional ``weight``) added up;
  for instance correctness plus a small format bonus.

``register_reward(name)`` adds one.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.tasks.check import (
    check_answer,
    cut_at_stop,
    extract_final_number,
    normalize_answer,
    to_decimal,
)

Reward = Callable[[str, Mapping[str, Any]], float]
RewardFactory = Callable[..., Reward]

REWARDS: dict[str, RewardFactory] = {}


class RewardError(AstraflowError, ValueError):
    """A reward spec that names no known reward or has bad options."""


def register_reward(name: str) -> Callable[[RewardFactory], RewardFactory]:
    """Decorator: make a reward factory (options -> reward function) known as ``name``."""

    def wrap(factory: RewardFactory) -> RewardFactory:
        REWARDS[name] = factory
        return factory

    return wrap


def make_reward(spec: str | Mapping[str, Any] | None, default: str = "numeric") -> Reward:
    """The reward function a spec names (``None``: ``default``)."""
    if spec is None:
        spec = default
    if isinstance(spec, str):
        name, options = spec, {}
    elif isinstance(spec, Mapping):
        options = {k: v for k, v in spec.items() if k != "name"}
        name = spec.get("name")  # type: ignore[assignment]
        if not isinstance(name, str):
            raise RewardError(f"reward: a mapping needs a 'name' (known: {sorted(REWARDS)})")
    else:
        raise RewardError(f"reward: expected a name or a mapping, not {spec!r}")
    factory = REWARDS.get(name)
    if factory is None:
        raise RewardError(f"reward: unknown reward {name!r} (known: {sorted(REWARDS)})")
    try:
        return factory(**options)
    except TypeError as e:
        raise RewardError(f"reward {name!r}: bad options {sorted(options)}: {e}") from None


def _answer(payload: Mapping[str, Any]) -> str:
    if "answer" not in payload:
        raise RewardError("reward: the task payload has no 'answer'")
    return str(payload["answer"])


@register_reward("exact_match")
def exact_match(case_sensitive: bool = True) -> Reward:
    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        got, want = cut_at_stop(completion).strip(), _answer(payload).strip()
        if not case_sensitive:
            got, want = got.lower(), want.lower()
        return 1.0 if got == want else 0.0

    return reward


@register_reward("numeric")
def numeric() -> Reward:
    return lambda completion, payload: check_answer(completion, _answer(payload))


# a number that does not continue a word, a number or a decimal point: "10-5" starts with
# 10, "-5" alone is minus five; commas only between groups of three digits ("12,13" is 12)
_FIRST_NUMBER = re.compile(r"(?<![\w.])-?\d+(?:,\d{3})*(?:\.\d+)?")


@register_reward("first_integer")
def first_integer() -> Reward:
    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        want = to_decimal(normalize_answer(_answer(payload)))
        if want is None:
            raise RewardError(f"reward first_integer: the answer {_answer(payload)!r} is not "
                              "a number")
        m = _FIRST_NUMBER.search(cut_at_stop(completion))
        got = to_decimal(m.group()) if m else None
        return 1.0 if got is not None and got == want else 0.0

    return reward


def nearness(distance: float, size: float) -> float:
    """``1 - distance / max(size, 1)``, at least 0 (nan, from an infinite distance, is 0):
    how near a number is to one of magnitude ``size`` it is ``distance`` away from."""
    return max(0.0, 1.0 - distance / max(size, 1.0))


@register_reward("closeness")
def closeness(alone: bool = False) -> Reward:
    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        text = cut_at_stop(completion).strip()
        got = extract_final_number(text)
        want = to_decimal(normalize_answer(_answer(payload)))
        if got is None or want is None or (alone and text.replace(",", "") != got):
            return 0.0
        value = to_decimal(got)
        if value is None:
            return 0.0
        return nearness(float(abs(value - want)), float(abs(want)))

    return reward


@register_reward("format")
def format_match(pattern: str = r"-?\d+") -> Reward:
    try:
        rx = re.compile(pattern)
    except re.error as e:
        raise RewardError(f"reward format: bad pattern {pattern!r}: {e}") from None
    return lambda completion, payload: 1.0 if rx.fullmatch(cut_at_stop(completion).strip()) \
        else 0.0


@register_reward("code_tests")
def code_tests(cpu_s: int = 2, mem_mb: int = 256, timeout_s: float = 5.0,
               max_procs: int = 32) -> Reward:
    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        from astraflow.sandbox import check_cases

        tests = payload.get("tests")
        if not isinstance(tests, list) or not tests:
            raise RewardError("reward code_tests: the payload has no 'tests' list")
        cases = [(list(args), expected) for args, expected in tests]
        report = check_cases(cut_at_stop(completion), str(payload.get("func", "f")), cases,
                             cpu_s=cpu_s, mem_mb=mem_mb, timeout_s=timeout_s,
                             max_procs=max_procs)
        return 0.0 if report.run.result.status == "limit" else report.fraction

    return reward


@register_reward("math_verify")
def math_verify(timeout_s: float = 5.0, mem_mb: int = 1024, marker_only: bool = False) -> Reward:
    from astraflow.tasks.mathverify import AnswerVerifier, MathVerifyError, final_answer_text

    try:  # the child process starts on the first answer; the package is checked now
        verifier = AnswerVerifier(timeout_s=timeout_s, mem_mb=mem_mb)
    except (MathVerifyError, ValueError) as e:
        raise RewardError(f"reward math_verify: {e}") from None

    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        text = cut_at_stop(completion)
        if marker_only and "####" not in text and "\\boxed" not in text:
            return 0.0
        gold = normalize_answer(_answer(payload))
        return 1.0 if verifier(gold, final_answer_text(text)) else 0.0

    return reward


@register_reward("reasoning_gym")
def reasoning_gym(tag: str | None = "answer") -> Reward:
    from astraflow.tasks import reasoning_gym as rg

    return lambda completion, payload: rg.score(cut_at_stop(completion), payload, tag)


@register_reward("verifiers")
def verifiers_rubric(environment: str, args: dict[str, Any] | None = None) -> Reward:
    from astraflow.tasks.verifiers_data import rubric_reward

    return rubric_reward(environment, args)


@register_reward("sum")
def weighted_sum(terms: list[Any]) -> Reward:
    if not terms:
        raise RewardError("reward sum: 'terms' must list at least one reward")
    parts = []
    for t in terms:
        weight = float(t.get("weight", 1.0)) if isinstance(t, Mapping) else 1.0
        inner = {k: v for k, v in t.items() if k != "weight"} if isinstance(t, Mapping) else t
        parts.append((weight, make_reward(inner)))
    return lambda completion, payload: sum(w * r(completion, payload) for w, r in parts)


__all__ = ["REWARDS", "Reward", "RewardError", "make_reward", "nearness",
           "register_reward"]
