"""Per-group reward normalisation after rollout.

Each group's rewards become ``r - mean(group)``, divided by ``std(group) + eps`` with
``divide_std`` (population std, ddof=0). With ``per_policy`` (the default) the statistics
are taken over each policy's sequences of the group separately, which is the grouping the
trainer sees after the router splits groups into ``samples.<policy>``. The normalised
values are written into every ``Sequence.reward`` and into ``TrajectoryGroup.rewards``;
nothing is lost: the raw rewards stay in ``group.meta["raw_rewards"]`` (a JSON list in
sequence order) and in each ``Sequence.meta["raw_reward"]``. When a group already carries
raw rewards (normalised upstream), they are kept, not overwritten.

Interaction with the trainer (``astraflow.trainer.loss.group_advantages``): the trainer
computes GRPO advantages from ``Sequence.reward`` as ``(r - mean) / (std + eps)`` (or
mean-centred only with ``--no-std-normalize``), population std, eps 1e-6, over the group of
one policy. Normalising here first is harmless: mean-centring is idempotent (the mean of
centred rewards is 0), and dividing by the std again is idempotent up to eps (the std of
standardised rewards is ``std / (std + eps)``, i.e. 1 to within eps/std). So the
advantages the trainer uses are unchanged, to that precision; this processor is for
consumers that read rewards directly (replay buffers, reward-weighted selection, metrics)
and for trainers that do not normalise. A group with all-equal rewards becomes all zeros.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from astraflow.config.processors import RewardNormOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.wire.records import TrajectoryGroup

RAW_REWARDS = "raw_rewards"
RAW_REWARD = "raw_reward"


def normalise(rewards: Sequence[float], divide_std: bool = True, eps: float = 1e-6) -> list[float]:
    """``r - mean``, divided by ``std + eps`` (population std) with ``divide_std``."""
    if not rewards:
        return []
    m = sum(rewards) / len(rewards)
    centred = [r - m for r in rewards]
    if not divide_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + eps) for c in centred]


def normalise_group(group: TrajectoryGroup, divide_std: bool = True, eps: float = 1e-6,
                    per_policy: bool = True) -> TrajectoryGroup:
    """A copy of ``group`` with normalised rewards and the raw ones kept in ``meta``.

    Never modifies ``group`` (the runtime forwards an unchanged record as its original
    bytes, so a processor must not edit records in place).
    """
    if not group.sequences:
        raw = list(group.rewards)
        meta = {**group.meta}
        meta.setdefault(RAW_REWARDS, json.dumps(raw))
        return replace(group, rewards=normalise(raw, divide_std, eps), meta=meta)
    raw = [s.reward for s in group.sequences]
    new = [0.0] * len(raw)
    parts = ([[i for i, s in enumerate(group.sequences) if s.policy == p]
              for p in dict.fromkeys(s.policy for s in group.sequences)]
             if per_policy else [list(range(len(raw)))])
    for idx in parts:
        for i, v in zip(idx, normalise([raw[i] for i in idx], divide_std, eps)):
            new[i] = v
    seqs = []
    for s, r, v in zip(group.sequences, raw, new):
        smeta = {**s.meta}
        smeta.setdefault(RAW_REWARD, repr(r))
        seqs.append(replace(s, reward=v, meta=smeta))
    meta = {**group.meta}
    meta.setdefault(RAW_REWARDS, json.dumps(raw))
    return replace(group, sequences=seqs, rewards=new, meta=meta)


def raw_rewards(group: TrajectoryGroup) -> list[float]:
    """The rewards before any normalisation (the current ones if none was applied)."""
    if RAW_REWARDS in group.meta:
        return [float(x) for x in json.loads(group.meta[RAW_REWARDS])]
    return [s.reward for s in group.sequences] if group.sequences else list(group.rewards)


class RewardNorm(Processor):
    """Normalises rewards per group (mean-centred, optionally std-scaled); keeps raw ones."""

    kind = "reward_norm"
    Options = RewardNormOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        self.normalised = 0
        self.zero_variance = 0

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        o = self.options
        out = normalise_group(msg.record, o.divide_std, o.eps, o.per_policy)
        self.normalised += 1
        if all(r == 0.0 for r in out.rewards):
            self.zero_variance += 1
        return [Outgoing(t, out, key=msg.key) for t in self.outputs]

    def metrics(self) -> dict[str, float]:
        return {"reward_norm/normalised": float(self.normalised),
                "reward_norm/zero_variance": float(self.zero_variance)}
