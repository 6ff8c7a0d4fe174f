"""Run definitions: ``topology/*.yaml`` validated into typed config.

A topology names a run (every topic is prefixed with it), the topics with their
partitions and configs, the processors between them, the policies (each with its one
``max_staleness``, its trainer's hyperparameters, its warm start and evaluator), the RaaS
pools with their typed workflow and engine options, the feeder and the evaluator; no argv
list or JSON string. Errors name the file and the offending key, e.g.
``topology/x.yaml: processors.echo.max_batch: Input should be ...``; an old-format key
fails with what to write instead (``astraflow.config.migrate``). Reference:
docs/topology.md.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from astraflow.config.lora import LORA_TARGETS, LoraSpec
from astraflow.config.migrate import old_format_errors
from astraflow.config.processors import PROCESSOR_OPTIONS
from astraflow.config.sections import (
    DEFAULT_LOSS,
    DEFAULT_MAX_STALENESS,
    LOSS_HYPERPARAMETERS,
    ROLE_ONLY,
    SOLVER_ONLY,
    ChatSpec,
    DatasetSpec,
    EvalSpec,
    FeederSpec,
    Levels,
    PolicyEvalSpec,
    PolicySpec,
    PoolSpec,
    TrainerSpec,
    WarmStartSpec,
    _format_errors,
    _samplings,
    _Strict,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import ResolvedTopic
from astraflow.wire.records import (
    Batch,
    BlobChunk,
    ComponentStatus,
    DeadLetter,
    EpisodeCall,
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
    ("episodes", EpisodeCall),
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
    # None: min(3, brokers of the cluster), astraflow.kafka.replication
    replication_factor: int | None = Field(default=None, ge=1)
    retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1)
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    compression: str = "producer"


class ProcessorSpec(_Strict):
    """One processor: its kind, the topics between which it sits and kind options."""

    kind: str
    inputs: list[str] = Field(min_length=1)
    outputs: list[str] = Field(default_factory=list)
    group: str | None = None  # consumer group; default "<run>.<name>"
    # records per transaction, at most; by default the commit interval (100 ms, as Kafka
    # Streams' commit.interval.ms under exactly-once) or an idle poll ends one first
    max_batch: int = Field(default=100_000, ge=1)
    poll_timeout_s: float = Field(default=0.5, gt=0)
    options: dict[str, Any] = Field(default_factory=dict)

    def typed_options(self) -> BaseModel:
        """``options`` as its kind's model (``PROCESSOR_OPTIONS``): the keys set, over the
        model's defaults (``model_fields_set`` tells the two apart)."""
        return PROCESSOR_OPTIONS[self.kind](**self.options)


# topics every run has, whether or not the file lists them
IMPLICIT_TOPICS: dict[str, dict[str, Any]] = {
    "dlq": {"retention_ms": 30 * 24 * 3600 * 1000},
    "status": {"retention_ms": 3600 * 1000, "partitions": 1},
}


class WeightSigningSpec(_Strict):
    """Signed weights (``astraflow.weights.signing``): each trainer signs its manifests with
    ``private_key``; RaaS nodes and evaluators refuse manifests not signed by the key of
    ``public_key``. Paths of PEM files (``astraflow weights keygen``), never keys;
    ``ASTRAFLOW_WEIGHTS_SIGNING_KEY`` and ``ASTRAFLOW_WEIGHTS_PUBLIC_KEY`` override them."""

    public_key: str | None = None
    private_key: str | None = None

    @field_validator("public_key", "private_key")
    @classmethod
    def _a_path(cls, v: str | None) -> str | None:
        if v is not None and "-----BEGIN" in v:
            raise ValueError("the path of a PEM file, not the key itself")
        return v


