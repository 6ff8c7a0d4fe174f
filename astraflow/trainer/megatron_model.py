"""A megatron-core ``GPTModel`` built from a Hugging Face Llama config, and the mapping of
its weights to and from Hugging Face names and layouts.

megatron-core has no Hugging Face converter; the mapping is written here, for the Llama
family (Llama 2/3 without RoPE scaling, SmolLM2: tied embeddings, grouped-query
attention). Per layer:

==========================================  ============================================
Hugging Face                                megatron (local layer spec)
==========================================  ============================================
``input_layernorm.weight``                  ``input_layernorm.weight``
``self_attn.{q,k,v}_proj.weight``           ``self_attention.linear_qkv.weight``: for
                                            each query group its query heads, then its
                                            key head, then its value head
``self_attn.o_proj.weight``                 ``self_attention.linear_proj.weight``
``post_attention_layernorm.weight``         ``pre_mlp_layernorm.weight``
``mlp.{gate,up}_proj.weight``               ``mlp.linear_fc1.weight`` = cat(gate, up)
``mlp.down_proj.weight``                    ``mlp.linear_fc2.weight``
==========================================  ============================================

and ``model.embed_tokens`` / ``embedding.word_embeddings``, ``model.norm`` /
``decoder.final_layernorm``, ``lm_head`` / ``output_layer`` (absent when the embeddings
are tied; the Hugging Face state then names the embedding twice, as transformers does).
Both directions only reshape, slice and concatenate: HF -> megatron -> HF is bit-exact.
"""

from __future__ import annotations

from typing import Any

import torch

from astraflow.trainer.megatron_shims import check_megatron, init_parallel

SUPPORTED_MODEL_TYPES = ("llama",)


class UnsupportedArchitecture(ValueError):
    """The Hugging Face model is not one the megatron mapping covers."""


def _rope_theta(cfg: Any) -> float:
    """The RoPE base, from ``rope_parameters`` (transformers 5) or ``rope_theta``;
    ``UnsupportedArchitecture`` for a scaled RoPE."""
    params = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in (None, "default"):
        raise UnsupportedArchitecture(
            f"trainer backend megatron: RoPE type {kind!r} is not mapped (only unscaled "
            "RoPE); use trainer.backend: torch for this model")
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def check_supported(cfg: Any) -> None:
    """``UnsupportedArchitecture`` naming the fix unless ``cfg`` (a Hugging Face config) is
    a Llama the mapping covers."""
    kind = getattr(cfg, "model_type", None)
    problems = []
    if kind not in SUPPORTED_MODEL_TYPES:
        problems.append(f"model_type {kind!r} (supported: {', '.join(SUPPORTED_MODEL_TYPES)})")
    else:
        if getattr(cfg, "hidden_act", "silu") != "silu":
            problems.append(f"hidden_act {cfg.hidden_act!r} (only silu)")
        for flag in ("attention_bias", "mlp_bias"):
            if getattr(cfg, flag, False):
                problems.append(f"{flag}=true (only bias-free layers)")
        if getattr(cfg, "pretraining_tp", 1) not in (None, 1):
            problems.append(f"pretraining_tp={cfg.pretraining_tp} (only 1)")
    if problems:
        raise UnsupportedArchitecture(
            "trainer backend megatron: unsupported model: " + "; ".join(problems)
            + "; use trainer.backend: torch for this model")
    _rope_theta(cfg)


def _head_dim(cfg: Any) -> int:
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def _kv_heads(cfg: Any) -> int:
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def transformer_config(cfg: Any, dtype: torch.dtype = torch.float32,
                       initialize: bool = True) -> Any:
    """megatron's ``TransformerConfig`` for the Hugging Face Llama config ``cfg``: RMSNorm,
    SwiGLU, grouped-query attention, no biases, no dropout, CPU initialization (random
    weights unless ``initialize`` is false: weights about to be loaded)."""
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=_kv_heads(cfg),
        kv_channels=_head_dim(cfg),
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        perform_initialization=initialize,
        params_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
    )


