"""LoRA adapters on a frozen base model, with peft: one definition for the trainer, the
engines, the evaluator and ``model export``.

A policy with ``lora:`` (``astraflow.config.lora.LoraSpec``) trains only the adapter
matrices of its ``target_modules``; its published weights (``weights.<policy>``) are the
adapter alone, by the names of peft's ``adapter_model.safetensors``
(``base_model.model.<module path>.lora_A.weight`` and ``.lora_B.weight``), and every
manifest carries the adapter's settings in ``meta["lora"]`` (``LoraSpec.to_json``), so a
reader without the topology (``model export``, replay) rebuilds the same adapter. The
base model is the policy's model directory, which every trainer, node and evaluator has.

Applying a version: ``load_published`` copies an adapter state into a peft model in place
(no new module, no restart); ``merged`` adds ``alpha / rank * B @ A`` to each adapted base
weight, for engines that take full weights (vLLM without LoRA, ``export --merge``).
Importing this module imports neither torch nor peft. An adapter's settings are the
topology's own ``LoraSpec``, here and in every manifest.

Serving precision: the trainer computes the adapter's update on its fp32 base, in fp32.
Early in training that update moves an adapted layer's output (or its merged weight) by
far less than one bf16 step, so an engine that rounds either to bf16 (a bf16 model with
the adapter applied at forward time, or a merged weight cast to bf16) serves close to the
base model while the trainer computes with the adapter. Engines serve a LoRA policy in
``SERVING_DTYPE`` (``serving_dtype``): the torch engine applies the adapter at forward time
on an fp32 model, vLLM's ``merge`` mode keeps the merged weights in fp32 and serves fp32.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from astraflow.config.lora import LoraSpec

if TYPE_CHECKING:
    import torch

META_KEY = "lora"  # the manifest meta entry with the adapter's settings
SERVING_DTYPE = "float32"  # what an engine computes a LoRA policy in (module docstring)
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name
# a parameter's name in the peft model -> its name in the adapter file (peft drops the
# adapter's own name, "default")
_ADAPTER_NAME = re.compile(r"\.(lora_[AB])\.default\.")
_SAVED = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])\.weight$")


def settings_of(meta: Mapping[str, str]) -> LoraSpec | None:
    """The adapter settings a manifest's ``meta`` records; None for full weights."""
    text = meta.get(META_KEY)
    return LoraSpec.from_json(text) if text else None


def peft_config(s: LoraSpec) -> Any:
    from peft import LoraConfig

    return LoraConfig(r=s.rank, lora_alpha=s.alpha, lora_dropout=s.dropout,
                      target_modules=list(s.target_modules), bias="none",
                      task_type="CAUSAL_LM")


def wrap(model: Any, s: LoraSpec, seed: int = 0) -> Any:
    """``model`` (a transformers causal LM) with a fresh adapter: ``lora_B`` zero (the
    model computes exactly what the base does), ``lora_A`` drawn from ``seed`` so every
    process that wraps the same base gets the same version-0 adapter. The base's
    parameters are frozen; the module keeps the base's mode (eval) and device."""
    import torch
    from peft import get_peft_model

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        wrapped = get_peft_model(model, peft_config(s))
    wrapped.train(model.training)
    return wrapped


def is_wrapped(model: Any) -> bool:
    """Whether ``model`` carries a peft adapter."""
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def saved_name(param_name: str) -> str:
    """A peft model's parameter name as peft saves it (the adapter name dropped)."""
    return _ADAPTER_NAME.sub(r".\1.", param_name)