class Topology(_Strict):
    """A whole run definition."""

    run: str = Field(pattern=r"^[A-Za-z0-9_\-]+$")
    kafka: KafkaConfig = Field(default_factory=KafkaConfig)
    status_interval_s: float = Field(default=5.0, gt=0)
    # `astraflow up` serves each process's Prometheus metrics on the next port from this one
    # (in the order `topology explain` lists them); None: none served
    metrics_port: int | None = Field(default=None, ge=1, le=65535)
    topic_defaults: TopicDefaults = Field(default_factory=TopicDefaults)
    topics: dict[str, TopicSpec] = Field(default_factory=dict)
    processors: dict[str, ProcessorSpec] = Field(default_factory=dict)
    policies: dict[str, PolicySpec] = Field(default_factory=dict)
    pools: dict[str, PoolSpec] = Field(default_factory=dict)
    feeder: FeederSpec | None = None
    eval: EvalSpec | None = None
    weight_signing: WeightSigningSpec = Field(default_factory=WeightSigningSpec)

    source: str = Field(default="<memory>", exclude=True)

    @model_validator(mode="after")
    def _check(self) -> Topology:
        for name, spec in IMPLICIT_TOPICS.items():
            self.topics.setdefault(name, TopicSpec(**spec))
        self._check_topics()
        self._check_processors()
        self._resolve_staleness()
        self._check_task_partitions()
        self._check_sampling()
        self._check_principals()
        return self

    def _check_sampling(self) -> None:
        """A workflow that sets its own temperature or top-p must sample the distribution
        the trainers compute their log-probs of (their policies' ``temperature`` and
        ``top_p``); checked where the policies share one setting (greedy, temperature 0,
        is reported at temperature 1 without truncation)."""
        shared = {(p.temperature, p.top_p) for p in self.policies.values()}
        if len(shared) != 1:
            return
        temperature, top_p = shared.pop()
        for pool, spec in self.pools.items():
            for name, options in spec.workflows.items():
                for where, sampling in _samplings(options, f"pools.{pool}.workflows.{name}"):
                    given = sampling.sampling_given()  # unset: the policies' (shared)
                    t, p = given.get("temperature", temperature), given.get("top_p", top_p)
                    if (t, p) != (temperature, top_p) and not (
                            t == 0 and (temperature, top_p) == (1.0, 1.0)):
                        raise ValueError(
                            f"{where}: samples at temperature {t:g}, top_p {p:g}; the "
                            f"trainers compute log-probs at the policies' temperature "
                            f"{temperature:g}, top_p {top_p:g}: set the sampling under "
                            "policies.<name> (temperature, top_p) instead")

    def _check_principals(self) -> None:
        """Every ``kafka.security.principals`` key names a component of this topology."""
        known = self.component_keys()
        for key in self.kafka.security.principals:
            if key not in known:
                raise ValueError(f"kafka.security.principals.{key}: no such component "
                                 f"(known: {', '.join(known)})")

    def _check_task_partitions(self) -> None:
        """Nodes beyond the partitions of ``tasks`` in one group would get none: refuse."""
        if "tasks" not in self.topics:
            return
        partitions = self.topic("tasks").partitions
        for group, pools in self.raas_groups().items():
            nodes = sum(self.pools[p].nodes for p in pools if p in self.pools)
            if nodes > partitions:
                raise ValueError(
                    f"topics.tasks.partitions: {partitions} partitions for the {nodes} nodes "
                    f"of pools {', '.join(pools)} (group {group}); a node gets tasks only "
                    f"from partitions of its own, so give tasks at least {nodes}")

    def _check_topics(self) -> None:
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

    def _check_processors(self) -> None:
        for pname, p in self.processors.items():
            if p.kind not in PROCESSOR_OPTIONS:
                raise ValueError(
                    f"processors.{pname}.kind: unknown processor kind {p.kind!r} "
                    f"(known: {sorted(PROCESSOR_OPTIONS)})"
                )
            for field_name in ("inputs", "outputs"):
                for i, t in enumerate(getattr(p, field_name)):
                    if t not in self.topics:
                        raise ValueError(
                            f"processors.{pname}.{field_name}[{i}]: topic {t!r} is not "
                            f"declared under topics:"
                        )
            options_model = PROCESSOR_OPTIONS[p.kind]
            try:
                options_model(**p.options)
            except ValidationError as e:
                raise ValueError(_format_errors(e, prefix=f"processors.{pname}.options")) from None

    def _resolve_staleness(self) -> None:
        """Give each staleness filter and batcher its policies' ``max_staleness`` (an
        explicit option is left only where the topology declares none of its policies:
        old-format checks reject the others)."""
        for pname, p in self.processors.items():
            if p.kind == "staleness_filter":
                named = list(p.typed_options().policies)
            elif p.kind == "batcher":
                named = [p.typed_options().policy]
            else:
                continue
            bounds = {n: self.policies[n].max_staleness for n in named if n in self.policies}
            if len(set(bounds.values())) > 1:
                raise ValueError(
                    f"processors.{pname}: its policies have different max_staleness "
                    f"({', '.join(f'{n} {b}' for n, b in bounds.items())}); one staleness "
                    "filter applies one bound: give them the same max_staleness")
            if bounds:
                p.options["max_staleness"] = next(iter(bounds.values()))

    def max_staleness(self, policy: str) -> int:
        """The ``max_staleness`` of ``policy`` (the one default for undeclared ones)."""
        spec = self.policies.get(policy)
        return spec.max_staleness if spec is not None else DEFAULT_MAX_STALENESS

    def shared_sampling(self) -> dict[str, float]:
        """The policies' ``temperature`` and ``top_p`` where they all share one (top-p only
        when it truncates: 1.0 is every workflow's default): what a pool's workflows
        sample with unless they set their own."""
        out: dict[str, float] = {}
        temperatures = {p.temperature for p in self.policies.values()}
        if len(temperatures) == 1:
            out["temperature"] = temperatures.pop()
        top_ps = {p.top_p for p in self.policies.values()}
        if len(top_ps) == 1 and (top_p := top_ps.pop()) < 1:
            out["top_p"] = top_p
        return out

    def pool_kafka(self, pool: str, rack: str | None = None) -> KafkaConfig:
        """The client settings of ``pool``'s nodes: its ``kafka:`` over the topology's, the
        librdkafka option mappings merged key by key (the topology's for an unknown pool),
        and ``client.rack`` on every consumer from ``rack`` (a node's own, ``raas run
        --rack``), else the pool's ``rack``."""
        spec = self.pools.get(pool)
        rack = rack if rack is not None else (spec.rack if spec is not None else None)
        if spec is None or not spec.kafka:
            return self.kafka.with_rack(rack)
        base = self.kafka.model_dump()
        merged = {k: {**base[k], **v} if isinstance(v, dict) else v
                  for k, v in spec.kafka.items()}
        return KafkaConfig(**{**base, **merged}).with_rack(rack)

    def component_keys(self) -> list[str]:
        """The key of every component (its principal under ``kafka.security``): ``feeder``,
        ``processor.<name>``, ``pool.<pool>``, ``trainer.<policy>``, ``eval.<policy>``."""
        keys = ["feeder"] if self.feeder is not None else []
        keys += [f"processor.{name}" for name in self.processors]
        keys += [f"pool.{name}" for name in self.pools]
        keys += [f"trainer.{policy}" for policy in self.policies]
        if self.eval is not None:
            keys += [f"eval.{policy}" for policy in self.policies]
        return keys

    def component_kafka(self, key: str, base: KafkaConfig | None = None) -> KafkaConfig:
        """The client settings of component ``key`` (``base``: default the topology's
        ``kafka:``) with that component's credentials (``kafka.security.principals``)."""
        return (base or self.kafka).for_component(key, self.run)

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
            replication_key=(f"topics.{name}.replication_factor" if spec.replication_factor
                             else "topic_defaults.replication_factor"),
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

    def raas_group(self, pool: str) -> str:
        """The consumer group of a RaaS pool's nodes on ``tasks``: the run's one shared
        group ``<run>.raas`` (each task rolled out once, by whichever sharing pool takes
        it), or ``<run>.raas.<pool>`` for a pool with ``share_tasks: false``."""
        spec = self.pools.get(pool)
        if spec is not None and not spec.share_tasks:
            return f"{self.run}.raas.{pool}"
        return f"{self.run}.raas"

    def raas_groups(self) -> dict[str, list[str]]:
        """Each RaaS consumer group on ``tasks`` -> the pools in it (sorted; a topology
        without pools has the shared group of the nodes' default pool)."""
        out: dict[str, list[str]] = {}
        for pool in sorted(self.pools) or ["default"]:
            out.setdefault(self.raas_group(pool), []).append(pool)
        return out

    def trainer_group(self, policy: str) -> str:
        return f"{self.run}.trainer.{policy}"

    def consumer_groups(self) -> list[tuple[str, str, list[str]]]:
        """Every consumer group the topology's components run in, as ``(component, group,
        input topics)`` (logical topic names): processors, RaaS pools and trainers."""
        out = [(f"processor {name}", self.group_of(name), list(spec.inputs))
               for name, spec in self.processors.items()]
        out += [(f"pool {', '.join(pools)}", group, ["tasks"])
                for group, pools in self.raas_groups().items() if self.pools]
        out += [(f"trainer {policy}", self.trainer_group(policy), [f"batches.{policy}"])
                for policy in self.policies]
        return out


