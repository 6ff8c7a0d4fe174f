"""The options of every processor kind, as a topology's ``processors.<name>.options``
declares them: pydantic models, torch-free and free of any Kafka client, so that the typed
topology (``astraflow.config.topology``) validates a file without importing the processors
(``astraflow.dataflow``), whose ``Options`` these are."""

from __future__ import annotations

from fnmatch import fnmatchcase
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from astraflow.wire.records import Record, TrajectoryGroup


class NoOptions(BaseModel):
    """The options of a processor kind that takes none."""

    model_config = ConfigDict(extra="forbid")


# --- admission -----------------------------------------------------------------------
class AdmissionOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    pools: list[str] | None = Field(
        default=None, description="RaaS pools to watch (default: the topology's pools, else "
                                  "the node's default pool 'default')")
    policies: list[str] | None = Field(
        default=None, description="trainers to watch (default: the topology's policies)")
    pool_capacity: int | None = Field(
        default=None, ge=1, description="tasks one pool rolls out at once (default: nodes x "
                                        "tasks_per_transaction from pools:)")
    queue_factor: float = Field(default=2.0, gt=0, description="pool bound = factor x capacity")
    max_pool_lag: int | None = Field(default=None, ge=1,
                                     description="fixed pool bound instead of the measured target")
    max_queue_s: float = Field(default=60.0, gt=0, description="the target never holds more "
                               "than this many seconds of a group's measured throughput")
    max_staleness: int | None = Field(
        default=None, ge=0, description="default: the batcher's (or staleness filter's) "
                                        "max_staleness for the policy, else 4")
    max_trainer_lag: int | None = Field(
        default=None, ge=0, description="trainer bound in batches, overrides max_staleness")
    staleness_budget: Literal["pipeline", "in_flight", "queue"] = Field(
        default="pipeline", description="pipeline: the batches queued for a trainer, the "
        "tasks in flight and the groups on their way to its batcher (in batches of its "
        "batcher's fresh groups) together stay within its bound, so no admitted task grows "
        "stale; in_flight: the same without the groups on their way (reads no lag of the "
        "processors between nodes and batcher; the rule before 2026-11-28); queue: the "
        "queued batches alone")
    poll_interval_s: float = Field(default=0.5, gt=0, le=10, description="lag read period")
    max_held: int = Field(default=1000, ge=1, description="pause the input beyond this")
    route: Literal["least_lag", "key"] = Field(
        default="least_lag", description="least_lag: each admitted task goes to the partition "
                                         "with the fewest tasks in flight; key: by its key")


# --- autoscaler ----------------------------------------------------------------------
class PoolBounds(BaseModel):
    """The sizes one RaaS pool may have, and the trainers whose waiting drives it."""

    model_config = ConfigDict(extra="forbid")
    min_size: int = Field(default=1, ge=0, description="fewest nodes advised")
    max_size: int = Field(ge=1, description="most nodes advised")
    policies: list[str] | None = Field(
        default=None, description="trainers (by policy) that drive this pool; default: the "
                                  "autoscaler's `policies`")

    @model_validator(mode="after")
    def _ordered(self) -> PoolBounds:
        if self.min_size > self.max_size:
            raise ValueError(f"min_size {self.min_size} is above max_size {self.max_size}")
        return self


class AutoscalerOptions(BaseModel):
    """Options of the ``autoscaler`` processor."""

    model_config = ConfigDict(extra="forbid")
    pools: dict[str, PoolBounds] = Field(
        min_length=1, description="pool name -> {min_size, max_size, policies}")
    upper: float = Field(default=0.10, gt=0, le=1,
                         description="advise a node more above this waiting fraction")
    lower: float = Field(default=0.05, ge=0, lt=1,
                         description="advise a node less below this waiting fraction")
    policies: list[str] | None = Field(
        default=None, description="trainers (by policy) that drive every pool without its "
                                  "own `policies`; default: every trainer on status")
    idle_above: float = Field(
        default=0.9, gt=0, le=1, description="advise a node less when the pool's nodes wait "
                                             "for tasks more than this share of the time")
    window_s: float = Field(default=60.0, gt=0,
                            description="the waiting fraction and rates are over this span")
    cooldown_s: float = Field(default=60.0, ge=0,
                              description="no advice for a pool this long after its last")
    stale_after_s: float = Field(
        default=30.0, gt=0, description="a component silent this long is not counted (keep "
                                        "it above status_interval_s and a node's longest "
                                        "transaction)")

    @model_validator(mode="after")
    def _band(self) -> AutoscalerOptions:
        if self.lower >= self.upper:
            raise ValueError(f"lower ({self.lower}) must be below upper ({self.upper}): "
                             "they bound the dead band")
        return self


