"""What a workflow reads: the task's payload, the engine of a policy, the prompt's token
ids and the sampling parameters."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from astraflow.config.options import SamplingOptions
from astraflow.models.chat import PromptError, engine_chat
from astraflow.raas.engine import Engine, SamplingParams
from astraflow.raas.workflows.base import TaskError
from astraflow.wire.records import Task


def parse_payload(task: Task, required: tuple[str, ...] = ()) -> dict[str, Any]:
    """The task's JSON payload object, with each of ``required`` a string or number."""
    try:
        payload = json.loads(task.payload)
    except (TypeError, ValueError) as e:
        raise TaskError(f"payload is not JSON: {e}") from None
    if not isinstance(payload, dict):
        raise TaskError("payload must be a JSON object")
    for key in required:
        if key not in payload:
            raise TaskError(f"payload has no {key!r}")
        if not isinstance(payload[key], str | int | float) or isinstance(payload[key], bool):
            raise TaskError(f"payload[{key!r}] must be a string or number")
    return payload


def pick_engine(task: Task, engines: Mapping[str, Engine], index: int = 0) -> Engine:
    """The engine of ``task.policies[index]``, or the only engine when none are named."""
    if task.policies:
        if index >= len(task.policies):
            raise TaskError(f"task names {len(task.policies)} policies, workflow needs {index + 1}")
        name = task.policies[index]
        if name not in engines:
            raise TaskError(f"no engine for policy {name!r} on this node (have {sorted(engines)})")
        return engines[name]
    if len(engines) == 1:
        return next(iter(engines.values()))
    raise TaskError(f"task names no policy and this node has {len(engines)} engines")


def sampling_params(options: SamplingOptions, engine: Engine, n: int,
                    **extra: Any) -> SamplingParams:
    """``SamplingParams`` from a workflow's sampling options for ``n`` samples (no
    ``stop_token_ids``: the engine's end of sequence); ``extra`` over them."""
    stop_ids = tuple(options.stop_token_ids or ())
    if not stop_ids and engine.eos_token_id is not None:
        stop_ids = (engine.eos_token_id,)
    fields: dict[str, Any] = {"max_new_tokens": options.max_new_tokens,
                              "temperature": options.temperature, "top_p": options.top_p,
                              "n": n, "stop_token_ids": stop_ids, "seed": options.seed}
    return SamplingParams(**{**fields, **extra})


def prompt_task(
    task: Task, engines: Mapping[str, Engine]
) -> tuple[dict[str, Any], Engine, list[int]]:
    """``(payload, engine, prompt token ids)`` of a prompt/answer task, the prompt built by
    the engine's chat format (``astraflow.models.chat``); ``TaskError`` if unusable."""
    payload = parse_payload(task, ("answer",))
    engine = pick_engine(task, engines)
    try:
        prompt_ids = engine_chat(engine).prompt_ids(engine_tokenizer(engine), payload)
    except PromptError as e:
        raise TaskError(str(e)) from None
    return payload, engine, prompt_ids


def speaks_chat(prompt_format: str, engine: Engine) -> bool:
    """Whether a multi-policy workflow with ``prompt_format`` uses its chat prompts with
    ``engine``: ``chat``; ``compact`` never; ``auto`` when the engine's chat format uses a
    template (a pretrained chat model; the tiny model has none)."""
    if prompt_format != "auto":
        return prompt_format == "chat"
    try:
        return engine_chat(engine).uses_template(engine_tokenizer(engine))
    except PromptError:
        return False


def chat_ids(engine: Engine, payload: Mapping[str, Any]) -> list[int]:
    """``payload`` (a ``prompt`` or chat ``messages``) as ``engine``'s prompt token ids,
    through its chat format; ``TaskError`` when unusable."""
    try:
        return engine_chat(engine).prompt_ids(engine_tokenizer(engine), payload)
    except PromptError as e:
        raise TaskError(str(e)) from None


def engine_tokenizer(engine: Engine) -> Any:
    """The engine's tokenizer, or an adapter over its ``encode`` for engines without one."""
    tok = getattr(engine, "tokenizer", None)
    return tok if tok is not None else _EncodeOnly(engine)


class _EncodeOnly:
    chat_template = None

    def __init__(self, engine: Engine):
        self.engine = engine

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self.engine.encode(text)


def policy_engine(engines: Mapping[str, Engine], policy: str, role: str) -> Engine:
    """The engine of ``policy``, which plays ``role``; ``TaskError`` if this node has none."""
    if policy not in engines:
        raise TaskError(f"no engine for the {role} policy {policy!r} on this node "
                        f"(have {sorted(engines)})")
    return engines[policy]


def encode_prompt(engine: Engine, text: str) -> list[int]:
    """``text`` as ``engine``'s token ids; ``TaskError`` when it encodes to none."""
    ids = engine.encode(text)
    if not ids:
        raise TaskError(f"prompt {text!r} encodes to no tokens")
    return ids


__all__ = ["chat_ids", "encode_prompt",
           "engine_tokenizer", "speaks_chat", "parse_payload", "pick_engine",
           "policy_engine", "prompt_task", "sampling_params"]
