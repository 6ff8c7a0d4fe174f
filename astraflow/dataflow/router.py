"""Splits trajectory groups into per-policy samples (``samples.<policy>``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from astraflow.dataflow.base import Incoming, InvalidRecord, Outgoing, Processor
from astraflow.records import TrajectoryGroup


def split_by_policy(group: TrajectoryGroup) -> dict[str, TrajectoryGroup]:
    """One group per policy, holding only that policy's sequences (and their rewards)."""
    out: dict[str, TrajectoryGroup] = {}
    for policy in dict.fromkeys(s.policy for s in group.sequences):
        seqs = [s for s in group.sequences if s.policy == policy]
        out[policy] = replace(group, group_id=f"{group.group_id}/{policy}", sequences=seqs,
                              rewards=[s.reward for s in seqs])
    return out


class PolicyRouter(Processor):
    """Routes each policy's sequences of a group to ``samples.<policy>``."""

    kind = "router"

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        outs = []
        for policy, part in split_by_policy(msg.record).items():
            topic = f"samples.{policy}"
            if topic not in self.outputs:
                raise InvalidRecord(f"no output topic {topic} for policy {policy!r}")
            outs.append(Outgoing(topic, part, key=msg.key))
        return outs
