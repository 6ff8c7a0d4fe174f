"""reasoning-gym's procedural tasks as a dataset, scored by each task's own ``score_answer``.

`reasoning-gym <https://pypi.org/project/reasoning-gym/>`_ (the ``reasoning-gym`` extra:
``pip install 'astraflow[reasoning-gym]'``) generates problems from a seed: nothing is
downloaded. A topology names a task as a dataset path, as it names a packaged dataset
(``astraflow.tasks.datasets``)::

    reasoning_gym:NAME:SPLIT            e.g. reasoning_gym:basic_arithmetic:train
    reasoning_gym:NAME:SPLIT?KEY=VALUE&...   the task's config, e.g. ?max_terms=2&max_digits=2

``SPLIT`` is ``train`` or ``eval``. The feeder's ``size`` is the number of problems and its
``seed`` the train split's seed; the held-out ``eval`` split has a fixed seed of its own
(``EVAL_SEED``), so the evaluator (which has no seed) and every feeder see the same held-out
problems. reasoning-gym draws problem ``i`` of seed ``s`` from ``Random(s + i)``: the train
seeds ``seed .. seed+size`` never reach ``EVAL_SEED``; and since a small problem space can
still draw one question twice, the train split drops any question among the first
``HELD_OUT`` eval questions of the same config.

Each payload carries the question as ``prompt``, the reference ``answer`` and, under
``reasoning_gym``, what regenerates its entry (task, config, seed, size, index): the
``reasoning_gym`` reward (``astraflow.tasks.rewards``) scores a completion with the task's
own ``score_answer`` on that very entry, metadata included, for training and for the
evaluator alike.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from astraflow.errors import AstraflowError
from astraflow.tasks.base import prompt_id

PREFIX = "reasoning_gym"
SPLITS = ("train", "eval")
EVAL_SEED = 2**31 - 1  # the held-out split's seed, far from any train seed + index
HELD_OUT = 1000  # eval questions the train split never repeats
INSTALL = "python3 -m pip install 'astraflow[reasoning-gym]'"
# what the payload's prompt asks for: the answer alone in <answer> tags (reasoning-gym's
# own convention), which the reward extracts before the task's scorer sees it
INSTRUCTION = "Give your final answer alone inside <answer></answer> tags."


class ReasoningGymError(AstraflowError, ValueError):
    """A reasoning-gym dataset path or payload that cannot be used."""


def _module() -> Any:
    try:
        import reasoning_gym
    except ImportError:
        raise ReasoningGymError(f"reasoning-gym tasks need the reasoning-gym package: "
                                f"{INSTALL}") from None
    return reasoning_gym


def _value(text: str) -> Any:
    """A config value from a path's query: JSON when it parses (numbers, true, lists),
    else the text."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_path(path: str) -> tuple[str, str, dict[str, Any]] | None:
    """``(task, split, config)`` of ``reasoning_gym:NAME:SPLIT[?K=V&...]``; None when
    ``path`` is not a reasoning-gym path; ``ReasoningGymError`` when it is one, badly."""
    head, _, query = path.partition("?")
    prefix, _, rest = head.partition(":")
    if prefix != PREFIX:
        return None
    name, _, split = rest.partition(":")
    if not name or split not in SPLITS:
        raise ReasoningGymError(f"{path}: expected {PREFIX}:NAME:SPLIT with SPLIT one of "
                                f"{', '.join(SPLITS)} (e.g. {PREFIX}:basic_arithmetic:train)")
    config = {k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True)}
    return name, split, config


@functools.lru_cache(maxsize=64)
def _dataset(name: str, config_json: str, seed: int, size: int) -> Any:
    rg = _module()
    try:
        return rg.create_dataset(name, seed=seed, size=size, **json.loads(config_json))
    except (KeyError, TypeError, ValueError, AssertionError) as e:
        raise ReasoningGymError(f"reasoning-gym task {name!r} with config "
                                f"{config_json}: {type(e).__name__}: {e}") from None


def dataset(name: str, config: Mapping[str, Any], seed: int, size: int) -> Any:
    """reasoning-gym's dataset ``name`` (cached: entries are drawn from the seed on use)."""
    return _dataset(name, json.dumps(dict(config), sort_keys=True), int(seed), int(size))


def _payload(name: str, config: Mapping[str, Any], seed: int, size: int, index: int,
             entry: Mapping[str, Any]) -> dict[str, Any]:
    question = str(entry["question"])
    prompt = f"{question}\n{INSTRUCTION}"
    return {"prompt": prompt, "question": question, "answer": str(entry["answer"]),
            "prompt_id": prompt_id(prompt), "source": f"{PREFIX}:{name}", "level": 0,
            PREFIX: {"task": name, "config": dict(config), "seed": seed, "size": size,
                     "index": index}}


def reasoning_gym_payloads(path: str, *, size: int | None, seed: int = 0) -> list[dict[str, Any]]:
    """The payloads of the reasoning-gym dataset ``path`` (``parse_path``): ``size``
    problems (None: ``HELD_OUT``) of the split."""
    parsed = parse_path(path)
    if parsed is None:
        raise ReasoningGymError(f"{path}: not a {PREFIX}:NAME:SPLIT path")
    name, split, config = parsed
    n = int(size) if size else HELD_OUT
    if split == "eval":
        ds = dataset(name, config, EVAL_SEED, n)
        return [_payload(name, config, EVAL_SEED, n, i, ds[i]) for i in range(n)]
    held_out = _held_out(name, json.dumps(dict(config), sort_keys=True))
    ds = dataset(name, config, seed, n)
    out = []
    for i in range(n):
        entry = ds[i]
        if str(entry["question"]) not in held_out:
            out.append(_payload(name, config, seed, n, i, entry))
    return out


@functools.lru_cache(maxsize=64)
def _held_out(name: str, config_json: str) -> frozenset[str]:
    """The first ``HELD_OUT`` eval questions of a task and config."""
    held = _dataset(name, config_json, EVAL_SEED, HELD_OUT)
    return frozenset(str(held[i]["question"]) for i in range(HELD_OUT))


def entry_of(payload: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
    """``(dataset, entry)`` a payload was drawn from (its ``reasoning_gym`` key)."""
    ref = payload.get(PREFIX)
    if not isinstance(ref, Mapping):
        raise ReasoningGymError(f"the reasoning_gym reward needs a payload from a "
                                f"{PREFIX}: dataset (it has no {PREFIX!r} key)")
    ds = dataset(str(ref["task"]), dict(ref.get("config") or {}), int(ref["seed"]),
                 int(ref["size"]))
    return ds, ds[int(ref["index"])]


def extract(completion: str, tag: str | None = "answer") -> str:
    """What the task's scorer is given of ``completion``: the text inside its last
    ``<tag>...</tag>`` (reasoning-gym's own ``extract_answer``), else the whole completion
    stripped; ``tag`` None: the whole completion."""
    if tag:
        from reasoning_gym.utils import extract_answer

        found = extract_answer(completion, tag_name=tag)
        if found is not None:
            return found
    return completion.strip()


def score(completion: str, payload: Mapping[str, Any], tag: str | None = "answer") -> float:
    """The task's own ``score_answer`` of ``completion``'s answer on the payload's entry."""
    ds, entry = entry_of(payload)
    return float(ds.score_answer(extract(completion, tag), entry))


__all__ = ["EVAL_SEED", "HELD_OUT", "INSTRUCTION", "ReasoningGymError", "dataset",
           "entry_of", "extract", "parse_path", "reasoning_gym_payloads", "score"]
