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
from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from astraflow.dataflow.base import Incoming, Outgoing, Processor
from astraflow.wire.records import Record, TrajectoryGroup


class Range(BaseModel):
    """An inclusive numeric range; either end may be left out."""

    model_config = ConfigDict(extra="forbid")
    min: float | None = None
    max: float | None = None

    def contains(self, x: float) -> bool:
        """True when ``min <= x <= max`` (missing ends are unbounded)."""
        return (self.min is None or x >= self.min) and (self.max is None or x <= self.max)


class Match(BaseModel):
    """Conditions on a record's metadata; all given ones must hold."""

    model_config = ConfigDict(extra="forbid")
    source: list[str] | None = Field(default=None, description="glob patterns on .source")
    workflow: list[str] | None = Field(default=None, description="glob patterns on .workflow")
    policy: list[str] | None = Field(default=None, description="any sequence of these")
    meta: dict[str, str] | None = Field(default=None, description="meta key -> glob")
    reward: Range | None = None
    reward_of: Literal["mean", "min", "max"] = "mean"
    version: Range | None = Field(default=None, description="generated-token versions")
    created_at_ms: Range | None = None

    def matches(self, rec: Record) -> bool:
        """True when every given condition holds for ``rec``."""
        if self.source is not None and not _any_glob(getattr(rec, "source", ""), self.source):
            return False
        if self.workflow is not None and not _any_glob(getattr(rec, "workflow", ""),
                                                       self.workflow):
            return False
        if self.meta is not None:
            meta = getattr(rec, "meta", {}) or {}
            if any(k not in meta or not fnmatchcase(meta[k], pat) for k, pat in self.meta.items()):
                return False
        if self.created_at_ms is not None and not self.created_at_ms.contains(
                getattr(rec, "created_at_ms", 0)):
            return False
        if self.policy is None and self.reward is None and self.version is None:
            return True
        if not isinstance(rec, TrajectoryGroup):
            return False
        if self.policy is not None and not any(s.policy in self.policy for s in rec.sequences):
            return False
        if self.reward is not None:
            rewards = [s.reward for s in rec.sequences] if rec.sequences else rec.rewards
            if not rewards:
                return False
            value = {"mean": sum(rewards) / len(rewards), "min": min(rewards),
                     "max": max(rewards)}[self.reward_of]
            if not self.reward.contains(value):
                return False
        if self.version is not None:
            gen = [v for s in rec.sequences for v in s.versions if v >= 0]
            if not gen or not (self.version.contains(min(gen)) and self.version.contains(max(gen))):
                return False
        return True


def _any_glob(value: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(value, p) for p in patterns)


class Rule(BaseModel):
    """Send records that ``match`` to ``output``."""

    model_config = ConfigDict(extra="forbid")
    output: str
    match: Match = Field(default_factory=Match)


class RuleRouterOptions(BaseModel):
    """Options of the ``rule_router`` processor (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    rules: list[Rule] = Field(default_factory=list)
    default: str | None = Field(default=None, description="output for unmatched records")
    all_matches: bool = Field(default=False, description="every matching rule, not the first")


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
