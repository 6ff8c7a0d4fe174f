"""The common part of the two-policy math workflows (``solve_verify``, ``solve_select``).

Both take the arithmetic payload of ``single_turn`` (``{"prompt": "37+45=", "answer":
"82"}``) and call two engines, one per policy, picked by the option names (the task's
``policies`` list is informational); the prompt formats are those of ``astraflow.roles``.
Every returned ``Sequence`` carries its ``policy`` (the router sends it to
``samples.<policy>``) and its ``role``; ``meta`` records what the role saw and said.

GRPO groups. The trainer of a policy computes group advantages over that policy's
sequences of one ``TrajectoryGroup``. The verifier's n verdicts of a prompt thus form one
group (its baseline is its accuracy on this problem), and so do the selector's picks. The
solver's group holds its n first tries *and* its retries: a retry's advantage is measured
against how well the solver does on this very problem, so a single retry (that fixes or
repeats a mistake) still carries signal. A run that wants strict per-role groups (first
tries apart from retries, or one policy playing both solver and verifier) sets the
router's ``split_roles: true``: each (policy, role) becomes its own group.

Options (both workflows, ``astraflow.config.options.TwoPolicyOptions``, where each has its
default): ``solver_policy``, ``verifier_policy`` or ``selector_policy``, the sampling
options of ``single_turn`` for the solver, ``verifier_sampling`` / ``selector_sampling``
(the judge's, over the solver's; ``max_new_tokens`` per turn), ``max_answer_chars`` (how
much of an answer the judge is shown), ``reward`` (a reward spec of
``astraflow.tasks.rewards`` for the solver's answers; default: 1 when the checker says
right, else 0; an answer is *right* when the checker (``checker``, a callable) says so,
whatever the reward) and ``prompt_format``:

* ``compact``: the tiny model's one-line formats (``astraflow.roles.formats``);
* ``chat``: natural instructions as chat messages, built by each policy's chat template
  (``astraflow.roles.chat_formats``; the solver's prompt is the task's own, as
  ``single_turn`` builds it);
* ``auto`` (default): ``chat`` when the solver's engine formats prompts with a chat
  template (a pretrained chat model), else ``compact`` (the tiny model has none).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from astraflow.config.options import JudgeSamplingOptions, TwoPolicyOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker
from astraflow.raas.workflows.inputs import (
    chat_ids,
    encode_prompt,
    parse_payload,
    policy_engine,
    speaks_chat,
)
from astraflow.raas.workflows.scoring import Scorer, default_checker
from astraflow.roles.chat_formats import chat_candidate
from astraflow.roles.formats import candidate_answer
from astraflow.wire.records import Task

ROLE_SOLVER = "solver"


def flag(x: bool) -> str:
    """``"1"`` or ``"0"``: a boolean as a ``Sequence.meta`` value."""
    return "1" if x else "0"


def mean(xs: list[float]) -> float:
    """The mean of ``xs``, 0.0 when empty."""
    return statistics.fmean(xs) if xs else 0.0


class TwoPolicyWorkflow:
    """The common part of a solver and a judge (verifier or selector) on arithmetic tasks:
    their engines by policy name, the checker, the rewards (``judge_reward``: the judge's
    own answers') and the judge's sampling options."""

    judge_role = ""

    def __init__(self, options: TwoPolicyOptions, judge_policy: str,
                 judge_sampling: JudgeSamplingOptions | None, checker: Checker | None):
        self.options = options
        self.prompt_format = options.prompt_format
        self.score = Scorer(options.reward, checker) if options.reward is not None else None
        self.judge_score = (Scorer(options.judge_reward, checker)
                            if options.judge_reward is not None else None)
        self.solver_policy = options.solver_policy
        self.judge_policy = judge_policy
        self.checker = checker
        self.max_answer_chars = options.max_answer_chars
        self.sampling = options
        self.judge_sampling = JudgeSamplingOptions.over(judge_sampling, options)

    def _start(self, task: Task, engines: Mapping[str, Engine]):
        """``(payload, solver engine, judge engine, checker)`` of ``task`` (its payload has
        a ``prompt`` and an ``answer``)."""
        payload = parse_payload(task, ("prompt", "answer"))
        solver = policy_engine(engines, self.solver_policy, "solver")
        judge = policy_engine(engines, self.judge_policy, self.judge_role)
        return payload, solver, judge, self.checker or default_checker()

    def chat(self, solver: Engine) -> bool:
        """Whether this workflow speaks the chat format to ``solver``'s (and the judge's)
        engine (``prompt_format``; ``auto``: when the solver's prompts use a template)."""
        return speaks_chat(self.prompt_format, solver)

    @staticmethod
    def chat_ids(engine: Engine, payload: Mapping[str, Any]) -> list[int]:
        """``payload`` as ``engine``'s prompt token ids, through its chat format."""
        return chat_ids(engine, payload)

    def solver_ids(self, solver: Engine, prompt: str, chat: bool) -> list[int]:
        """The solver's prompt: the task's prompt through the chat template, or as is."""
        return self.chat_ids(solver, {"prompt": prompt}) if chat else encode_prompt(solver,
                                                                                     prompt)

    def candidate(self, text: str, chat: bool) -> str:
        """What the judge is shown of a solver completion."""
        return (chat_candidate if chat else candidate_answer)(text, self.max_answer_chars)

    def answer_reward(self, text: str, payload: Mapping[str, Any], right: bool) -> float:
        """The solver's reward for ``text``: the ``reward`` spec, else its rightness."""
        return float(right) if self.score is None else float(self.score(text, payload))

    def judge_answer_reward(self, text: str, payload: Mapping[str, Any], right: bool) -> float:
        """The reward of the judge's own answer ``text``: ``judge_reward``, else the
        solver's."""
        if self.judge_score is None:
            return self.answer_reward(text, payload, right)
        return float(self.judge_score(text, payload))


__all__ = ["ROLE_SOLVER", "TwoPolicyWorkflow", "flag", "mean"]
