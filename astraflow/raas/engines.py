"""Making a node's engines: the engine factory of ``raas run`` (``load_engine``) and the
check of an engine's options before anything is loaded (``check_engine_options``).

The engines themselves live beside this module: ``engine.py`` (the embedded torch
engine), ``vllm_engine.py`` and ``openai_engine.py``; vLLM is imported only when a node
asks for it.
"""

from __future__ import annotations

from typing import Any

from astraflow.config.components import NodeSettings

ENGINES = ("torch", "vllm", "openai")
TORCH_OPTIONS = ("device", "dtype", "prefix_cache_mib")


def check_engine_options(kind: str, options: dict[str, Any]) -> None:
    """``ValueError`` naming the first option ``kind``'s engine does not know (nothing is
    loaded or imported from vLLM here)."""
    if kind == "torch":
        for key in options:
            if key not in TORCH_OPTIONS:
                raise ValueError(f"unknown torch engine option {key!r} "
                                 f"(known: {', '.join(TORCH_OPTIONS)})")
    elif kind == "vllm":
        from astraflow.raas.vllm_engine import VLLMOptions

        VLLMOptions.from_dict(options)
    elif kind == "openai":
        from astraflow.raas.openai_engine import OpenAIOptions

        OpenAIOptions.from_dict(options)
    else:
        raise ValueError(f"unknown engine {kind!r} (known: {', '.join(ENGINES)})")


def load_engine(node: NodeSettings, policy: str, path: str) -> Any:
    """The engine of ``policy`` (its model at ``path``) as the node's settings say: its
    ``engine`` with its ``engine_options``, over which the pool's ``device``,
    ``prefix_cache_mib`` and the policies' ``dtype`` are defaults. A LoRA policy's adapter
    goes to the engine; the openai engine, which serves remote weights, refuses one
    (``ValueError``)."""
    opts = dict(node.engine_options)
    spec = node.loras.get(policy)
    lora = spec.model_dump() if spec is not None else None  # a LoRA policy's adapter
    if node.engine == "vllm":
        from astraflow.raas.vllm_engine import load_vllm_engine

        if node.dtype and "dtype" not in opts:
            opts["dtype"] = node.dtype
        return load_vllm_engine(path, policy, lora=lora, **opts)
    if node.engine == "openai":
        from astraflow.raas.openai_engine import load_openai_engine

        if lora is not None:
            raise ValueError(f"policy {policy} trains a LoRA adapter: the openai engine "
                             "serves remote weights it cannot apply it to (engine torch or "
                             "vllm)")
        return load_openai_engine(path, policy, **opts)
    from astraflow.raas.engine import load_torch_engine

    mib = float(opts.get("prefix_cache_mib", node.spec.prefix_cache_mib))
    return load_torch_engine(path, policy, device=opts.get("device", node.spec.device),
                             dtype=opts.get("dtype", node.dtype),
                             prefix_cache_bytes=int(mib * 2**20), lora=lora)


__all__ = ["ENGINES", "TORCH_OPTIONS", "check_engine_options", "load_engine"]
