"""The trainer's model seam: what ``Trainer`` needs of the network it trains.

``Trainer`` (``astraflow.trainer.trainer``) owns everything around the model: batches,
advantages, the losses and off-policy corrections, micro-batching, the optimizer and its
fp32 masters, publishing (HF-named state rounded to ``publish_dtype``) and resume. A
``PolicyModel`` is the rest: the ``torch.nn.Module`` whose parameters are trained, its
logits, and the translation between its own state and the Hugging Face state that is
published and loaded. Two implementations:

- ``TorchPolicy`` (``trainer.backend: torch``): a transformers ``AutoModelForCausalLM``;
  its state is already HF-named; it can run a shared prompt once through a KV cache and
  checkpoint activations.
- ``LoraPolicy`` (a policy with ``lora:``): the same with peft adapters on the frozen
  model; its state is the adapter alone.
- ``MegatronPolicy`` (``trainer.backend: megatron``): a megatron-core ``GPTModel`` built
  from the HF config (``astraflow.trainer.megatron_model``), HF state mapped both ways.
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import torch

from astraflow.models.loading import check_model_dir, takes_logits_to_keep

BACKENDS = ("torch", "megatron")


@runtime_checkable
class PolicyModel(Protocol):
    """A trainable causal LM behind the trainer (see the module docstring)."""

    module: torch.nn.Module
    # whether ``shared_prompt_logits`` is available (a KV cache to repeat)
    shares_prompt: bool

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, start: int) -> torch.Tensor:
        """``[batch, n - start, vocab]`` logits at columns ``start..n-1`` of right-padded
        ``ids`` (``attn``: 1 on real tokens)."""
        ...

    def shared_prompt_logits(self, prompts: torch.Tensor, prompt_attn: torch.Tensor,
                             tails: torch.Tensor, tail_attn: torch.Tensor,
                             owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows that continue shared prompts, each prompt run once: ``prompts``
        ``[g, p]`` right-padded (``prompt_attn``: 1 on real tokens), ``tails`` ``[k, t]``
        the tokens of each row after its prompt, right-padded, ``owner`` ``[k]`` the index
        of each row's prompt. The logits at the last column of each row's prompt
        ``[k, 1, vocab]`` and at each column of its tail ``[k, t, vocab]``."""
        ...

    def named_state(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        """The module's own weights by its own names (parameters themselves with
        ``keep_vars``)."""
        ...

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """A ``named_state``-shaped state as Hugging Face names and layouts."""
        ...

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        """Copy a Hugging Face state (every weight) into the module."""
        ...

    def enable_checkpointing(self) -> None:
        """Recompute activations in the backward pass (``ValueError`` if unsupported)."""
        ...


def _dtype_kwarg(dtype: torch.dtype) -> dict[str, Any]:
    """``dtype=`` on transformers >= 4.56, ``torch_dtype=`` before."""
    import transformers

    try:
        major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    except ValueError:
        return {"dtype": dtype}
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def load_hf_model(model_path: str, dtype: torch.dtype) -> Any:
    """The Hugging Face causal LM of a local directory, in ``dtype`` (no tokenizer)."""
    from transformers import AutoModelForCausalLM

    check_model_dir(model_path, tokenizer=False)  # the trainer needs no tokenizer
    return AutoModelForCausalLM.from_pretrained(model_path, local_files_only=True,
                                                **_dtype_kwarg(dtype))


class TorchPolicy:
    """A transformers causal LM as the trainer's model (``trainer.backend: torch``)."""

    shares_prompt = True

    def __init__(self, model: Any):
        self.module = model
        self._keep_arg = takes_logits_to_keep(model)

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, start: int) -> torch.Tensor:
        n = ids.shape[1]
        kwargs: dict[str, Any] = {"use_cache": False}
        if self._keep_arg and start > 0:
            kwargs["logits_to_keep"] = n - start
        out = self.module(input_ids=ids, attention_mask=attn, **kwargs).logits
        return out[:, start:] if out.shape[1] == n else out

    def shared_prompt_logits(self, prompts: torch.Tensor, prompt_attn: torch.Tensor,
                             tails: torch.Tensor, tail_attn: torch.Tensor,
                             owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        width = prompts.shape[1]
        lengths = prompt_attn.sum(1)
        # logits only from the shortest prompt's last column on: every prompt ends there
        # or later
        keep = width - int(lengths.min()) + 1
        kwargs = {"logits_to_keep": keep} if self._keep_arg else {}
        head = self.module(input_ids=prompts, attention_mask=prompt_attn, use_cache=True,
                           **kwargs)
        last = head.logits[torch.arange(len(prompts), device=prompts.device),
                           lengths - 1 - (width - head.logits.shape[1])]
        cache = head.past_key_values
        # every row gets its prompt's keys and values (a differentiable index_select): the
        # gradient of a prompt is the sum of its rows'
        cache.reorder_cache(owner)
        # a tail's positions go on from its own prompt's end, past that prompt's padding,
        # which the attention mask hides
        positions = lengths[owner, None] + torch.arange(tails.shape[1], device=tails.device)
        tail = self.module(input_ids=tails, attention_mask=torch.cat(
            [prompt_attn[owner], tail_attn], dim=1), position_ids=positions,
            past_key_values=cache, use_cache=True).logits
        return last[owner, None], tail

    def named_state(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        return self.module.state_dict(keep_vars=keep_vars)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return state

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        self.module.load_state_dict(state, strict=True)

    def enable_checkpointing(self) -> None:
        _enable_checkpointing(self.module)


class LoraPolicy(TorchPolicy):
    """A transformers causal LM with LoRA adapters (peft, ``astraflow.models.lora``) as
    the trainer's model: the base is frozen, only the adapters train, and the state that
    is published and loaded is the adapter by peft's saved names. With ``dropout`` the
    adapters' dropout modules alone run in training mode (the rest stays in eval mode)."""

    def __init__(self, model: Any, settings: Any, seed: int = 0):
        from astraflow.models import lora

        self.base = model
        self.settings = settings
        super().__init__(lora.wrap(model, settings, seed))
        self._keep_arg = takes_logits_to_keep(model)  # peft's forward passes it on
        if settings.dropout > 0:
            for name, m in self.module.named_modules():
                if ".lora_dropout." in f"{name}.":
                    m.train()

    def named_state(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        from astraflow.models.lora import adapter_state

        return adapter_state(self.module, keep_vars=keep_vars)

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        from astraflow.models.lora import load_adapter

        load_adapter(self.module, state)

    def enable_checkpointing(self) -> None:
        _enable_checkpointing(self.base)


class MegatronPolicy:
    """A megatron-core ``GPTModel`` as the trainer's model (``trainer.backend:
    megatron``): built from the HF config, loaded and published through the HF mapping.
    Logits only from column ``start`` on (as ``logits_to_keep``); no shared prompt pass
    (no KV cache in training)."""

    shares_prompt = False

    def __init__(self, hf_config: Any, module: Any):
        self.hf_config = hf_config
        self.module = module

    @classmethod
    def from_hf(cls, model_path: str, dtype: torch.dtype, device: str) -> MegatronPolicy:
        """The model of a local HF Llama directory: checks (megatron-core, Python,
        architecture) first, each error naming its fix; then the weights through the
        mapping."""
        from transformers import AutoConfig

        from astraflow.trainer import megatron_model as mm

        check_model_dir(model_path, tokenizer=False)
        cfg = AutoConfig.from_pretrained(model_path, local_files_only=True)
        module = mm.build_model(cfg, dtype=dtype, device=device, initialize=False)
        hf = load_hf_model(model_path, dtype)
        mm.load_hf_state(module, hf.state_dict(), cfg)
        del hf
        return cls(cfg, module)

    @classmethod
    def from_module(cls, model: Any, dtype: torch.dtype, device: str) -> MegatronPolicy:
        """The megatron twin of a transformers Llama ``model`` (its config and weights)."""
        from astraflow.trainer import megatron_model as mm

        module = mm.build_model(model.config, dtype=dtype, device=device, initialize=False)
        mm.load_hf_state(module, {k: v.to(dtype) for k, v in model.state_dict().items()},
                         model.config)
        return cls(model.config, module)

    def logits(self, ids: torch.Tensor, attn: torch.Tensor, start: int) -> torch.Tensor:
        from astraflow.trainer.megatron_model import logits

        return logits(self.module, ids, start)

    def shared_prompt_logits(self, prompts: torch.Tensor, prompt_attn: torch.Tensor,
                             tails: torch.Tensor, tail_attn: torch.Tensor,
                             owner: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError("the megatron backend runs every prompt itself")

    def named_state(self, keep_vars: bool = False) -> dict[str, torch.Tensor]:
        from astraflow.trainer.megatron_model import weight_state

        return weight_state(self.module, keep_vars=keep_vars)

    def to_hf(self, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        from astraflow.trainer.megatron_model import megatron_to_hf

        return megatron_to_hf(state, self.hf_config)

    def load_hf(self, state: dict[str, torch.Tensor]) -> None:
        from astraflow.trainer.megatron_model import load_hf_state

        load_hf_state(self.module, state, self.hf_config)

    def enable_checkpointing(self) -> None:
        """Each transformer layer's forward under non-reentrant ``torch.utils.checkpoint``
        (ours, not megatron's recompute, whose ``CheckpointFunction`` saves CUDA RNG
        states): its activations are recomputed in the backward pass. The model stays in
        eval mode (no dropout), so the recomputation is the same computation."""
        from torch.utils.checkpoint import checkpoint

        for layer in self.module.decoder.layers:
            def forward(*args: Any, _forward: Any = layer.forward, **kwargs: Any) -> Any:
                if not torch.is_grad_enabled():
                    return _forward(*args, **kwargs)
                return checkpoint(_forward, *args, use_reentrant=False, **kwargs)

            layer.forward = forward


def make_policy_model(backend: str, model_path: str, dtype: torch.dtype,
                      device: str, model: Any = None) -> PolicyModel:
    """The ``PolicyModel`` of ``backend``: ``model`` when it is one; built around (torch)
    or from (megatron) ``model`` when that is a transformers model; else loaded from
    ``model_path``. Put on ``device`` in eval mode (no dropout: deterministic steps)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend (--backend) must be one of {BACKENDS}, got {backend!r}")
    if isinstance(model, PolicyModel):
        policy = model
    elif model is not None and backend == "megatron":
        policy = MegatronPolicy.from_module(model, dtype, device)
    elif model is not None:
        policy = TorchPolicy(model)
    elif backend == "megatron":
        policy = MegatronPolicy.from_hf(model_path, dtype, device)
    else:
        policy = TorchPolicy(load_hf_model(model_path, dtype))
    policy.module.to(torch.device(device))
    policy.module.eval()
    return policy


def _enable_checkpointing(model: Any) -> None:
    """Activation checkpointing on a model that stays in eval mode (no dropout).

    transformers checkpoints a layer only while ``layer.training`` is set, so that flag
    alone is set on the checkpointed layers; their submodules (attention, dropout) stay in
    eval mode. Non-reentrant ``torch.utils.checkpoint`` recomputes under the same autocast
    state and needs no input that requires grad.
    """
    if not getattr(model, "supports_gradient_checkpointing", False):
        raise ValueError(
            f"gradient_checkpointing (--gradient-checkpointing): {type(model).__name__} "
            "does not support it"
        )
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    layers = [m for m in model.modules() if getattr(m, "gradient_checkpointing", False) is True]
    if not layers:
        raise ValueError(
            f"gradient_checkpointing (--gradient-checkpointing): no checkpointed layer found "
            f"in {type(model).__name__}"
        )
    for m in layers:
        m.training = True


def preflight(backend: str, model_path: str, device: str = "cpu") -> None:
    """The start-up checks of ``backend`` that need no model loaded: for megatron the
    Python version, megatron-core (installed, the pinned version on a CPU) and the
    architecture (``MegatronUnavailable`` / ``UnsupportedArchitecture``, each naming its
    fix). Nothing for torch."""
    if backend != "megatron":
        return
    from transformers import AutoConfig

    from astraflow.trainer.megatron_shims import check_megatron

    check_megatron(cpu=torch.device(device).type == "cpu")
    from astraflow.trainer.megatron_model import check_supported

    check_supported(AutoConfig.from_pretrained(model_path, local_files_only=True))


__all__ = ["BACKENDS", "LoraPolicy", "MegatronPolicy", "PolicyModel", "TorchPolicy",
           "load_hf_model", "make_policy_model", "preflight"]
