"""Typed options of a pool's workflows and engines, as a topology writes them.

The workflows (``astraflow.raas.workflows`` and the modules that register more) and the
engines keep parsing their own keyword options; these models check a topology's
``pools.<pool>.workflows`` and ``pools.<pool>.engine_options`` at load, so a misspelt or
ill-typed option fails with the file and key instead of on the RaaS node. The launcher
passes on only the keys the file sets (``model_dump(exclude_unset=True)``), so each
component's own defaults stay the defaults.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class _Options(BaseModel):
    model_config = ConfigDict(extra="forbid")

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
    """A seeded delay (``astraflow.raas.workflows.Latency``)."""

    dist: Literal["const", "lognormal", "pareto"] = "lognormal"
    median_s: float = Field(default=0.05, ge=0)
    sigma: float = Field(default=1.0, ge=0)
    scale_s: float = Field(default=0.02, ge=0)
    alpha: float = Field(default=1.5, gt=0)
    max_s: float = Field(default=30.0, ge=0)
    seed: int | None = None
    per_task: bool = Field(
        default=False, description="each task's delay a function of (seed, task id) alone")


class SamplingOptions(_Options):
    """How a workflow samples (every workflow takes these)."""

    max_new_tokens: int | None = Field(default=None, ge=1, description="default 64")
    temperature: float | None = Field(
        default=None, ge=0, description="default: the policies' temperature, else 1.0")
    top_p: float | None = Field(default=None, gt=0, le=1, description="default 1.0")
    seed: int | None = Field(default=None, description="seeds sampling: single_turn draws "
                             "each sample from (seed, task id, sample index, weight version), "
                             "so a run repeats; other workflows seed each generate call alike; "
                             "unset: fresh entropy")
    stop_token_ids: list[int] | None = None


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

    max_turns: int | None = Field(default=None, ge=1, description="default 4")
    tool_latency: float | LatencyOptions | None = None


class SolveVerifyOptions(SamplingOptions):
    """``solve_verify``: a solver answers, a verifier judges, one retry on rejection."""

    solver_policy: str | None = Field(default=None, description="default solver")
    verifier_policy: str | None = Field(default=None, description="default verifier")
    retry: bool | None = Field(default=None, description="default true")
    verifier_sampling: SamplingOptions | None = None
    max_answer_chars: int | None = Field(default=None, ge=1, description="default 12")
    blind: bool | None = Field(default=None, description="default false")
    corrective: bool | None = Field(
        default=None, description="default false: the chat verifier replies with the "
        "correct answer; its verdict is agreement with the candidate")
    agreement: bool | None = Field(
        default=None, description="default false: with blind in chat, the verdict is the "
        "agreement of the verifier's own answer with the candidate (no second turn)")
    judge_reward: str | dict[str, Any] | None = Field(
        default=None, description="the reward spec of the judge's own answers (blind, "
        "corrective); default the solver's reward")
    verdicts_per_prompt: int | None = Field(default=None, ge=1, description="default: all")
    env_latency: float | LatencyOptions | None = Field(
        default=None, description="extra delay per rollout (seconds or a latency mapping)")
    prompt_format: Literal["auto", "compact", "chat"] | None = Field(
        default=None, description="default auto: chat on a chat model")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="the solver's reward spec; default 1 right, 0 wrong")
    verdict_weight: float | None = Field(
        default=None, ge=0, le=1, description="default 0: the verdict's share of the "
        "solver's reward")
    reference_candidates: int | None = Field(
        default=None, ge=0, description="default 0: answers per prompt the verifier also "
        "judges that are not the solver's (the right one and a wrong one in turn)")

    @field_validator("reward", "judge_reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)


class SolveSelectOptions(SamplingOptions):
    """``solve_select``: two solver answers per sample, a selector picks one."""

    solver_policy: str | None = Field(default=None, description="default solver")
    selector_policy: str | None = Field(default=None, description="default selector")
    ties: Literal["skip", "outcome"] | None = Field(default=None, description="default skip")
    selector_sampling: SamplingOptions | None = None
    max_answer_chars: int | None = Field(default=None, ge=1, description="default 12")
    prompt_format: Literal["auto", "compact", "chat"] | None = Field(
        default=None, description="default auto: chat on a chat model")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="the solver's reward spec; default 1 right, 0 wrong")
    candidates: int | None = Field(default=None, ge=2, description="default 2 (chat: any)")
    corrective: bool | None = Field(
        default=None, description="default false: the chat selector replies with the "
        "correct answer; its pick is the answer it repeats")
    blind: bool | None = Field(
        default=None, description="default false: the chat selector answers the problem, "
        "not shown the answers; its pick is the answer its own agrees with (else the "
        "first)")
    judge_reward: str | dict[str, Any] | None = Field(
        default=None, description="the reward spec of the judge's own answers (blind, "
        "corrective); default the solver's reward")

    @field_validator("reward", "judge_reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)


class SandboxOptions(_Options):
    """Limits of the code sandbox (``astraflow.sandbox.runner``); unset: its defaults."""

    cpu_s: float | None = Field(default=None, gt=0)
    mem_mb: int | None = Field(default=None, ge=1)
    timeout_s: float | None = Field(default=None, gt=0)
    max_output: int | None = Field(default=None, ge=1)
    fsize_mb: int | None = Field(default=None, ge=0)
    nofile: int | None = Field(default=None, ge=1)
    max_procs: int | None = Field(default=None, ge=1, description="default 32")
    namespaces: bool | None = None
    audit: bool | None = None
    python: str | None = None
    drop_user: bool | None = None


class CodeTestsOptions(SamplingOptions):
    """``code_tests``: a solver writes code, a generator writes tests, a sandbox judges."""

    solver_policy: str | None = Field(default=None, description="default solver")
    generator_policy: str | None = Field(default=None, description="default generator")
    self_play: bool | None = Field(default=None, description="default true")
    n_solver: int | None = Field(default=None, ge=1)
    n_generator: int | None = Field(default=None, ge=0)
    solver_reward: Literal["fraction", "all"] | None = Field(
        default=None, description="default fraction")
    no_failures_reward: float | None = Field(default=None, description="default 0.0")
    max_tests: int | None = Field(default=None, ge=1, description="default 8")
    generator_sampling: SamplingOptions | None = None
    sandbox: SandboxOptions | None = None
    sandbox_workers: int | None = Field(default=None, ge=1, description="default 2")
    prompt_format: Literal["auto", "compact", "chat"] | None = Field(
        default=None, description="default auto: chat on a chat model")
    generator_reward: Literal["discriminating", "mutation"] | None = Field(
        default=None, description="default discriminating")
    max_mutants: int | None = Field(default=None, ge=0, description="default 6")
    format_weight: float | None = Field(
        default=None, ge=0, le=1, description="default 0: the mutation reward's share for "
        "well-formed asserts")
    value_weight: float | None = Field(
        default=None, ge=0, le=1, description="default 0: the mutation reward's share for "
        "asserted values near the reference's")


class AgentLimitsOptions(_Options):
    """An agent command's jail (``astraflow.raas.agent.jail``) and its resource limits,
    set before it starts; unset limits: none."""

    cpu_s: float | None = Field(default=None, gt=0)
    mem_mb: int | None = Field(default=None, ge=1)
    max_procs: int | None = Field(default=None, ge=1, description="tasks, threads included")
    network: bool | None = Field(
        default=None, description="true: the node's network; unset or false: a network "
        "namespace that reaches nothing but the endpoint")
    isolate: bool | None = Field(
        default=None, description="default true: its own PID, mount and network namespaces "
        "and uid; false: the node's user and files (trusted programs only)")


class AgentEndpointOptions(_Options):
    """What one call and one episode may ask of the node's endpoint
    (``astraflow.raas.agent.server.EndpointLimits``)."""

    max_body_mb: float | None = Field(default=None, gt=0, description="default 8")
    max_n: int | None = Field(default=None, ge=1, description="default 16")
    max_tokens: int | None = Field(default=None, ge=1, description="default 4096")
    max_calls: int | None = Field(default=None, ge=1, description="concurrent calls of an "
                                  "episode, default 8")
    max_connections: int | None = Field(default=None, ge=1, description="default 256")


class AgentOptions(SamplingOptions):
    """``agent``: a user's agent program against the node's OpenAI-compatible endpoint
    (``astraflow.raas.workflows.agent``); the sampling options are a request's defaults."""

    command: str | list[str] | None = Field(
        default=None, description="the program as a command (python: the node's own)")
    function: str | None = Field(default=None, description="or as package.module:function")
    timeout_s: float | None = Field(default=None, gt=0, description="default 120")
    attempts: int | None = Field(default=None, ge=1, description="default 2")
    reward: str | dict[str, Any] | None = Field(
        default=None, description="scores the last assistant message of an untrusted "
        "program's episode (needed then), a trusted one's answer when it gives no reward")
    trusted: bool | None = Field(
        default=None, description="default false; true: the program sees the whole payload "
        "and the reward it reports for its episode counts")
    show: list[str] | None = Field(
        default=None, description="the payload keys an untrusted program gets, default "
        "prompt, messages, tools")
    limits: AgentLimitsOptions | None = None
    endpoint: AgentEndpointOptions | None = None
    resume: Literal["replay", "restart"] | None = Field(
        default=None, description="default replay: with an episodes topic, a task taken over "
        "from a node that died replays its episodes' logged calls; restart: starts them again")
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
    """The in-tree torch engine; each key overrides the node's flag of that name."""

    device: str | None = Field(default=None, description="default cpu (--device)")
    dtype: str | None = Field(default=None, description="default: as saved (--dtype)")
    prefix_cache_mib: float | None = Field(default=None, ge=0, description="default 256")