# --- batcher -------------------------------------------------------------------------
ReplaySelection = Literal["uniform", "recent", "high_reward", "max_variance"]


class BatcherOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    policy: str = "actor"
    batch_size: int = Field(default=8, ge=1, description="groups per batch")
    max_staleness: int | None = Field(
        default=None, ge=0, description="re-check staleness when a batch is cut")
    replay_ratio: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="at most this fraction of each batch's groups is replayed (0: off)")
    replay_capacity: int = Field(default=256, ge=1, description="groups kept for replay")
    replay_selection: ReplaySelection = Field(
        default="uniform",
        description="uniform | recent | high_reward (mean reward) | max_variance (reward "
                    "variance within the group: the groups with the most advantage signal)")
    replay_max_uses: int | None = Field(
        default=None, ge=1, description="times a group may be replayed (None: unlimited)")
    replay_seed: int | None = Field(default=None, description="seed of uniform selection")
    replay_rebuild: bool = Field(
        default=True, description="refill the buffer from batches.<policy> when starting")


# --- class_balance -------------------------------------------------------------------
class ClassBalanceOptions(BaseModel):
    """Options of the ``class_balance`` processor."""

    model_config = ConfigDict(extra="forbid")
    policy: str = Field(description="the policy whose sequences are balanced")
    key: str = Field(default="truth", description="Sequence.meta field holding the class")
    single_class: Literal["drop", "keep"] = Field(
        default="drop", description="what happens to a group whose sequences are one class")


# --- curriculum ----------------------------------------------------------------------
class Stage(BaseModel):
    """One step of a level schedule."""

    model_config = ConfigDict(extra="forbid")
    until: int | None = Field(default=None, ge=0,
                              description="applies while fewer groups were observed")
    weights: dict[int, float] = Field(description="level -> acceptance probability")

    @model_validator(mode="after")
    def _probabilities(self) -> Stage:
        for level, w in self.weights.items():
            if not 0.0 <= w <= 1.0:
                raise ValueError(f"weights[{level}] = {w} is not a probability in [0, 1]")
        return self