def adapter_state(model: Any, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The adapter of a wrapped model by saved names (the parameters themselves with
    ``keep_vars``, else detached), in the model's order."""
    return {saved_name(n): (p if keep_vars else p.detach())
            for n, p in model.named_parameters() if "lora_" in n}


def load_adapter(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """Copy an adapter state (saved names) into a wrapped model in place; ``ValueError``
    naming what does not fit (a missing or unknown name, a shape)."""
    import torch

    mine = adapter_state(model, keep_vars=True)
    missing, unknown = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unknown:
        raise ValueError(f"the adapter does not fit the model: missing {missing[:3]}, "
                         f"unknown {unknown[:3]} (of {len(missing)}, {len(unknown)})")
    with torch.no_grad():
        for k, p in mine.items():
            v = state[k]
            if tuple(v.shape) != tuple(p.shape):
                raise ValueError(f"adapter tensor {k} has shape {tuple(v.shape)}, the model's "
                                 f"is {tuple(p.shape)} (another rank or model?)")
            p.copy_(v)


def load_published(model: Any, state: Mapping[str, torch.Tensor]) -> None:
    """A published version into ``model``: the adapter in place when the model is wrapped,
    else the full weights (``load_state_dict``, tied weights may be absent)."""
    if is_wrapped(model):
        load_adapter(model, state)
        return
    result = model.load_state_dict(dict(state), strict=False)
    tied = set(getattr(model, "_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied]
    if missing or result.unexpected_keys:
        raise ValueError(f"the state does not fit the model (missing {missing[:5]}, "
                         f"unexpected {result.unexpected_keys[:5]})")


def adapted_weights(adapter: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Each adapted base weight (its Hugging Face name) -> the names of its ``lora_A`` and
    ``lora_B`` in ``adapter``; ``ValueError`` for a name that is not an adapter matrix or
    a module with one matrix only."""
    parts: dict[str, dict[str, str]] = {}
    for name in adapter:
        m = _SAVED.match(name)
        if m is None:
            raise ValueError(f"{name} is not a LoRA matrix of peft's saved format")
        parts.setdefault(m["module"], {})[m["which"]] = name
    half = sorted(k for k, v in parts.items() if len(v) != 2)
    if half:
        raise ValueError(f"the adapter has only one of lora_A/lora_B for {half[:3]}")
    return {f"{k}.weight": (v["A"], v["B"]) for k, v in parts.items()}


def serving_dtype(requested: str | None) -> tuple[str, str | None]:
    """The dtype an engine computes a LoRA policy in, for its configured ``requested``
    (None: as stored): ``SERVING_DTYPE`` whatever was asked, and why when that is not what
    was asked (see the module docstring), for the engine to log."""
    if requested in (SERVING_DTYPE, "fp32"):
        return SERVING_DTYPE, None
    return SERVING_DTYPE, (f"dtype {requested or 'as stored'} -> {SERVING_DTYPE}: a LoRA "
                           "policy is served as the trainer computes it (fp32), since a "
                           "16-bit model rounds away the adapter's early updates")


def merged(base: Mapping[str, torch.Tensor], adapter: Mapping[str, torch.Tensor],
           s: LoraSpec, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """The adapted base weights with the adapter added, ``W + alpha/rank * B @ A`` computed
    in fp32 and cast to ``dtype`` (None: W's dtype, where a bf16 W rounds away an update
    below half its step), by Hugging Face name (only the adapted weights)."""
    out = {}
    for name, (a, b) in adapted_weights(adapter).items():
        if name not in base:
            raise ValueError(f"the adapter adapts {name}, which the base model lacks")
        w = base[name]
        delta = adapter[b].float() @ adapter[a].float()
        out[name] = (w.float() + s.scale * delta.to(w.device)).to(dtype or w.dtype)
    return out


def write_adapter(state: Mapping[str, torch.Tensor], s: LoraSpec, base: str | Path,
                  path: str | Path) -> Path:
    """``state`` (an adapter by saved names) as a peft adapter directory over the model at
    ``base`` (``adapter_config.json``, ``adapter_model.safetensors``): what
    ``PeftModel.from_pretrained`` and vLLM's ``LoRARequest`` load."""
    from safetensors.torch import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    config = peft_config(s)
    config.base_model_name_or_path = str(Path(base).resolve())
    config.save_pretrained(str(path))
    save_file({k: v.detach().contiguous() for k, v in state.items()},
              str(path / ADAPTER_WEIGHTS), metadata={"format": "pt"})
    return path


__all__ = ["ADAPTER_WEIGHTS", "META_KEY", "adapted_weights", "adapter_state",
           "is_wrapped", "load_adapter", "load_published", "merged", "peft_config",
           "SERVING_DTYPE", "saved_name", "serving_dtype", "settings_of", "wrap",
           "write_adapter"]
