"""Building a workflow's trajectories, and running a batch of tasks whose failures stay
their own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from astraflow.raas.engine import Generation
from astraflow.wire.records import Sequence, Task


class SequenceBuilder:
    """Accumulates one trajectory: prompt, generated pieces and non-trained pieces."""

    def __init__(self, policy: str, prompt_ids: list[int], sample_index: int):
        self.policy = policy
        self.sample_index = sample_index
        self.token_ids = list(prompt_ids)
        self.loss_mask = [0] * len(prompt_ids)
        self.logprobs = [0.0] * len(prompt_ids)
        self.versions = [-1] * len(prompt_ids)
        self.finish_reason = "length"
        self.meta: dict[str, str] = {}

    def add_generated(self, g: Generation) -> None:
        self.token_ids += g.token_ids
        self.loss_mask += [1] * len(g.token_ids)
        self.logprobs += list(g.logprobs)
        self.versions += list(g.versions)
        self.finish_reason = g.finish_reason

    def add_external(self, token_ids: list[int]) -> None:
        self.token_ids += token_ids
        self.loss_mask += [0] * len(token_ids)
        self.logprobs += [0.0] * len(token_ids)
        self.versions += [-1] * len(token_ids)

    def build(self, reward: float) -> Sequence:
        return Sequence(
            policy=self.policy,
            token_ids=self.token_ids,
            loss_mask=self.loss_mask,
            logprobs=self.logprobs,
            versions=self.versions,
            reward=float(reward),
            sample_index=self.sample_index,
            finish_reason=self.finish_reason,
            meta=self.meta,
        )


def role_sequence(
    policy: str,
    role: str,
    prompt_ids: list[int],
    gen: Generation,
    index: int,
    reward: float,
    **meta: str,
) -> Sequence:
    """The trajectory of one generation ``gen`` after ``prompt_ids``, for ``role`` of a
    multi-policy workflow, with ``meta``."""
    b = SequenceBuilder(policy, prompt_ids, index)
    b.add_generated(gen)
    b.meta.update(meta)
    s = b.build(reward)
    s.role = role
    return s


def prepare_each(
    tasks: list[Task], prepare: Callable[[Task], Any]
) -> tuple[list[list[Sequence] | Exception], list[tuple[int, Any]]]:
    """``prepare`` every task of a batch: the batch's results, holding the exception of
    each task that raised one (the others start empty), and ``(index, prepared)`` of the
    tasks that are ready to roll out."""
    results: list[list[Sequence] | Exception] = [[] for _ in tasks]
    ready = []
    for i, task in enumerate(tasks):
        try:
            ready.append((i, prepare(task)))
        except Exception as e:  # noqa: BLE001 - this task fails, the others go on
            results[i] = e
    return results, ready


def unbatched(results: list[list[Sequence] | Exception]) -> list[Sequence]:
    """The one result of a one-task ``run_batch``: its sequences, or its exception raised."""
    (out,) = results
    if isinstance(out, Exception):
        raise out
    return out


__all__ = ["SequenceBuilder", "prepare_each", "role_sequence", "unbatched"]
