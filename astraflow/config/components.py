"""Each component's effective configuration: its typed section of the topology with the
flags it was started with applied on top.

``trainer run -t FILE --policy P``, ``raas run -t FILE --pool P``, ``eval run -t FILE
--policy P`` and ``feeder run -t FILE`` each build their configuration here, from the
file and the flags they were given (``given``: dest -> value of the flags on the command
line, none of them defaults). ``astraflow up`` and the compose services start the
components with the file and their identity only, so every way of starting a component
runs the same configuration, and a flag only ever overrides the file.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pydantic import Field, ValidationError, field_validator, model_validator

from astraflow.config.options import check_reward
from astraflow.config.overrides import (
    EVAL_FLAGS,
    FEEDER_FLAGS,
    NODE_FLAGS,
    TRAINER_FLAGS,
    OverrideError,
    apply,
    apply_to,
)
from astraflow.config.sections import (
    ChatSpec,
    DatasetSpec,
    EvalSpec,
    FeederSpec,
    LoraSpec,
    PolicyEvalSpec,
    PolicySpec,
    PoolSpec,
    _Strict,
)
from astraflow.config.topology import Levels, Topology


def _given(given: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: v for k, v in (given or {}).items() if v is not None}


# --- the trainer ---------------------------------------------------------------------
def trainer_spec(topo: Topology, policy: str,
                 given: Mapping[str, Any] | None = None) -> PolicySpec:
    """The configuration of ``policy``'s trainer: the policy's section of ``topo``
    (``PolicySpec``: its model, sampling, ``max_staleness`` and ``trainer:``) with the
    ``trainer run`` flags of ``given`` applied. A policy the file does not declare takes
    the defaults, and needs ``--model``."""
    given = _given(given)
    spec = topo.policies.get(policy)
    if spec is None:
        if "model" not in given:
            raise OverrideError(f"policy {policy!r} is not declared in {topo.source}: give "
                                "its model with --model PATH (or declare it under policies:)")
        spec = PolicySpec(model=given["model"])
    return apply(spec, TRAINER_FLAGS, given)


# --- a RaaS node ---------------------------------------------------------------------
class NodeSettings(_Strict):
    """A RaaS node's configuration: its pool's section, the policies it serves and the
    workflow options it runs them with."""

    pool: str
    spec: PoolSpec  # the pool's section (the defaults for a pool the file lacks)
    models: dict[str, str]  # policy -> its model directory, for each policy served
    chats: dict[str, ChatSpec]  # the policies whose prompt format is set
    dtype: str | None = None  # every engine's dtype (None: as saved)
    # the LoRA policies served: their engines apply adapters on the model (models.lora)
    loras: dict[str, LoraSpec] = Field(default_factory=dict)
    engine: str
    engine_options: dict[str, Any] = Field(default_factory=dict)
    # workflow -> its keyword options: the policies' shared sampling under the file's
    # options, a --workflow-options flag's over both
    workflow_options: dict[str, dict[str, Any]] = Field(default_factory=dict)


def node_settings(topo: Topology, pool: str,
                  given: Mapping[str, Any] | None = None) -> NodeSettings:
    """The configuration of a node of ``pool``: the pool's section of ``topo`` and the
    topology's policies (their models, chat formats and shared dtype and sampling), with
    the ``raas run`` flags of ``given`` applied."""
    given = _given(given)
    base = topo.pools.get(pool) or PoolSpec()
    spec = apply(base, NODE_FLAGS, given)
    engine = given.get("engine") or base.engine
    options = dict(base.engine_options) if engine == base.engine else {}
    options.update(given.get("engine_options") or {})
    pairs = given.get("policy_model")
    models: dict[str, str] = {}
    for policy, path in pairs or [(p, s.model) for p, s in topo.policies.items()]:
        if policy in models:
            raise OverrideError(f"--policy-model: policy {policy!r} given twice")
        models[policy] = path
    if not models:
        raise OverrideError(f"{topo.source} declares no policies: give --policy-model "
                            "POLICY=PATH")
    chats = {p: topo.policies[p].chat for p in models
             if p in topo.policies and topo.policies[p].chat != ChatSpec()}
    for policy, chat in given.get("chat") or []:
        if policy not in models:
            raise OverrideError(f"--chat {policy}: no such --policy-model")
        try:
            chats[policy] = ChatSpec.model_validate(chat)
        except ValidationError as e:
            raise OverrideError(f"--chat {policy}: {e.errors()[0]['msg']}") from None
    dtypes = {p.dtype for p in topo.policies.values() if p.dtype}
    dtype = given.get("dtype") or (dtypes.pop() if len(dtypes) == 1 else None)
    sampling = topo.shared_sampling()
    workflows = {name: {**sampling, **typed.given()} for name, typed in spec.workflows.items()}
    for name, opts in given.get("workflow_options") or []:
        workflows[name] = {**workflows.get(name, {}), **opts}
    loras = {p: topo.policies[p].lora for p in models
             if p in topo.policies and topo.policies[p].lora is not None}
    return NodeSettings(pool=pool, spec=spec, models=models, chats=chats, dtype=dtype,
                        loras=loras, engine=engine, engine_options=options,
                        workflow_options=workflows)


# --- the evaluator -------------------------------------------------------------------
class EvalSettings(_Strict):
    """An evaluator's configuration: the topology's ``eval:`` with the policy's own
    ``eval:`` over it, and the policy's role, model, chat format and dtype."""

    policy: str
    model: str
    role: str = PolicySpec.model_fields["role"].default
    chat: ChatSpec | None = None  # None: the model's own (ChatFormat's default)
    dtype: str | None = None
    lora: LoraSpec | None = None  # a LoRA policy: its versions are adapters on the model
    every_versions: int = Field(default=EvalSpec.model_fields["every_versions"].default, ge=1)
    size: int = Field(default=EvalSpec.model_fields["size"].default, ge=1)
    max_new_tokens: int = Field(default=EvalSpec.model_fields["max_new_tokens"].default,
                                ge=1)
    levels: Levels = EvalSpec.model_fields["levels"].default
    dataset: DatasetSpec | None = None
    reward: str | dict[str, Any] | None = None
    blind: bool = False
    agreement: bool = False
    corrective: bool = False

    @field_validator("reward")
    @classmethod
    def _reward(cls, v: Any) -> Any:
        return check_reward(v)

    @model_validator(mode="after")
    def _judge(self) -> EvalSettings:
        judges = ("verifier", "selector")
        if self.blind and self.role not in judges:
            raise ValueError(f".blind: for role verifier or selector, not {self.role}")
        if self.corrective and self.role not in judges:
            raise ValueError(f".corrective: for role verifier or selector, not {self.role}")
        if self.corrective and self.blind:
            raise ValueError(".corrective: blind or corrective, not both")
        if self.agreement and not self.blind:
            raise ValueError(".agreement: needs blind")
        return self


