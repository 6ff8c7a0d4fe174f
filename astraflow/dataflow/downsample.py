"""Max-variance down-sampling: roll out many samples per prompt, train on the few that teach.

Rollouts are cheap next to training steps (inference only, one shared prefill per
prompt), and a rare good answer is found more often among 32 samples of a prompt than
among 8. This processor keeps ``keep`` of a group's samples: the subset whose rewards
vary the most (the ``k`` highest and ``keep - k`` lowest for the best ``k``, as in
max-variance down-sampling of rollouts), so a single right answer among 31 wrong ones
reaches the trainer with the wrong ones it beats, at the trainer cost of ``keep``
samples. Groups of at most ``keep`` samples pass unchanged; the group advantages are
computed by the trainer over the kept samples. In a multi-policy group each policy's
samples are cut apart.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from statistics import pvariance

from astraflow.config.processors import DownsampleOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.dataflow.groups import with_sequences
from astraflow.wire.records import TrajectoryGroup


def max_variance_indices(rewards: Sequence[float], keep: int) -> list[int]:
    """Indices (ascending) of ``keep`` rewards with the largest variance: the ``k`` highest
    and ``keep - k`` lowest for the best ``k`` (ties: the most balanced split). All indices
    when there are at most ``keep``."""
    n = len(rewards)
    if n <= keep:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (rewards[i], i))
    candidates = []
    for k in range(keep + 1):
        chosen = order[:keep - k] + order[n - k:]
        candidates.append((pvariance([rewards[i] for i in chosen]), -abs(2 * k - keep),
                           chosen))
    _, _, chosen = max(candidates, key=lambda c: (c[0], c[1]))
    return sorted(chosen)


def downsampled(group: TrajectoryGroup, keep: int) -> TrajectoryGroup | None:
    """``group`` with at most ``keep`` sequences of each policy, chosen per policy by
    ``max_variance_indices`` (``group`` itself when nothing is cut)."""
    by_policy: dict[str, list[int]] = {}
    for i, s in enumerate(group.sequences):
        by_policy.setdefault(s.policy, []).append(i)
    kept: list[int] = []
    for idx in by_policy.values():
        chosen = max_variance_indices([group.sequences[i].reward for i in idx], keep)
        kept += [idx[j] for j in chosen]
    return with_sequences(group, [group.sequences[i] for i in sorted(kept)])


class Downsample(Processor):
    """Keeps the ``keep`` samples of each group whose rewards vary the most."""

    kind = "downsample"
    Options = DownsampleOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        self.groups = 0
        self.cut_groups = 0
        self.dropped_sequences = 0

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        group: TrajectoryGroup = msg.record
        out = downsampled(group, self.options.keep)
        self.groups += 1
        if out is not group:
            self.cut_groups += 1
            self.dropped_sequences += len(group.sequences) - (len(out.sequences) if out else 0)
        return [Outgoing(t, out, key=msg.key) for t in self.outputs] if out else []

    def metrics(self) -> dict[str, float]:
        return {"downsample/groups": float(self.groups),
                "downsample/cut_groups": float(self.cut_groups),
                "downsample/dropped_sequences": float(self.dropped_sequences)}
