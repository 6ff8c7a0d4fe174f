"""verifiers environments: loading one, and its dataset as task payloads.

A `verifiers <https://pypi.org/project/verifiers/>`_ environment (the ``verifiers`` extra:
``pip install 'astraflow[verifiers]'``; its classic ``vf.Environment`` API: ``SingleTurnEnv``,
``MultiTurnEnv``, ``ToolEnv``, ``Rubric``) is named by

- an installed environment's id (``vf.load_environment(id, **args)``: the module of that
  name, as ``prime env install`` or ``pip install`` put it), or
- ``package.module:function`` (``function(**args)`` returns the environment), for one
  written in the project itself.

Its dataset and eval dataset feed the feeder and the evaluator as a dataset path
(``astraflow.tasks.datasets``)::

    verifiers:ENV:SPLIT[?KEY=VALUE&...]    SPLIT: train (its dataset) or eval (its eval set)

``KEY=VALUE`` are the environment's arguments (JSON values where they parse). Each payload
names its row (``verifiers: {env, args, split, index}``) beside a ``prompt`` and ``answer``
for the logs; the ``verifiers`` workflow (``astraflow.raas.workflows.verifiers_env``) runs
the row of the environment *it* was configured with, the payload only picking the row.
"""

from __future__ import annotations

import functools
import importlib
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import parse_qsl

from astraflow.errors import AstraflowError
from astraflow.tasks.base import prompt_id

PREFIX = "verifiers"
SPLITS = ("train", "eval")
INSTALL = "python3 -m pip install 'astraflow[verifiers]'"


class VerifiersError(AstraflowError, ValueError):
    """An environment that cannot be loaded, or a dataset path or row that cannot be used."""


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def parse_path(path: str) -> tuple[str, str, dict[str, Any]] | None:
    """``(env, split, args)`` of ``verifiers:ENV:SPLIT[?K=V&...]`` (ENV may hold a colon:
    ``pkg.mod:load_environment``); None when ``path`` is not a verifiers path."""
    head, _, query = path.partition("?")
    prefix, _, rest = head.partition(":")
    if prefix != PREFIX:
        return None
    env, _, split = rest.rpartition(":")
    if not env or split not in SPLITS:
        raise VerifiersError(f"{path}: expected {PREFIX}:ENV:SPLIT with SPLIT one of "
                             f"{', '.join(SPLITS)} (ENV an environment id or "
                             "package.module:function)")
    return env, split, {k: _value(v) for k, v in parse_qsl(query, keep_blank_values=True)}


@functools.lru_cache(maxsize=16)
def _load(env: str, args_json: str) -> Any:
    try:
        import verifiers as vf
    except ImportError:
        raise VerifiersError(f"verifiers environments need the verifiers package: "
                             f"{INSTALL}") from None
    args = json.loads(args_json)
    module, sep, name = env.partition(":")
    try:
        if sep:
            made = getattr(importlib.import_module(module), name)(**args)
        else:
            made = vf.load_environment(env, **args)
    except (ImportError, AttributeError) as e:
        raise VerifiersError(f"verifiers environment {env!r}: {type(e).__name__}: {e}") from None
    if not isinstance(made, vf.Environment):
        raise VerifiersError(f"verifiers environment {env!r} made a {type(made).__name__}, "
                             "not a verifiers Environment")
    return made


def load_environment(env: str, args: Mapping[str, Any] | None = None) -> Any:
    """The environment ``env`` made with ``args`` (one instance per process and arguments:
    the feeder, the node and the evaluator each load it once)."""
    if not isinstance(env, str) or not env:
        raise VerifiersError("verifiers environment: give an environment id or "
                             "'package.module:function'")
    return _load(env, json.dumps(dict(args or {}), sort_keys=True))


def rows(environment: Any, split: str) -> Any:
    """The environment's dataset (``train``) or eval dataset (``eval``), as verifiers
    formats it (``prompt`` as chat messages, ``answer``, ``info``, ``example_id``)."""
    try:
        data = environment.get_dataset() if split == "train" else environment.get_eval_dataset()
    except ValueError as e:  # the environment has no such split
        raise VerifiersError(f"verifiers environment: no {split} dataset: {e}") from None
    if data is None:
        raise VerifiersError(f"verifiers environment: no {split} dataset")
    return data