def build_model(cfg: Any, dtype: torch.dtype = torch.float32, device: str = "cpu",
                initialize: bool = True) -> Any:
    """A ``GPTModel`` (local layer spec, randomly initialised unless ``initialize`` is
    false) for the Hugging Face Llama config ``cfg``, on ``device``. Sets up megatron's
    one-process parallel state (and the CPU shims on a CPU); errors name the fix
    (``MegatronUnavailable``, ``UnsupportedArchitecture``)."""
    dev = torch.device(device)
    cpu = dev.type == "cpu"
    check_megatron(cpu=cpu)
    check_supported(cfg)
    if dev.type == "cuda" and dev.index is not None:
        torch.cuda.set_device(dev)  # megatron allocates on the current device
    init_parallel(cpu)
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.models.gpt.gpt_model import GPTModel

    model = GPTModel(
        config=transformer_config(cfg, dtype, initialize),
        transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=cfg.vocab_size,
        max_sequence_length=cfg.max_position_embeddings,
        share_embeddings_and_output_weights=bool(getattr(cfg, "tie_word_embeddings", False)),
        position_embedding_type="rope",
        rotary_base=_rope_theta(cfg),
    )
    return model.to(device=device, dtype=dtype)


def _layer_names(i: int) -> dict[str, str]:
    """HF name -> megatron name of the tensors of layer ``i`` mapped one to one."""
    hf, mg = f"model.layers.{i}.", f"decoder.layers.{i}."
    return {
        hf + "input_layernorm.weight": mg + "input_layernorm.weight",
        hf + "self_attn.o_proj.weight": mg + "self_attention.linear_proj.weight",
        hf + "post_attention_layernorm.weight": mg + "pre_mlp_layernorm.weight",
        hf + "mlp.down_proj.weight": mg + "mlp.linear_fc2.weight",
    }


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: int) -> torch.Tensor:
    """``[q heads of group 0, k_0, v_0, q heads of group 1, ...]`` stacked on dim 0."""
    h = q.shape[-1]
    parts = (q.reshape(groups, -1, h), k.reshape(groups, -1, h), v.reshape(groups, -1, h))
    return torch.cat(parts, dim=1).reshape(-1, h)


