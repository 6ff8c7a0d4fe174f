"""Supervised examples: a task's prompt and answer (or multi-turn segments) as token ids
with a loss mask over what the model is taught to write."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def task_payload(task: Any) -> dict[str, Any]:
    """The payload dict of an ``ArithProblem``, a payload dict or JSON string, or a ``Task``."""
    from astraflow.tasks.base import payload_of

    if hasattr(task, "payload") and callable(task.payload):  # ArithProblem
        return task.payload()
    return payload_of(task)


def encode_example(tokenizer, prompt: str, answer: str) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of prompt + answer + eos; the mask covers answer + eos."""
    return encode_segments(tokenizer, prompt, [[answer, 1]])


def encode_segments(tokenizer, prompt: str,
                    segments: Sequence[Sequence[Any]]) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of prompt + segments + eos, for a multi-turn example:
    each segment ``[text, trained]`` is in the mask when ``trained``; eos always is."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    for text, trained in segments:
        seg = tokenizer(str(text), add_special_tokens=False)["input_ids"]
        ids += seg
        mask += [1 if trained else 0] * len(seg)
    return ids + [tokenizer.eos_token_id], mask + [1]


def encode_task(tokenizer, task: Any) -> tuple[list[int], list[int]]:
    """``(input_ids, loss_mask)`` of one task: its ``segments`` when it has them, else its
    prompt and answer."""
    p = task_payload(task)
    if "segments" in p:
        return encode_segments(tokenizer, str(p["prompt"]), p["segments"])
    return encode_example(tokenizer, str(p["prompt"]), str(p["answer"]))


__all__ = ["encode_example", "encode_segments", "encode_task", "task_payload"]
