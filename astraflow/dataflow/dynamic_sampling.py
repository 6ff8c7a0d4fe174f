"""Dynamic sampling: drop trajectory groups that carry no group-relative learning signal.

With group-relative advantages (GRPO), a group whose rewards are all equal (all correct,
all wrong) has zero advantage everywhere and only dilutes the batch. This processor drops
such groups after rollout and counts them; the rest pass unchanged.

With ``per_policy``, variance is judged per policy inside a multi-policy group: the
sequences of a policy whose rewards are all equal are removed, the group is kept when
any policy remains. A group of a single sample is zero-variance too and is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.config.processors import DynamicSamplingOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.dataflow.groups import all_equal, rewards_of, with_sequences
from astraflow.wire.records import TrajectoryGroup


def informative(group: TrajectoryGroup, tol: float = 1e-6,
                per_policy: bool = False) -> TrajectoryGroup | None:
    """``group`` if its rewards vary, else None.

    With ``per_policy``, a copy holding only the sequences of policies whose rewards vary
    (``group`` itself when nothing was removed; None when nothing is left).
    """
    if not per_policy or not group.sequences:
        rewards = rewards_of(group)
        return None if len(rewards) < 2 or all_equal(rewards, tol) else group
    keep = {p for p in dict.fromkeys(s.policy for s in group.sequences)
            if len(r := rewards_of(group, p)) >= 2 and not all_equal(r, tol)}
    seqs = [s for s in group.sequences if s.policy in keep]
    return with_sequences(group, seqs)


class DynamicSampling(Processor):
    """Drops groups whose rewards are all equal; counts kept and dropped groups."""

    kind = "dynamic_sampling"
    Options = DynamicSamplingOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        self.kept = 0
        self.dropped = 0
        self.dropped_sequences = 0

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        group: TrajectoryGroup = msg.record
        out = informative(group, self.options.tol, self.options.per_policy)
        self.dropped_sequences += len(group.sequences) - (len(out.sequences) if out else 0)
        if out is None:
            self.dropped += 1
            return []
        self.kept += 1
        return [Outgoing(t, out, key=msg.key) for t in self.outputs]

    def metrics(self) -> dict[str, float]:
        return {"dynamic_sampling/kept": float(self.kept),
                "dynamic_sampling/dropped": float(self.dropped),
                "dynamic_sampling/dropped_sequences": float(self.dropped_sequences)}
