"""The one-line prompt formats of the multi-policy roles and their parsers (the package
doc has the table)."""

from __future__ import annotations

import re

ROLES = ("verifier", "selector")  # roles with their own format (the solver's is the default)
APPROVE, REJECT = "y", "n"
PICK_SEP = ":"
OWN_END = "|"  # ends the blind verifier's own answer (its first turn)
_NUMBER_PREFIX = re.compile(r"^\s*-?[\d.,]*\s*")


def verify_prompt(prompt: str, answer: str) -> str:
    """``"37+45="``, ``"82"`` -> ``"37+45=82?"``."""
    return f"{prompt}{answer}?"


def blind_verdict_context(prompt: str, own: str, candidate: str) -> str:
    """``"37+45="``, ``"82"``, ``"73"`` -> ``"37+45=82|73?"``: what a blind verifier has
    seen when it gives its verdict (its own answer, ``OWN_END``, then the candidate)."""
    return f"{prompt}{own}{OWN_END}{candidate}?"


def own_answer(text: str) -> str | None:
    """The blind verifier's own answer in its first turn's text (``"82|"`` -> ``"82"``),
    None when the turn did not end it with ``OWN_END``."""
    return text.split(OWN_END, 1)[0].strip() if OWN_END in text else None


def retry_prompt(prompt: str, answer: str, verdict: str = REJECT) -> str:
    """``"37+45="``, ``"82"`` -> ``"37+45=82?n 37+45="``: the rejected try, then the problem."""
    return f"{verify_prompt(prompt, answer)}{verdict} {prompt}"


def select_prompt(prompt: str, first: str, second: str) -> str:
    """``"37+45="``, ``"82"``, ``"83"`` -> ``"37+45=82|83>"``."""
    return f"{prompt}{first}|{second}>"


def _first_char(text: str) -> str:
    from astraflow.tasks.check import cut_at_stop

    stripped = cut_at_stop(text).strip()
    return stripped[:1].lower()


def parse_verdict(text: str) -> bool | None:
    """True for an approval (``y``, ``82y``), False for a rejection (``n``, ``73n``), None
    otherwise. A leading number (the verifier's own answer) is skipped."""
    c = _first_char(_NUMBER_PREFIX.sub("", _first_line(text)))
    return True if c == APPROVE else False if c == REJECT else None


def parse_pick(text: str) -> int | None:
    """1 or 2 (the answer the selector picked: ``1``, ``82:1``), None when unparseable."""
    c = _first_char(_first_line(text).rsplit(PICK_SEP, 1)[-1])
    return int(c) if c in ("1", "2") else None


def _first_line(text: str) -> str:
    from astraflow.tasks.check import cut_at_stop

    return cut_at_stop(text).strip().split("\n", 1)[0]


def candidate_answer(completion: str, max_chars: int = 12) -> str:
    """What the other roles are shown of a solver completion: its final number (at most
    ``max_chars`` characters), or "" when it has none."""
    from astraflow.tasks.check import extract_final_number

    got = extract_final_number(completion)
    return (got or "")[:max_chars]


__all__ = [
    "APPROVE",
    "OWN_END",
    "PICK_SEP",
    "REJECT",
    "ROLES",
    "blind_verdict_context",
    "candidate_answer",
    "own_answer",
    "parse_pick",
    "parse_verdict",
    "retry_prompt",
    "select_prompt",
    "verify_prompt",
]
