"""Splits trajectory groups into per-policy samples (``samples.<policy>``).

Each policy's trainer computes GRPO advantages over its own sequences of one group. With
``split_roles: true`` a policy's sequences are split once more by ``Sequence.role``, each
(policy, role) going out as its own group (``<group_id>/<policy>/<role>``), so that, e.g.,
a solver's first tries and its retries, or a policy that plays both solver and verifier,
get separate advantage baselines.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from astraflow.config.processors import RouterOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.wire.records import TrajectoryGroup
from astraflow.wire.validate import InvalidRecord


def split_by_policy(group: TrajectoryGroup) -> dict[str, TrajectoryGroup]:
    """One group per policy, holding only that policy's sequences (and their rewards)."""
    out: dict[str, TrajectoryGroup] = {}
    for policy in dict.fromkeys(s.policy for s in group.sequences):
        seqs = [s for s in group.sequences if s.policy == policy]
        out[policy] = replace(group, group_id=f"{group.group_id}/{policy}", sequences=seqs,
                              rewards=[s.reward for s in seqs])
    return out


def split_by_role(group: TrajectoryGroup) -> list[TrajectoryGroup]:
    """One group per ``Sequence.role`` (``<group_id>/<role>``; sequences without a role
    stay under ``group_id``), in order of first appearance."""
    roles = list(dict.fromkeys(s.role for s in group.sequences))
    if len(roles) <= 1 and not any(roles):
        return [group]
    out = []
    for role in roles:
        seqs = [s for s in group.sequences if s.role == role]
        gid = f"{group.group_id}/{role}" if role else group.group_id
        out.append(replace(group, group_id=gid, sequences=seqs, rewards=[s.reward for s in seqs]))
    return out


class PolicyRouter(Processor):
    """Routes each policy's sequences of a group to ``samples.<policy>``."""

    kind = "router"
    Options = RouterOptions

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        outs = []
        for policy, part in split_by_policy(msg.record).items():
            topic = f"samples.{policy}"
            if topic not in self.outputs:
                raise InvalidRecord(f"no output topic {topic} for policy {policy!r}")
            parts = split_by_role(part) if self.options.split_roles else [part]
            outs.extend(Outgoing(topic, p, key=msg.key) for p in parts)
        return outs