def eval_settings(topo: Topology, policy: str,
                  given: Mapping[str, Any] | None = None) -> EvalSettings:
    """The configuration of ``policy``'s evaluator, with the ``eval run`` flags of
    ``given`` applied (the defaults of ``EvalSpec`` where the file has no ``eval:``)."""
    given = _given(given)
    spec = topo.policies.get(policy)
    ev = topo.eval or EvalSpec()
    own = spec.eval if spec is not None else PolicyEvalSpec()
    data: dict[str, Any] = {"policy": policy}
    if spec is not None:
        data.update(model=spec.model, role=spec.role, dtype=spec.dtype, lora=spec.lora,
                    chat=spec.chat if spec.chat != ChatSpec() else None)
    elif "model" not in given:
        raise OverrideError(f"policy {policy!r} is not declared in {topo.source}: give its "
                            "model with --model PATH (or declare it under policies:)")
    for name in ("every_versions", "size", "max_new_tokens", "levels"):
        value = getattr(own, name)
        data[name] = getattr(ev, name) if value is None else value
    data.update(dataset=ev.dataset, reward=ev.reward, blind=own.blind,
                agreement=own.agreement, corrective=own.corrective)
    if spec is None:
        data["model"] = given["model"]
    return apply_to(EvalSettings, data, EVAL_FLAGS, given)


# --- the feeder ----------------------------------------------------------------------
def feeder_spec(topo: Topology, given: Mapping[str, Any] | None = None) -> FeederSpec:
    """The feeder's configuration: the topology's ``feeder:`` (its defaults where the file
    has none) with the ``feeder run`` flags of ``given`` applied."""
    return apply(topo.feeder or FeederSpec(), FEEDER_FLAGS, _given(given))


__all__ = ["EvalSettings", "NodeSettings", "eval_settings", "feeder_spec", "node_settings",
           "trainer_spec"]
