"""Held-out accuracy of a chat model in a judge's role (``astraflow eval run --role
verifier|selector`` on a model with a chat template): the same prompts the workflows
send (``chat_formats``), on held-out problems with known candidates.

* verifier: verdict accuracy with right and wrong candidates alternating (balanced:
  always ``yes`` scores 0.5);
* selector: pick accuracy on two answers, one right and one wrong (right first or second
  in turn: always ``1`` scores 0.5).

Wrong candidates are near misses of the right answer (``teacher.wrong_answer``).
A blind verifier (``blind``, the ``solve_verify`` blind chat format) first answers the
problem, greedy, and then judges the candidate with its answer in view (``agreement``:
its verdict is its answer's agreement with the candidate, no second turn); a blind
selector picks the answer its own agrees with, else the first. A corrective
judge (``corrective``) replies with the correct answer, greedy: its verdict is agreement
with the candidate, its pick the answer it repeats (``chat_formats.agreement``).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from astraflow.models.evaluation import generate_answers
from astraflow.roles.chat_formats import (
    agreement,
    correction_messages,
    own_verdict_messages,
    parse_choice,
    parse_yes_no,
    select_messages,
    verify_messages,
)
from astraflow.roles.teacher import wrong_answer
from astraflow.tasks.check import cut_at_stop


def chat_role_examples(role: str, payloads: Sequence[Mapping[str, Any]],
                       seed: int = 1234) -> list[dict[str, Any]]:
    """One example per held-out payload (``prompt``, ``answer``): ``{"messages",
    "label"}``, ``label`` the true verdict (True/False) or the right answer's number."""
    rng = random.Random(f"chat-role-eval:{role}:{seed}")
    out = []
    for i, p in enumerate(payloads):
        problem, answer = str(p["prompt"]), str(p["answer"])
        wrong = wrong_answer(problem, answer, rng)[0]
        if role == "verifier":
            truth = i % 2 == 0
            shown = answer if truth else wrong
            out.append({**verify_messages(problem, shown), "label": truth,
                        "candidate": shown})
        elif role == "selector":
            slot = 1 + i % 2
            pair = [answer, wrong] if slot == 1 else [wrong, answer]
            out.append({**select_messages(problem, pair), "label": slot, "answers": pair})
        else:
            raise ValueError(f"no chat examples for role {role!r} (verifier, selector)")
    return out


def chat_role_scorer(role: str, payloads: Sequence[Mapping[str, Any]], chat: Any,
                     max_new_tokens: int = 4, blind: bool = False, corrective: bool = False,
                     agreement: bool = False) -> Callable[[Any, Any], float]:
    """``score(model, tokenizer)``: greedy verdict (pick) accuracy on ``payloads``'
    examples, prompts built by ``chat`` (an ``astraflow.models.chat.ChatFormat``); ``blind``:
    the verifier answers each problem first (``agreement``: its verdict is its answer's
    agreement with the candidate); ``corrective``: the judge replies with the correct
    answer (module doc)."""
    if agreement and not blind:
        raise ValueError("agreement: a blind verifier's verdict (blind=True)")
    examples = chat_role_examples(role, payloads)
    if not examples:
        raise ValueError("a role evaluation needs held-out problems")
    if blind and corrective:
        raise ValueError("blind or corrective, not both")
    if blind and role == "selector":  # it picks the answer its own agrees with
        return _blind_scorer(payloads, examples, chat, max_new_tokens, True)
    if blind:
        return _blind_scorer(payloads, examples, chat, max_new_tokens, agreement)
    if corrective:
        return _corrective_scorer(payloads, examples, chat, max_new_tokens)

    def score(model: Any, tokenizer: Any) -> float:
        prompts = [chat.prompt_text(tokenizer, e) for e in examples]
        replies = generate_answers(model, tokenizer, prompts, max_new_tokens=max_new_tokens)
        got = [parse_yes_no(r) if role == "verifier" else parse_choice(r, 2, e["answers"])
               for r, e in zip(replies, examples)]
        return sum(g is not None and g == e["label"] for g, e in zip(got, examples)) / len(
            examples)

    return score


def _blind_scorer(payloads: Sequence[Mapping[str, Any]], examples: list[dict[str, Any]],
                  chat: Any, max_new_tokens: int, agreement_only: bool = False
                  ) -> Callable[[Any, Any], float]:
    problems = [str(p["prompt"]) for p in payloads]
    shown = [e.get("candidate") for e in examples]

    def score(model: Any, tokenizer: Any) -> float:
        owns = generate_answers(model, tokenizer, [
            chat.prompt_text(tokenizer, {"prompt": p}) for p in problems],
            max_new_tokens=max_new_tokens)
        if agreement_only:
            # a blind selector with no answer agreeing picks the first
            return sum(_agrees_rightly(o, e, first=True) for o, e in zip(owns, examples)
                       ) / len(examples)
        replies = generate_answers(model, tokenizer, [
            chat.prompt_text(tokenizer, own_verdict_messages(p, cut_at_stop(o).strip(), c))
            for p, o, c in zip(problems, owns, shown)], max_new_tokens=max_new_tokens)
        return sum(parse_yes_no(r) == e["label"] for r, e in zip(replies, examples)) / len(
            examples)

    return score


def _corrective_scorer(payloads: Sequence[Mapping[str, Any]], examples: list[dict[str, Any]],
                       chat: Any, max_new_tokens: int) -> Callable[[Any, Any], float]:
    """A verifier's verdict is agreement with its candidate; a selector's pick is the
    answer it repeats."""
    shown = [_answers(e) for e in examples]

    def score(model: Any, tokenizer: Any) -> float:
        replies = generate_answers(model, tokenizer, [
            chat.prompt_text(tokenizer, correction_messages(str(p["prompt"]), answers))
            for p, answers in zip(payloads, shown)], max_new_tokens=max_new_tokens)
        return sum(_agrees_rightly(r, e) for r, e in zip(replies, examples)) / len(examples)

    return score


def _answers(example: dict[str, Any]) -> list[str]:
    """The answers an example shows: a verifier's one candidate, a selector's pair."""
    return [example["candidate"]] if "candidate" in example else example["answers"]


def _agrees_rightly(reply: str, example: dict[str, Any], first: bool = False) -> bool:
    """Whether the verdict (pick) by ``reply``'s agreement is ``example``'s label: a
    verifier approves when it agrees with the candidate; a selector picks the answer it
    agrees with (``first``: the first when none)."""
    got = agreement(reply, _answers(example))
    if "candidate" in example:
        return (got is not None) == example["label"]
    return (got or (1 if first else None)) == example["label"]


__all__ = ["chat_role_examples", "chat_role_scorer"]
