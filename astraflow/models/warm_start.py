"""The warm start: a short supervised fine-tune on the task format (prompt, answer, end of
sequence; loss on the answer and the end-of-sequence token only). It is the allowed head
start before RL: the model learns the format and gets part of the answers right, so
group-relative RL has reward variance to learn from."""

from __future__ import annotations

import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from astraflow.models.examples import encode_task
from astraflow.models.tiny import seeded

Example = tuple[list[int], list[int]]


class _Schedule:
    """The learning rate of each step and when to stop (``warm_start``'s doc)."""

    def __init__(self, lr: float, steps: int, until: Callable[[], bool] | None):
        self.lr = lr
        self.steps = steps
        self.until = until
        self.warm = max(1, steps // 20)
        self.anneal = max(1, steps // 10)
        self.anneal_from: int | None = None if until is not None else 0
        self.criterion_met = False

    def lr_at(self, step: int) -> float:
        lr = self.lr
        if step < self.warm:
            return lr * (step + 1) / self.warm
        if self.until is None:
            frac = (step - self.warm) / max(1, self.steps - self.warm)
            return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        if self.anneal_from is None:
            return lr
        return lr * (1.0 - 0.9 * min(1.0, (step - self.anneal_from) / self.anneal))

    def done(self, step: int, model: Any, check_every: int,
             log: Callable[[str], None] | None) -> bool:
        """Whether to stop before ``step``; runs the check (in eval mode) when it is due."""
        if self.until is None:
            return False
        if self.anneal_from is None and step >= self.warm and step % check_every == 0:
            model.eval()
            self.criterion_met = bool(self.until())
            model.train()
            if self.criterion_met:
                self.anneal_from = step
                if log:
                    log(f"warm start step {step}: check passed, decaying for {self.anneal}")
        if self.anneal_from is None and step >= self.steps - self.anneal:
            self.anneal_from = step
        return self.anneal_from is not None and step >= self.anneal_from + self.anneal


class _Batches:
    """Batches drawn without repeats within an epoch, reshuffled each epoch by ``seed``."""

    def __init__(self, examples: list[Example], batch_size: int, seed: int):
        self.examples = examples
        self.size = min(batch_size, len(examples))
        self.rng = random.Random(seed)
        self.order: list[int] = []

    def next(self) -> list[Example]:
        batch = []
        for _ in range(self.size):
            if not self.order:
                self.order = list(range(len(self.examples)))
                self.rng.shuffle(self.order)
            batch.append(self.examples[self.order.pop()])
        return batch


def _padded(batch: list[Example], pad: int):
    """``(input_ids, attention_mask, labels)`` of ``batch``, right-padded for training."""
    import torch

    width = max(len(ids) for ids, _ in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    labels = torch.full((len(batch), width), -100, dtype=torch.long)
    attn = torch.zeros((len(batch), width), dtype=torch.long)
    for i, (x, m) in enumerate(batch):
        n = len(x)
        ids[i, :n] = torch.tensor(x)
        attn[i, :n] = 1
        labels[i, :n] = torch.tensor([t if k else -100 for t, k in zip(x, m)])
    return ids, attn, labels


def _step(model: Any, opt: Any, batch: list[Example], pad: int, lr: float) -> float:
    """One AdamW step on ``batch`` at learning rate ``lr``; its loss."""
    import torch

    device = next(model.parameters()).device
    ids, attn, labels = _padded(batch, pad)
    for g in opt.param_groups:
        g["lr"] = lr
    out = model(input_ids=ids.to(device), attention_mask=attn.to(device),
                labels=labels.to(device))
    opt.zero_grad(set_to_none=True)
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return float(out.loss.detach())


def warm_start(
    model,
    tokenizer,
    tasks: Sequence[Any],
    steps: int = 300,
    lr: float = 1e-3,
    batch_size: int = 64,
    seed: int = 0,
    *,
    log: Callable[[str], None] | None = None,
    log_every: int = 50,
    until: Callable[[], bool] | None = None,
    check_every: int = 100,
) -> dict[str, float]:
    """Supervised fine-tune on ``tasks`` (prompt -> answer + eos) for ``steps`` steps.

    ``tasks``: ``ArithProblem``s, payload dicts, payload JSON strings or ``Task`` records.
    AdamW, loss on answer and eos tokens only. The learning rate warms up linearly, then

    * without ``until``: decays along a cosine to 10 % over all ``steps``;
    * with ``until`` (a check on the model, called every ``check_every`` steps in eval
      mode): stays constant until the check passes, then decays linearly to 10 % over the
      last 10 % of ``steps`` and stops. A tiny model learns arithmetic along a curve whose
      steep part comes after a number of steps that varies from seed to seed; stopping on
      a check of what was learned makes the warm start reproducible in outcome. If the
      check never passes, the decay starts when only 10 % of ``steps`` are left.

    Returns ``{"loss_first", "loss_last", "loss_min", "steps", "seconds", "examples",
    "criterion_met"}`` where the first/last losses average the first/last 10 % of steps
    (at least one step) and ``steps`` is the number actually taken.
    """
    import torch

    if not tasks:
        raise ValueError("warm_start needs at least one task")
    examples = [encode_task(tokenizer, t) for t in tasks]
    batches = _Batches(examples, batch_size, seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    schedule = _Schedule(lr, steps, until)
    model.train()
    losses: list[float] = []
    t0 = time.time()
    with seeded(seed):
        for step in range(steps):
            if schedule.done(step, model, check_every, log):
                break
            losses.append(_step(model, opt, batches.next(), tokenizer.pad_token_id,
                                schedule.lr_at(step)))
            if log and (step + 1) % log_every == 0:
                log(f"warm start step {step + 1}/{steps} loss {losses[-1]:.4f}")
    model.eval()
    return _summary(losses, time.time() - t0, len(examples), schedule.criterion_met)


def _summary(losses: list[float], seconds: float, examples: int,
             criterion_met: bool) -> dict[str, float]:
    """``warm_start``'s result: the first/last losses average the first/last 10 % of steps."""
    k = max(1, len(losses) // 10)
    return {
        "loss_first": sum(losses[:k]) / k,
        "loss_last": sum(losses[-k:]) / k,
        "loss_min": min(losses),
        "steps": float(len(losses)),
        "seconds": seconds,
        "examples": float(examples),
        "criterion_met": float(criterion_met),
    }

__all__ = ["warm_start"]
