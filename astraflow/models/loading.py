"""Loading any local Hugging Face causal LM (the tiny model, Qwen3, Llama, ...): offline
and local-files-only, with a ``ModelError`` that names what is missing."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from astraflow.models.errors import ModelError, one_line
from astraflow.models.precision import BEST, resolve_best

# any one of these makes a directory's tokenizer loadable (fast, sentencepiece, BPE, WordPiece)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def resolve_dtype(dtype: Any):
    """``dtype`` as ``from_pretrained`` takes it: None, a ``torch.dtype`` or ``"auto"``;
    names such as ``"bf16"`` are mapped, an unknown one is a ``ModelError``."""
    import torch

    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
    }
    if dtype == "auto":
        return "auto"
    if dtype not in names:
        raise ModelError(f"unknown dtype {dtype!r} (known: {sorted(names)}, 'auto' or "
                         f"'{BEST}' when loading a policy)")
    return names[dtype]


def check_model_dir(path: str | Path, tokenizer: bool = True) -> Path:
    """``path`` as a ``Path`` if it holds a Hugging Face model (with a tokenizer, unless
    ``tokenizer`` is false); else a ``ModelError`` naming what is missing (instead of the
    hub's "Repo id" error)."""
    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"{p}: no such model directory (create one with `astraflow model init` "
                         "or `astraflow model import`)")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p}: no config.json here; not a Hugging Face model directory")
    if tokenizer and not any((p / name).is_file() for name in TOKENIZER_FILES):
        raise ModelError(
            f"{p}: no tokenizer here (none of {', '.join(TOKENIZER_FILES)}); copy the "
            "model's tokenizer files next to its weights"
        )
    return p


def load_policy(path: str | Path, device: str = "cpu", dtype: Any = None):
    """Load a local Hugging Face causal LM and its tokenizer: ``(model, tokenizer)``.

    Works for the tiny model and for real checkpoints (Qwen3, Llama, ...). Offline and
    local-files-only; a missing directory or config raises ``ModelError``. The tokenizer
    gets a pad token (the end-of-sequence token) if it has none, and left padding.
    ``dtype``: None (as stored, float32 on CPU), a ``torch.dtype``, ``"bf16"``, ``"auto"``
    (transformers': as the config says), or ``"best"``: bf16 where ``device`` computes bf16
    natively, else float32 (``astraflow.models.precision``; the choice is logged).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    p = check_model_dir(path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - rewrapped with the path
        raise ModelError(f"{p}: cannot load the tokenizer: {one_line(e)}") from e
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token or tokenizer.unk_token
    tokenizer.padding_side = "left"
    kwargs: dict[str, Any] = {"local_files_only": True}
    dtype = resolve_best(dtype, device)
    resolved = resolve_dtype(dtype)
    if resolved is not None:
        kwargs["dtype"] = resolved
    try:
        model = AutoModelForCausalLM.from_pretrained(p, **kwargs)
    except Exception as e:  # noqa: BLE001
        raise ModelError(f"{p}: cannot load the model: {one_line(e)}") from e
    if model.generation_config.pad_token_id is None:
        model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.to(device)
    model.eval()
    return model, tokenizer


def takes_logits_to_keep(model: Any) -> bool:
    """Whether ``model.forward`` takes ``logits_to_keep`` (transformers >= 4.50), which
    computes the vocabulary projection for the last positions only."""
    import inspect

    try:
        return "logits_to_keep" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False


__all__ = ["TOKENIZER_FILES", "check_model_dir", "load_policy", "resolve_dtype",
           "takes_logits_to_keep"]
