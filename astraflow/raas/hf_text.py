"""Text methods shared by engines that hold a Hugging Face tokenizer.

``HFText`` gives an engine with a ``tokenizer`` attribute the ``encode``, ``decode`` and
``eos_token_id`` of the ``Engine`` protocol, one convention for every engine (torch, vLLM,
an OpenAI-compatible server): no special tokens added when encoding, special tokens skipped
when decoding.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


class HFText:
    """Mixin: ``encode``/``decode``/``eos_token_id`` from ``self.tokenizer``."""

    tokenizer: Any

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(list(token_ids), skip_special_tokens=True)

    @property
    def eos_token_id(self) -> int | None:
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos


def load_tokenizer(path: str | Path) -> Any:
    """The tokenizer of a local model directory (no downloads); ``ModelError`` naming the
    path when the directory, its config or its tokenizer is missing."""
    from transformers import AutoTokenizer

    from astraflow.models.errors import ModelError

    p = Path(path)
    if not p.is_dir():
        raise ModelError(f"{p}: no such model directory")
    if not (p / "config.json").is_file():
        raise ModelError(f"{p}: no config.json here; not a Hugging Face model directory")
    try:
        return AutoTokenizer.from_pretrained(p, local_files_only=True)
    except Exception as e:  # noqa: BLE001 - rewrapped with the path
        raise ModelError(f"{p}: cannot load the tokenizer: {e}") from e


__all__ = ["HFText", "load_tokenizer"]
