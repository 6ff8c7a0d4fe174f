"""Class balance: give a judge policy as many examples of each class as of any other.

A verifier trained on the solver's answers sees mostly right answers once the solver is
good (90 % and more): approving everything then earns almost the full reward, and the
verifier drifts towards approving wrong answers too. This processor balances, inside each
group, the sequences of one policy by a ``Sequence.meta`` field (default ``truth``, which
``solve_verify`` sets to ``1`` for a verdict on a right answer and ``0`` on a wrong one):
every class keeps as many sequences as the smallest class has, drawn at random (seeded by
the group id, so a replay decides the same). A group where the policy's sequences are all
of one class loses them (``single_class: drop``, the default: they could only teach that
one verdict) or keeps them (``keep``). Other policies' sequences pass untouched; a group
left with no sequences is dropped.

Typical place: between the router and the judge's batcher
(``samples.verifier -> samples.verifier.balanced``).
"""

from __future__ import annotations

import random
from collections.abc import Iterable

from astraflow.config.processors import ClassBalanceOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.dataflow.groups import with_sequences
from astraflow.wire.records import Sequence, TrajectoryGroup


def balance(group: TrajectoryGroup, policy: str, key: str = "truth",
            single_class: str = "drop", salt: str = "") -> TrajectoryGroup | None:
    """``group`` with ``policy``'s sequences balanced by ``meta[key]`` (module doc); None
    when no sequence is left. Sequences without the field form a class of their own."""
    mine = [s for s in group.sequences if s.policy == policy]
    by_class: dict[str, list[Sequence]] = {}
    for s in mine:
        by_class.setdefault(s.meta.get(key, ""), []).append(s)
    if len(by_class) <= 1:
        keep = set(map(id, mine)) if single_class == "keep" else set()
    else:
        rng = random.Random(f"{salt}:{group.group_id}")
        k = min(len(v) for v in by_class.values())
        keep = {id(s) for v in by_class.values() for s in rng.sample(v, k)}
    seqs = [s for s in group.sequences if s.policy != policy or id(s) in keep]
    return with_sequences(group, seqs)


class ClassBalance(Processor):
    """Balances one policy's sequences of each group by a meta field (module doc)."""

    kind = "class_balance"
    Options = ClassBalanceOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        self.seen = 0
        self.kept = 0
        self.dropped_groups = 0

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        group: TrajectoryGroup = msg.record
        o = self.options
        before = sum(s.policy == o.policy for s in group.sequences)
        out = balance(group, o.policy, o.key, o.single_class, salt=self.name)
        self.seen += before
        if out is None:
            self.dropped_groups += 1
            return []
        self.kept += sum(s.policy == o.policy for s in out.sequences)
        return [Outgoing(t, out, key=msg.key) for t in self.outputs]

    def metrics(self) -> dict[str, float]:
        return {"class_balance/kept_fraction": self.kept / self.seen if self.seen else 1.0,
                "class_balance/dropped_groups": float(self.dropped_groups)}