def row_input(environment: Any, ref: Mapping[str, Any]) -> dict[str, Any]:
    """The rollout input of the row a payload's ``verifiers`` key names."""
    data = rows(environment, str(ref.get("split", "train")))
    index = ref.get("index")
    if not isinstance(index, int) or not 0 <= index < len(data):
        raise VerifiersError(f"verifiers row {index!r}: the {ref.get('split')} dataset has "
                             f"{len(data)} rows")
    return dict(data[index])


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # content parts
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
    return str(content)


def payload_of(env: str, args: Mapping[str, Any], split: str, index: int,
               row: Mapping[str, Any]) -> dict[str, Any]:
    """A task payload naming row ``index`` of ``split`` (module docstring)."""
    prompt = row.get("prompt")
    if isinstance(prompt, list):
        users = [_text(m.get("content")) for m in prompt
                 if isinstance(m, Mapping) and m.get("role") == "user"]
        text = users[-1] if users else json.dumps(prompt, default=str)
    else:
        text = str(prompt if prompt is not None else row.get("question", ""))
    key = json.dumps(prompt, sort_keys=True, default=str)
    return {"prompt": text, "answer": str(row.get("answer", "")), "prompt_id": prompt_id(key),
            "source": f"{PREFIX}:{env}", "level": 0,
            PREFIX: {"env": env, "args": dict(args), "split": split, "index": index}}


def verifiers_payloads(path: str, *, limit: int | None = None) -> list[dict[str, Any]]:
    """The payloads of ``verifiers:ENV:SPLIT`` (``parse_path``): its first ``limit`` rows
    (None: all)."""
    parsed = parse_path(path)
    if parsed is None:
        raise VerifiersError(f"{path}: not a {PREFIX}:ENV:SPLIT path")
    env, split, args = parsed
    data = rows(load_environment(env, args), split)
    n = len(data) if limit is None else min(limit, len(data))
    return [payload_of(env, args, split, i, data[i]) for i in range(n)]


def rubric_score(environment: Any, row: Mapping[str, Any], completion: str) -> float:
    """The environment's rubric of one assistant answer ``completion`` to ``row`` (its
    ``score_group`` on a one-rollout group): what the evaluator's single answer to a held-out
    row earns. A multi-turn or tool environment's rubric then sees a one-turn conversation."""
    import asyncio

    from verifiers.types import RolloutTiming, State
    from verifiers.utils.message_utils import normalize_messages

    state = State(input=dict(row))
    state["prompt"] = normalize_messages(row["prompt"], field_name="input.prompt")
    state["completion"] = normalize_messages([{"role": "assistant", "content": completion}],
                                             field_name="completion")
    state.update(trajectory=[], reward=None, metrics=None, error=None, timing=RolloutTiming())
    asyncio.run(environment.rubric.score_group([state]))
    return float(state["reward"])


def rubric_reward(environment: str, args: Mapping[str, Any] | None = None) -> Any:
    """The ``verifiers`` reward (``astraflow.tasks.rewards``): ``rubric_score`` of a
    completion on the row its payload names, of the environment these options name."""
    env = load_environment(environment, args)
    want = dict(args or {})

    def reward(completion: str, payload: Mapping[str, Any]) -> float:
        ref = payload.get(PREFIX)
        if not isinstance(ref, Mapping) or ref.get("env") != environment or \
                dict(ref.get("args") or {}) != want:
            raise VerifiersError(f"the verifiers reward of {environment!r} {want} scores rows "
                                 f"of that environment (the payload names "
                                 f"{ref.get('env') if isinstance(ref, Mapping) else None!r})")
        return rubric_score(env, row_input(env, ref), completion)

    return reward


__all__ = ["VerifiersError", "load_environment", "parse_path", "payload_of", "row_input",
           "rows", "rubric_reward", "rubric_score", "verifiers_payloads"]
