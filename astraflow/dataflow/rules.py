"""Rule-based routing: send records to named outputs by their metadata.

The ``rule_router`` kind complements the per-policy ``router`` (which stays as it is):
rules declared in the topology match a record's metadata and name the output topic it
goes to. Example::

    route-by-rule:
      kind: rule_router
      inputs: [trajectories]
      outputs: [trajectories.math, trajectories.fresh, trajectories.rest]
      options:
        rules:
          - {output: trajectories.math, match: {source: ["arith-*", "gsm8k"]}}
          - {output: trajectories.fresh, match: {version: {min: 10}, reward: {min: 0.5}}}
        default: trajectories.rest      # unset: unmatched records are dropped and counted

Every condition of a ``match`` must hold (an empty match matches everything). Conditions:
``source``, ``workflow`` (the task type: glob patterns, any may match), ``policy`` (any
sequence of such a policy), ``meta`` (key -> glob; the key must be present), ``reward``
(range on the mean, min or max reward, ``reward_of``), ``version`` (every generated token's
weight version within the range), ``created_at_ms`` (range). Ranges are inclusive and
either end may be left out. Rules apply to ``TrajectoryGroup`` and ``Task`` records alike;
a reward, version or policy condition never matches a ``Task`` (it has none). The first
matching rule wins, or every matching rule with ``all_matches``.
"""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.config.processors import RuleRouterOptions
from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.wire.records import Record


def matching_outputs(rec: Record, options: RuleRouterOptions) -> list[str]:
    """Outputs of the rules ``rec`` matches (the first one only, unless ``all_matches``)."""
    outs: list[str] = []
    for rule in options.rules:
        if rule.match.matches(rec) and rule.output not in outs:
            outs.append(rule.output)
            if not options.all_matches:
                break
    return outs


def route(rec: Record, options: RuleRouterOptions) -> list[str]:
    """Output topics for ``rec``: matching rules' outputs, else the default (or none)."""
    outs = matching_outputs(rec, options)
    if not outs and options.default is not None:
        outs = [options.default]
    return outs


class RuleRouter(Processor):
    """Routes records to named outputs by rules on their metadata; unmatched to a default."""

    kind = "rule_router"
    Options = RuleRouterOptions

    def __init__(self, name, inputs, outputs, options=None):
        super().__init__(name, inputs, outputs, options)
        named = [r.output for r in self.options.rules]
        if self.options.default is not None:
            named.append(self.options.default)
        unknown = sorted({t for t in named if t not in outputs})
        if unknown:
            raise ValueError(f"processor {name}: rule outputs {unknown} are not among its "
                             f"outputs {outputs}")
        self.routed: dict[str, int] = dict.fromkeys(outputs, 0)
        self.matched = 0
        self.defaulted = 0
        self.dropped = 0

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        outs = matching_outputs(msg.record, self.options)
        if outs:
            self.matched += 1
        elif self.options.default is not None:
            self.defaulted += 1
            outs = [self.options.default]
        else:
            self.dropped += 1
            return []
        for t in outs:
            self.routed[t] += 1
        return [Outgoing(t, msg.record, key=msg.key) for t in outs]

    def metrics(self) -> dict[str, float]:
        return {
            "rule_router/matched": float(self.matched),
            "rule_router/defaulted": float(self.defaulted),
            "rule_router/dropped": float(self.dropped),
            **{f"rule_router/routed/{t}": float(n) for t, n in self.routed.items()},
        }