class CurriculumOptions(BaseModel):
    """Options of the ``curriculum`` processor (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    by: Literal["pass_rate", "level"] = "pass_rate"
    observe_topic: str = "trajectories"
    policy: str | None = Field(default=None, description="estimate on this policy's rewards")
    # pass_rate mode
    low: float = Field(default=0.2, ge=0, le=1)
    high: float = Field(default=0.8, ge=0, le=1)
    in_band_prob: float = Field(default=1.0, ge=0, le=1)
    out_band_prob: float = Field(default=0.25, ge=0, le=1)
    unseen_prob: float = Field(default=1.0, ge=0, le=1)
    success_threshold: float = 1.0
    min_samples: int = Field(default=1, ge=1)
    history: int = Field(default=4, ge=1, description="groups per prompt in the estimate")
    # level mode
    stages: list[Stage] = Field(default_factory=list)
    default_weight: float = Field(default=1.0, ge=0, le=1)
    seed: int = 0

    @model_validator(mode="after")
    def _check(self) -> CurriculumOptions:
        if self.low > self.high:
            raise ValueError("low must not exceed high")
        if self.by == "level" and not self.stages:
            raise ValueError("by: level needs at least one stage")
        untils = [s.until for s in self.stages]
        if any(u is None for u in untils[:-1]):
            raise ValueError("only the last stage may leave `until` unset")
        bounded = [u for u in untils if u is not None]
        if bounded != sorted(bounded):
            raise ValueError("stages must be in increasing `until` order")
        return self


# --- downsample ----------------------------------------------------------------------
class DownsampleOptions(BaseModel):
    """Options of the ``downsample`` processor."""

    model_config = ConfigDict(extra="forbid")
    keep: int = Field(ge=2, description="samples kept per group")


# --- dynamic_sampling ----------------------------------------------------------------
class DynamicSamplingOptions(BaseModel):
    """Options of the ``dynamic_sampling`` processor."""

    model_config = ConfigDict(extra="forbid")
    tol: float = Field(default=1e-6, ge=0, description="rewards within tol are equal")
    per_policy: bool = Field(default=False,
                             description="judge and drop each policy's sequences separately")


# --- greso ---------------------------------------------------------------------------
class GresoOptions(BaseModel):
    """Options of the ``greso`` processor (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    observe_topic: str = Field(default="trajectories",
                               description="retained topic of TrajectoryGroups to learn from")
    policy: str | None = Field(default=None,
                               description="classify on this policy's rewards only")
    easy_threshold: float = Field(default=1.0, description="common reward that counts as easy")
    tol: float = Field(default=1e-6, ge=0, description="rewards within tol are equal")
    min_group_size: int = Field(default=2, ge=1)
    p_easy: float = Field(default=0.5, gt=0, le=1, description="initial base for easy streaks")
    p_hard: float = Field(default=0.5, gt=0, le=1, description="initial base for hard streaks")
    target_easy_ratio: float = Field(default=0.1, ge=0, le=1)
    target_hard_ratio: float = Field(default=0.1, ge=0, le=1)
    step: float = Field(default=0.01, gt=0)
    step_mode: Literal["additive", "multiplicative"] = "additive"
    min_base: float = Field(default=0.05, gt=0, le=1)
    max_base: float = Field(default=1.0, gt=0, le=1)
    min_submit_prob: float = Field(default=0.05, ge=0, le=1,
                                   description="floor on the forwarding probability")
    window: int = Field(default=256, ge=1, description="observations per ratio window")
    adapt_every: int = Field(default=16, ge=1, description="observations between steps")
    seed: int = 0

    @model_validator(mode="after")
    def _bounds(self) -> GresoOptions:
        if self.min_base > self.max_base:
            raise ValueError("min_base must not exceed max_base")
        return self


# --- mixer ---------------------------------------------------------------------------
class MixerOptions(BaseModel):
    """Options of the ``mixer`` processor (see the module docstring)."""

    model_config = ConfigDict(extra="forbid")
    by: Literal["topic", "source"] = "topic"
    ratios: dict[str, float] = Field(min_length=1, description="key -> weight (> 0)")
    unlisted: Literal["pass", "drop"] = "pass"
    max_held: int = Field(default=1000, ge=0, description="records held at most")
    max_hold_ms: int | None = Field(default=10_000, ge=0,
                                    description="release a record held this long")

    @field_validator("ratios")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        bad = sorted(k for k, w in v.items() if not w > 0)
        if bad:
            raise ValueError(f"ratios must be positive (not for {bad})")
        return v


# --- reward_norm ---------------------------------------------------------------------
class RewardNormOptions(BaseModel):
    """Options of the ``reward_norm`` processor."""

    model_config = ConfigDict(extra="forbid")
    divide_std: bool = Field(default=True, description="also divide by std + eps")
    eps: float = Field(default=1e-6, gt=0)
    per_policy: bool = Field(default=True, description="statistics per policy within a group")


# --- router --------------------------------------------------------------------------
class RouterOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    split_roles: bool = False  # one group per (policy, role) instead of per policy


# --- rules ---------------------------------------------------------------------------

def _any_glob(value: str, patterns: list[str]) -> bool:
    return any(fnmatchcase(value, p) for p in patterns)
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


# --- staleness -----------------------------------------------------------------------
class StalenessOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    max_staleness: int = Field(default=4, ge=0)
    policies: list[str] = Field(default_factory=lambda: ["actor"], min_length=1)


# kind -> its options model; ``astraflow.dataflow.PROCESSOR_KINDS`` maps the same kinds to
# the processors (a unit test checks the two agree)
PROCESSOR_OPTIONS: dict[str, type[BaseModel]] = {
    "passthrough": NoOptions,
    "staleness_filter": StalenessOptions,
    "router": RouterOptions,
    "batcher": BatcherOptions,
    "greso": GresoOptions,
    "curriculum": CurriculumOptions,
    "mixer": MixerOptions,
    "dynamic_sampling": DynamicSamplingOptions,
    "reward_norm": RewardNormOptions,
    "rule_router": RuleRouterOptions,
    "class_balance": ClassBalanceOptions,
    "downsample": DownsampleOptions,
    "admission": AdmissionOptions,
    "autoscaler": AutoscalerOptions,
}
