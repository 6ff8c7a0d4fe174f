"""Chat prompts of the multi-policy roles, for a pretrained chat model (SmolLM2-Instruct).

The tiny model's one-line formats (``formats``: ``37+45=82?`` -> ``82y``) mean nothing to
a chat model; these are natural instructions, sent as chat messages and formatted by the
policy's chat template (``astraflow.models.chat``), with lenient parsers of the replies:

==========  ===========================================  ================================
role        user message                                 reply
==========  ===========================================  ================================
verifier    ``Problem: ...`` / ``Proposed answer: 82`` /  ``yes`` or ``no`` (first word)
            ``Is the proposed answer correct? ...``
blind       the task's own prompt, then (its answer as   its own answer, then ``yes`` or
verifier    its turn) ``Proposed answer: 82`` / ...      ``no``
selector    ``Problem: ...`` / ``Answer 1: 82`` ...       the number of the best answer
            ``Which answer is correct? ...``             (the first number in the reply,
                                                         or the one answer it repeats)
corrective  ``Problem: ...`` / ``Proposed answer: 82``   the right answer (its number);
verifier    (``Answers`` 1..k for a selector) / ``Reply   its verdict is agreement with
/selector   with the correct answer ...``                the candidate (its pick: the
                                                         answer it repeats)
solver      the task's own prompt; after a rejection     a new answer
retry       the conversation goes on with
            ``That answer is wrong. ...``
==========  ===========================================  ================================

Each builder returns ``{"messages": [...]}``, a payload ``ChatFormat.prompt_ids`` takes.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from astraflow.tasks.check import cut_at_stop, extract_final_number

RETRY_MESSAGE = "That answer is wrong. Try again. Answer with the number only."
_WORD = re.compile(r"[a-z]+")
_INT = re.compile(r"\d+")


def user(content: str) -> dict[str, Any]:
    """A payload of one user message."""
    return {"messages": [{"role": "user", "content": content}]}


def verify_messages(problem: str, candidate: str) -> dict[str, Any]:
    """The verifier's prompt: the problem, a proposed answer, reply yes or no."""
    return user(f"Problem: {problem}\nProposed answer: {candidate}\n"
                "Is the proposed answer correct? Reply with yes or no only.")


def own_verdict_messages(problem: str, own: str, candidate: str) -> dict[str, Any]:
    """The blind verifier's second turn: the problem, its own answer as its turn, then a
    proposed answer to judge (yes or no)."""
    return {"messages": [{"role": "user", "content": problem},
                         {"role": "assistant", "content": own},
                         {"role": "user", "content": f"Proposed answer: {candidate}\n"
                          "Is the proposed answer correct? Reply with yes or no only."}]}


def correction_messages(problem: str, candidates: Sequence[str]) -> dict[str, Any]:
    """A corrective judge's prompt: the problem, one proposed answer (a verifier) or
    numbered answers (a selector), reply with the correct answer itself."""
    if len(candidates) == 1:
        shown = f"Proposed answer: {candidates[0]}"
    else:
        shown = "\n".join(f"Answer {i}: {c}" for i, c in enumerate(candidates, 1))
    return user(f"Problem: {problem}\n{shown}\nReply with the correct answer, the number "
                "only.")


def agreement(reply: str, candidates: Sequence[str]) -> int | None:
    """The 1-based number of the first candidate a corrective judge's reply agrees with
    (its final number is that candidate); None when it agrees with none or has no
    number."""
    said = extract_final_number(reply)
    if not said:
        return None
    same = [i for i, c in enumerate(candidates, 1) if c.strip() == said]
    return same[0] if same else None


def select_messages(problem: str, candidates: Sequence[str]) -> dict[str, Any]:
    """The selector's prompt: the problem, numbered answers, reply with the best one's
    number."""
    listed = "\n".join(f"Answer {i}: {c}" for i, c in enumerate(candidates, 1))
    return user(f"Problem: {problem}\n{listed}\nWhich answer is correct? Reply with its "
                f"number (1 to {len(candidates)}) only.")


def retry_messages(problem: str, first: str) -> dict[str, Any]:
    """The solver's retry: its rejected answer as its own turn, then the rejection."""
    return {"messages": [{"role": "user", "content": problem},
                         {"role": "assistant", "content": first},
                         {"role": "user", "content": RETRY_MESSAGE}]}


def parse_yes_no(text: str) -> bool | None:
    """True for a reply whose first word is ``yes`` (or ``correct``), False for ``no``
    (``incorrect``, ``wrong``), None otherwise."""
    m = _WORD.search(cut_at_stop(text).strip().lower())
    if m is None or m.start() > 2:  # a word after leading punctuation only
        return None
    word = m.group(0)
    return True if word in ("yes", "correct") else (
        False if word in ("no", "incorrect", "wrong") else None)


def parse_choice(text: str, k: int, candidates: Sequence[str] = ()) -> int | None:
    """The first integer of the reply when it is 1..k; else, when it is the text of
    exactly one of ``candidates`` (a chat model often replies with the answer it picks
    rather than its number), that candidate's number; else None."""
    m = _INT.search(cut_at_stop(text))
    if m is None:
        return None
    v = int(m.group(0))
    if 1 <= v <= k:
        return v
    same = [i for i, c in enumerate(candidates, 1) if c.strip() == m.group(0)]
    return same[0] if len(same) == 1 else None


def chat_candidate(completion: str, max_chars: int = 12) -> str:
    """What the judges are shown of a solver's reply: its final number, else its first
    line (at most ``max_chars`` characters); "" when it is empty."""
    got = extract_final_number(completion)
    if got:
        return got[:max_chars]
    lines = cut_at_stop(completion).strip().split("\n", 1)
    return lines[0].strip()[:max_chars]


__all__ = ["RETRY_MESSAGE", "agreement", "chat_candidate", "correction_messages",
           "own_verdict_messages", "parse_choice", "parse_yes_no", "retry_messages",
           "select_messages", "user", "verify_messages"]
