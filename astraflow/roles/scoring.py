"""Held-out evaluation of a role: verdict accuracy on balanced right/wrong candidates
(always "y" scores 0.5), or pick accuracy on pairs of one right and one wrong answer."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from astraflow.models.evaluation import generate_answers
from astraflow.roles.formats import (
    APPROVE,
    OWN_END,
    REJECT,
    ROLES,
    blind_verdict_context,
    own_answer,
    parse_pick,
    parse_verdict,
    select_prompt,
    verify_prompt,
)
from astraflow.roles.teacher import wrong_answer


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


__all__ = ["blind_verdicts", "evaluate_role", "role_eval_examples", "role_scorer",
           "score_role"]
