"""The seeded, hash-split problem draw shared by the synthetic task families.

A family's train/eval split is a function of a problem's text only (SHA-256 with a salt
of its own), so held-out prompts never appear in train whatever the seed, level mix or
number of samples. ``draw_split`` draws problems until it has ``n`` of the wanted split.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable
from typing import TypeVar

P = TypeVar("P")

SPLITS = ("train", "eval")


def hash_split(text: str, salt: bytes, eval_fraction: float) -> str:
    """``"eval"`` for about ``eval_fraction`` of all texts, else ``"train"`` (deterministic)."""
    h = int.from_bytes(hashlib.sha256(salt + text.encode("utf-8")).digest()[:8], "big")
    return "eval" if h / 2**64 < eval_fraction else "train"


def check_split(split: str) -> None:
    if split not in SPLITS:
        raise ValueError(f"split must be 'train' or 'eval', not {split!r}")


def parse_levels(levels: int | Iterable[int] | str, known: Iterable[int], family: str) -> list[int]:
    """``levels`` (an int, ints, or ``"1,2"``) as a list; each must be in ``known``."""
    if isinstance(levels, int):
        out = [levels]
    elif isinstance(levels, str):
        out = [int(x) for x in levels.replace(" ", "").split(",") if x]
    else:
        out = [int(x) for x in levels]
    known = list(known)
    for lv in out:
        if lv not in known:
            raise ValueError(f"unknown {family} level {lv} (known: {known})")
    if not out:
        raise ValueError(f"no {family} level given")
    return out


def draw_split(
    draw: Callable[[], P],
    key: Callable[[P], str],
    split_of: Callable[[str], str],
    split: str,
    n: int,
    *,
    unique: bool,
    max_misses: int,
) -> list[P]:
    """Up to ``n`` problems from ``draw()`` whose ``split_of(key(p))`` is ``split``.

    With ``unique`` no key repeats. The split counts as exhausted (the result is shorter
    than ``n``) after ``max_misses`` consecutive draws that could not be kept.
    """
    seen: set[str] = set()
    out: list[P] = []
    misses = 0
    while len(out) < n and misses < max_misses:
        p = draw()
        k = key(p)
        if split_of(k) != split or (unique and k in seen):
            misses += 1
            continue
        seen.add(k)
        out.append(p)
        misses = 0
    return out
