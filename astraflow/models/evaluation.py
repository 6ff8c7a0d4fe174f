"""Evaluation: greedy, batched (left padding) completions and their mean reward."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from astraflow.models.examples import task_payload


def eos_ids(tokenizer, model=None) -> list[int]:
    """Every end-of-sequence token id of ``tokenizer`` and ``model``'s generation config."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if model is not None:
        e = model.generation_config.eos_token_id
        if isinstance(e, int):
            ids.add(e)
        elif e:
            ids.update(int(x) for x in e)
    return sorted(ids)


def generate_answers(
    model, tokenizer, prompts: Sequence[str], max_new_tokens: int = 8, batch_size: int = 64,
    stop_ids: Sequence[int] = (),
) -> list[str]:
    """Greedy completions of ``prompts`` (batched, left padding), decoded without specials;
    a completion ends at eos or at one of ``stop_ids`` (kept)."""
    import torch

    device = next(model.parameters()).device
    eos = sorted(set(eos_ids(tokenizer, model)) | {int(t) for t in stop_ids})
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    out: list[str] = []
    try:
        for i in range(0, len(prompts), batch_size):
            chunk = list(prompts[i : i + batch_size])
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
            with torch.no_grad():
                gen = model.generate(
                    input_ids=enc["input_ids"].to(device),
                    attention_mask=enc["attention_mask"].to(device),
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    eos_token_id=eos,
                    pad_token_id=tokenizer.pad_token_id,
                )
            new = gen[:, enc["input_ids"].shape[1] :]
            out.extend(tokenizer.batch_decode(new, skip_special_tokens=True))
    finally:
        tokenizer.padding_side = old_side
    return out


def evaluate(
    model,
    tokenizer,
    tasks: Sequence[Any],
    max_new_tokens: int = 8,
    batch_size: int = 64,
    *,
    per_level: dict[int, float] | None = None,
    chat: Any = None,
    reward: Any = None,
) -> float:
    """Greedy accuracy on ``tasks`` (mean reward, a fraction in [0, 1] for 0/1 rewards).

    ``chat``: the policy's ``astraflow.models.chat.ChatFormat`` (default: the chat template when
    the tokenizer has one, else the plain prompt). ``reward``: a reward function
    ``(completion, payload)`` from ``astraflow.tasks.rewards`` (default: the final number
    against the answer). Pass a dict as ``per_level`` to get each payload ``level``'s
    accuracy filled in.
    """
    from astraflow.models.chat import ChatFormat
    from astraflow.tasks.rewards import make_reward

    if not tasks:
        raise ValueError("evaluate needs at least one task")
    chat = chat or ChatFormat()
    reward = reward or make_reward("numeric")
    payloads = [task_payload(t) for t in tasks]
    completions = generate_answers(
        model, tokenizer, [chat.prompt_text(tokenizer, p) for p in payloads], max_new_tokens,
        batch_size
    )
    scores = [reward(c, p) for c, p in zip(completions, payloads)]
    if per_level is not None:
        by: dict[int, list[float]] = {}
        for p, s in zip(payloads, scores):
            by.setdefault(int(p.get("level", 0)), []).append(s)
        per_level.update({lv: sum(v) / len(v) for lv, v in sorted(by.items())})
    return sum(scores) / len(scores)


__all__ = ["eos_ids", "evaluate", "generate_answers"]