def _split_qkv(qkv: torch.Tensor, cfg: Any) -> tuple[torch.Tensor, ...]:
    """The inverse of ``_fuse_qkv``: HF's ``(q, k, v)`` projections."""
    d, g = _head_dim(cfg), _kv_heads(cfg)
    per_group = cfg.num_attention_heads // g * d
    h = qkv.shape[-1]
    grouped = qkv.reshape(g, per_group + 2 * d, h)
    q, k, v = grouped.split([per_group, d, d], dim=1)
    return q.reshape(-1, h), k.reshape(-1, h), v.reshape(-1, h)


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The megatron state of the Hugging Face state ``hf`` (tensor names and layouts of
    ``LlamaForCausalLM``)."""
    out = {"embedding.word_embeddings.weight": hf["model.embed_tokens.weight"]}
    for i in range(cfg.num_hidden_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        out.update({dst: hf[src] for src, dst in _layer_names(i).items()})
        out[mp + "self_attention.linear_qkv.weight"] = _fuse_qkv(
            hf[hp + "self_attn.q_proj.weight"], hf[hp + "self_attn.k_proj.weight"],
            hf[hp + "self_attn.v_proj.weight"], _kv_heads(cfg))
        out[mp + "mlp.linear_fc1.weight"] = torch.cat(
            [hf[hp + "mlp.gate_proj.weight"], hf[hp + "mlp.up_proj.weight"]], dim=0)
    out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
    if not getattr(cfg, "tie_word_embeddings", False):
        out["output_layer.weight"] = hf["lm_head.weight"]
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: Any) -> dict[str, torch.Tensor]:
    """The Hugging Face state (``LlamaForCausalLM`` names and layouts, in its order) of
    the megatron state ``mg``; with tied embeddings ``lm_head.weight`` is the embedding
    tensor itself, as in transformers' own state dict. Slices are views of ``mg``'s
    tensors (the fused Q/K/V and gate/up split without copying)."""
    embed = mg["embedding.word_embeddings.weight"]
    out = {"model.embed_tokens.weight": embed}
    for i in range(cfg.num_hidden_layers):
        hp, mp = f"model.layers.{i}.", f"decoder.layers.{i}."
        one = {src: mg[dst] for src, dst in _layer_names(i).items()}
        q, k, v = _split_qkv(mg[mp + "self_attention.linear_qkv.weight"], cfg)
        gate, up = mg[mp + "mlp.linear_fc1.weight"].chunk(2, dim=0)
        out.update({
            hp + "self_attn.q_proj.weight": q,
            hp + "self_attn.k_proj.weight": k,
            hp + "self_attn.v_proj.weight": v,
            hp + "self_attn.o_proj.weight": one[hp + "self_attn.o_proj.weight"],
            hp + "mlp.gate_proj.weight": gate,
            hp + "mlp.up_proj.weight": up,
            hp + "mlp.down_proj.weight": one[hp + "mlp.down_proj.weight"],
            hp + "input_layernorm.weight": one[hp + "input_layernorm.weight"],
            hp + "post_attention_layernorm.weight": one[hp + "post_attention_layernorm.weight"],
        })
    out["model.norm.weight"] = mg["decoder.final_layernorm.weight"]
    tied = getattr(cfg, "tie_word_embeddings", False)
    out["lm_head.weight"] = embed if tied else mg["output_layer.weight"]
    return out


def weight_state(model: Any, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """The model's state without megatron's ``_extra_state`` entries (serialization
    metadata of TransformerEngine layers, no weights)."""
    return {k: v for k, v in model.state_dict(keep_vars=keep_vars).items()
            if not k.endswith("_extra_state")}


def load_hf_state(model: Any, hf: dict[str, torch.Tensor], cfg: Any) -> None:
    """Copy the Hugging Face state ``hf`` into ``model`` (every weight, nothing else)."""
    mine = weight_state(model)
    state = hf_to_megatron(hf, cfg)
    missing, unexpected = sorted(set(mine) - set(state)), sorted(set(state) - set(mine))
    if missing or unexpected:
        raise ValueError(f"megatron state mapping: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]}")
    model.load_state_dict(state, strict=False)


def logits(model: Any, ids: torch.Tensor, start: int = 0) -> torch.Tensor:
    """``[batch, seq - start, vocab]`` logits of causal LM ``model`` at columns
    ``start..seq-1`` of right-padded ``ids`` (positions 0..seq-1; padding after a sequence
    does not change its logits). Only those columns go through the output layer (the
    vocabulary projection), like transformers' ``logits_to_keep``: a forward pre-hook on
    ``output_layer`` cuts its ``[seq, batch, hidden]`` input."""
    from astraflow.trainer.megatron_shims import causal_mask

    n = ids.shape[1]
    positions = torch.arange(n, device=ids.device).expand(ids.shape[0], -1)
    handle = None
    if start > 0:
        def keep(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
            if args:
                return (args[0][start:], *args[1:]), kwargs
            return args, {**kwargs, "input_": kwargs["input_"][start:]}

        handle = model.output_layer.register_forward_pre_hook(keep, with_kwargs=True)
    try:
        out = model(input_ids=ids, position_ids=positions,
                    attention_mask=causal_mask(n, ids.device))
    finally:
        if handle is not None:
            handle.remove()
    return out[:, start:] if out.shape[1] == n else out


__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "UnsupportedArchitecture",
    "build_model",
    "check_supported",
    "hf_to_megatron",
    "load_hf_state",
    "logits",
    "megatron_to_hf",
    "transformer_config",
    "weight_state",
]
