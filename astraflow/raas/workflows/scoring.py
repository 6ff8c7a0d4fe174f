"""A workflow's reward of one completion: a reward spec, a checker, or the default check."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astraflow.raas.workflows.base import Checker
from astraflow.tasks.rewards import make_reward


def default_checker() -> Checker:
    """``astraflow.tasks.check_answer`` when it exists, else exact stripped match."""
    try:
        from astraflow.tasks import check_answer  # type: ignore[attr-defined]

        return check_answer
    except ImportError:
        return exact_match


def exact_match(completion: str, answer: str) -> float:
    """1.0 when ``completion`` is ``answer`` (stripped), else 0.0."""
    return 1.0 if completion.strip() == str(answer).strip() else 0.0


class Scorer:
    """A workflow's reward: the registry's ``reward`` spec (``astraflow.tasks.rewards``),
    else ``checker(completion, answer)``, else the default numeric check."""

    def __init__(self, reward: Any = None, checker: Checker | None = None):
        self.reward = make_reward(reward) if reward is not None else None
        self.checker = checker

    def __call__(self, completion: str, payload: Mapping[str, Any]) -> float:
        if self.reward is not None:
            return self.reward(completion, payload)
        return (self.checker or default_checker())(completion, str(payload["answer"]))


__all__ = ["Scorer", "default_checker", "exact_match"]