class VLLMEngineOptions(_Options):
    """vLLM in the node's process (``astraflow.raas.vllm_engine.VLLMOptions``)."""

    cpus: str | int | None = None
    kv_cache_gib: int | None = Field(default=None, ge=1, description="default 2")
    max_model_len: int | None = Field(default=None, ge=1)
    dtype: str | None = None
    enforce_eager: bool | None = None
    seed: int | None = None
    enable_prefix_caching: bool | None = None
    gpu_memory_utilization: float | None = Field(default=None, gt=0, le=1)
    max_num_seqs: int | None = Field(default=None, ge=1)
    enable_chunked_prefill: bool | None = None
    lora_mode: Literal["auto", "native", "merge"] | None = Field(
        default=None, description="a LoRA policy's adapters: native (vLLM's LoRA, a request "
        "per version) or merge (added into the weights, reloaded); default auto: merge on "
        "a CPU, native on a GPU")


class OpenAIEngineOptions(_Options):
    """An OpenAI-compatible server (``astraflow.raas.openai_engine.OpenAIOptions``)."""

    base_url: str = Field(min_length=1, description="the API root, e.g. http://host:8000/v1")
    model: str | None = None
    api_key: str | None = None
    timeout_s: float | None = Field(default=None, gt=0, description="default 600")
    version: int | None = Field(default=None, ge=0)
    reload: str | None = None