def parse_topology(data: Any, source: str = "<memory>") -> Topology:
    """Validate a parsed YAML mapping; raises TopologyError naming source and key."""
    if not isinstance(data, dict):
        raise TopologyError(f"{source}: expected a mapping at the top level")
    old = old_format_errors(data)
    if old:
        raise TopologyError(f"{source}: old topology format (docs/topology.md, "
                            "\"Migrating\"):\n  " + "\n  ".join(old))
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


_RUN_NAME = re.compile(r"[A-Za-z0-9_\-]+")


def with_overrides(topo: Topology, run: str | None = None,
                   bootstrap: str | None = None) -> Topology:
    """``topo`` with another run name (its topic and group prefix) and bootstrap servers
    (``--run``, ``--bootstrap``)."""
    if run and run != topo.run:
        if not _RUN_NAME.fullmatch(run):
            raise TopologyError(f"--run {run!r}: use letters, digits, '_' and '-' only")
        topo = topo.model_copy(update={"run": run})
    if bootstrap:
        kafka = topo.kafka.model_copy(update={"bootstrap_servers": bootstrap})
        topo = topo.model_copy(update={"kafka": kafka})
    return topo


# the component sections (astraflow.config.sections), importable from here too
__all__ = [
    "DEFAULT_LOSS", "DEFAULT_MAX_STALENESS", "IMPLICIT_TOPICS", "LORA_TARGETS",
    "LOSS_HYPERPARAMETERS",
    "ROLE_ONLY", "SCHEMA_BY_NAME", "SOLVER_ONLY", "TOPIC_SCHEMAS", "ChatSpec", "DatasetSpec",
    "EvalSpec", "FeederSpec", "Levels", "LoraSpec", "PolicyEvalSpec", "PolicySpec", "PoolSpec",
    "ProcessorSpec", "ResolvedTopic", "TopicDefaults", "TopicSpec", "Topology",
    "TopologyError", "TrainerSpec", "WarmStartSpec", "WeightSigningSpec", "load_topology",
    "parse_topology", "schema_for_topic", "with_overrides",
]
