"""Dataset files the benches use, generated locally: ``astraflow data generate``.

* ``addition``: two-digit additions (``What is 37+45? Answer with the number only.`` ->
  ``82``), every pair of 10..99 once, split into train and eval by a hash of the prompt.
* ``multistep``: expressions of two or three operations on one- and two-digit numbers
  (``Compute (7+5)*3-4. Answer with the number only.`` -> ``32``).

Rows are JSONL objects ``{"prompt", "answer", "level", "source"}``: any file of that
shape (GSM8K-style ``question``/``answer`` files too) feeds ``astraflow feeder run
--dataset`` and the evaluator's ``--dataset`` the same way.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from astraflow.tasks.split import check_split, hash_split

ONLY_NUMBER = "Answer with the number only."
_SALT = b"astraflow-datasets"
EVAL_FRACTION = 0.1


def addition_rows(split: str = "train", count: int = 0, seed: int = 0) -> list[dict[str, Any]]:
    """Two-digit addition rows of ``split`` in a seeded order; ``count`` 0: all of them."""
    check_split(split)
    rows = []
    for a in range(10, 100):
        for b in range(10, 100):
            prompt = f"What is {a}+{b}? {ONLY_NUMBER}"
            if hash_split(prompt, _SALT, EVAL_FRACTION) == split:
                rows.append({"prompt": prompt, "answer": str(a + b), "level": 1,
                             "source": "addition"})
    random.Random(f"addition:{seed}").shuffle(rows)
    return rows[:count] if count else rows


def _expression(rng: random.Random) -> str:
    def term() -> str:
        return str(rng.randint(1, 20))

    expr = term()
    for _ in range(rng.randint(2, 3)):
        op = rng.choice("+-*")
        if op == "*" and rng.random() < 0.5 and not expr.isdigit():
            expr = f"({expr})*{rng.randint(2, 9)}"
        else:
            expr = f"{expr}{op}{term() if op != '*' else rng.randint(2, 9)}"
    return expr


def multistep_rows(split: str = "train", count: int = 2000, seed: int = 0) -> list[dict[str, Any]]:
    """``count`` distinct multi-step arithmetic rows of ``split`` (seeded)."""
    check_split(split)
    rng = random.Random(f"multistep:{seed}")
    rows: dict[str, dict[str, Any]] = {}
    tries = 0
    while len(rows) < count and tries < count * 50:
        tries += 1
        expr = _expression(rng)
        prompt = f"Compute {expr}. {ONLY_NUMBER}"
        if prompt in rows or hash_split(prompt, _SALT, EVAL_FRACTION) != split:
            continue
        value = eval(expr, {"__builtins__": {}})  # noqa: S307 - digits, + - * and parentheses
        rows[prompt] = {"prompt": prompt, "answer": str(value), "level": expr.count("+")
                        + expr.count("-") + expr.count("*"), "source": "multistep"}
    return list(rows.values())


GENERATORS = {"addition": addition_rows, "multistep": multistep_rows}


def write_jsonl(rows: list[dict[str, Any]], out: str | Path) -> Path:
    """Write ``rows`` as JSONL (via a temporary file, renamed into place)."""
    path = Path(out)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r, ensure_ascii=False) + "\n")
    tmp.replace(path)
    return path


__all__ = ["GENERATORS", "ONLY_NUMBER", "addition_rows", "multistep_rows", "write_jsonl"]