ENGINE_OPTIONS: dict[str, type[_Options]] = {
    "torch": TorchEngineOptions,
    "vllm": VLLMEngineOptions,
    "openai": OpenAIEngineOptions,
}


class VerifiersOptions(SamplingOptions):
    """``verifiers``: a verifiers environment's own rollout and rubric
    (``astraflow.raas.workflows.verifiers_env``); the sampling options are a request's
    defaults."""

    environment: str = Field(min_length=1, description="an installed environment's id or "
                             "package.module:function")
    args: dict[str, Any] | None = Field(default=None, description="the environment's "
                                        "arguments")
    timeout_s: float | None = Field(default=None, gt=0, description="default 300")
    attempts: int | None = Field(default=None, ge=1, description="default 2")
    endpoint: AgentEndpointOptions | None = None


class OpenEnvOptions(SamplingOptions):
    """``openenv``: an OpenEnv environment stepped by the policy
    (``astraflow.raas.workflows.openenv_env``)."""

    base_url: str | None = Field(default=None, min_length=1, description="a running "
                                 "environment server, e.g. http://host:8000")
    app: str | None = Field(default=None, min_length=1, description="or package.module:attr, "
                            "an OpenEnv app the node serves on localhost")
    reset: dict[str, Any] | None = Field(default=None, description="reset() arguments")
    action_field: str | None = Field(default=None, description="default message")
    observation_field: str | None = Field(default=None, description="default prompt")
    system_prompt: str | None = None
    max_turns: int | None = Field(default=None, ge=1, description="default 8")
    timeout_s: float | None = Field(default=None, gt=0, description="default 300")
    attempts: int | None = Field(default=None, ge=1, description="default 2")
    endpoint: AgentEndpointOptions | None = None

    @model_validator(mode="after")
    def _one_server(self) -> OpenEnvOptions:
        if (self.base_url is None) == (self.app is None):
            raise ValueError("openenv: name the server as base_url or app, one of them")
        return self


WORKFLOW_OPTIONS["verifiers"] = VerifiersOptions
WORKFLOW_OPTIONS["openenv"] = OpenEnvOptions
