"""A LoRA policy's adapter settings (``lora:``), declared once: the topology validates them
here, the trainer, engines and evaluator take them as they are, and every manifest of the
policy carries them (``LoraSpec.to_json``), from which ``astraflow.models.lora`` rebuilds the
same adapter without the topology. Torch-free and small, so models can import it alone."""

from __future__ import annotations

import json

from pydantic import BaseModel, ConfigDict, Field

# the attention and MLP projections of Llama-family models
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class LoraSpec(BaseModel):
    """A LoRA policy (``astraflow.models.lora``): the trainer trains only these adapters,
    with peft, on the frozen base model; ``weights.<policy>`` carries the adapter, whole or
    as a sparse delta, whichever is smaller; engines apply each version in place."""

    model_config = ConfigDict(extra="forbid")

    rank: int = Field(default=16, ge=1, description="the adapters' rank r")
    alpha: float = Field(default=32.0, gt=0, description="the update is scaled by alpha / "
                         "rank")
    dropout: float = Field(default=0.0, ge=0, lt=1, description="dropout on the adapters' "
                           "input in the trainer's passes (seeded by the step: a replay "
                           "repeats it); 0: none, the log-probs are the engines' own")
    target_modules: list[str] = Field(
        default_factory=lambda: list(LORA_TARGETS), min_length=1,
        description="the adapted linear modules, by the end of their names (peft's "
        "matching); default: the attention and MLP projections of Llama-family models")

    @property
    def scale(self) -> float:
        """What the adapter's update ``B @ A`` is multiplied by: ``alpha / rank``."""
        return self.alpha / self.rank

    def to_json(self) -> str:
        """Canonical JSON (sorted keys): a LoRA manifest's ``meta["lora"]``, from which a
        reader without the topology rebuilds the same adapter (``from_json``)."""
        return json.dumps(self.model_dump(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        """The settings ``to_json`` wrote (``ValueError`` naming the key when malformed)."""
        return cls.model_validate_json(text)


__all__ = ["LORA_TARGETS", "LoraSpec"]
