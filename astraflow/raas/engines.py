"""Making a node's engines: the engine factory of ``raas run`` (``load_engine``).

Each engine's options are declared once, typed, with their defaults
(``astraflow.config.options``: ``TorchEngineOptions``, ``VLLMEngineOptions``,
``OpenAIEngineOptions``); ``astraflow.config.sections.engine_options`` checks a node's
before anything is loaded. The engines themselves live beside this module: ``engine.py``
(the embedded torch engine), ``vllm_engine.py`` and ``openai_engine.py``; vLLM is imported
only when a node asks for it.
"""

from __future__ import annotations

from typing import Any

from astraflow.config.components import NodeSettings
from astraflow.config.options import ENGINE_OPTIONS
from astraflow.config.sections import engine_options

ENGINES = tuple(ENGINE_OPTIONS)


def load_engine(node: NodeSettings, policy: str, path: str) -> Any:
    """The engine of ``policy`` (its model at ``path``) as the node's settings say: its
    ``engine`` with its typed ``engine_options`` (``ValueError`` naming a refused one),
    over which the pool's ``device``, ``prefix_cache_mib`` and the policies' ``dtype``
    are defaults. A LoRA policy's adapter goes to the engine; the openai engine, which
    serves remote weights, refuses one (``ValueError``)."""
    opts = engine_options(node.engine, node.engine_options)
    spec = node.loras.get(policy)
    lora = spec.model_dump() if spec is not None else None  # a LoRA policy's adapter
    if node.engine == "vllm":
        from astraflow.raas.vllm_engine import load_vllm_engine

        if node.dtype and "dtype" not in opts.model_fields_set:
            opts = opts.model_copy(update={"dtype": node.dtype})
        return load_vllm_engine(path, policy, lora=lora, options=opts)
    if node.engine == "openai":
        from astraflow.raas.openai_engine import load_openai_engine

        if lora is not None:
            raise ValueError(f"policy {policy} trains a LoRA adapter: the openai engine "
                             "serves remote weights it cannot apply it to (engine torch or "
                             "vllm)")
        return load_openai_engine(path, policy, options=opts)
    from astraflow.raas.engine import load_torch_engine

    mib = opts.prefix_cache_mib
    mib = node.spec.prefix_cache_mib if mib is None else mib
    return load_torch_engine(path, policy,
                             device=opts.device if opts.device is not None else node.spec.device,
                             dtype=opts.dtype if opts.dtype is not None else node.dtype,
                             prefix_cache_bytes=int(mib * 2**20), lora=lora)


__all__ = ["ENGINES", "load_engine"]
