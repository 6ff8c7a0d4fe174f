"""Prompt formats: how a task's prompt becomes the token ids a policy continues.

A task payload carries either ``prompt`` (a string) or ``messages`` (a list of
``{"role", "content"}`` chat messages). ``ChatFormat`` turns either into text with the
tokenizer's chat template when the policy's model has one (``template: auto``, the
default), or as plain text (the tiny character-level model has no template). A configured
``system_prompt`` is put first unless the messages bring their own; ``options`` go to the
template as keyword arguments (for example ``enable_thinking: false`` for Qwen3).

The same ``ChatFormat`` is used by RaaS engines and the evaluator, so the prompts a policy
is trained on and evaluated on are built the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from astraflow.errors import AstraflowError

TEMPLATE_MODES = ("auto", "on", "off")


class PromptError(AstraflowError, ValueError):
    """A payload that cannot be turned into a prompt (no prompt/messages, bad messages)."""


@dataclass(frozen=True)
class ChatFormat:
    """How one policy formats prompts.

    ``template``: ``auto`` (the chat template when the tokenizer has one), ``on`` (require
    one), ``off`` (plain text: messages are joined by newlines). ``system_prompt``: a
    system message put first (chat template only). ``options``: extra keyword arguments for
    ``apply_chat_template``.
    """

    template: str = "auto"
    system_prompt: str | None = None
    options: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.template not in TEMPLATE_MODES:
            raise ValueError(
                f"chat template: {self.template!r} is not one of {', '.join(TEMPLATE_MODES)}"
            )

    @classmethod
    def from_options(cls, value: Mapping[str, Any] | None) -> ChatFormat:
        """From a topology's ``chat:`` mapping; unknown keys fail naming the key."""
        value = dict(value or {})
        known = {"template", "system_prompt", "options"}
        unknown = sorted(set(value) - known)
        if unknown:
            raise ValueError(f"chat: unknown key {unknown[0]!r} (known: {sorted(known)})")
        return cls(
            template=str(value.get("template", "auto")),
            system_prompt=value.get("system_prompt"),
            options=dict(value.get("options") or {}),
        )

    def uses_template(self, tokenizer: Any) -> bool:
        has = bool(getattr(tokenizer, "chat_template", None))
        if self.template == "on" and not has:
            raise PromptError("chat template: 'on', but the model's tokenizer has none")
        return has and self.template != "off"

    def prompt_text(self, tokenizer: Any, payload: Mapping[str, Any]) -> str:
        """The text the policy continues for ``payload`` (template applied if in use)."""
        messages = payload_messages(payload)  # checks the payload in every mode
        if not self.uses_template(tokenizer):
            return "\n".join(str(m["content"]) for m in messages) if "messages" in payload \
                else str(payload["prompt"])
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": self.system_prompt}, *messages]
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True, **dict(self.options)
        )

    def prompt_ids(self, tokenizer: Any, payload: Mapping[str, Any]) -> list[int]:
        """Token ids of ``prompt_text`` (no special tokens added: the template has them)."""
        ids = list(tokenizer.encode(self.prompt_text(tokenizer, payload),
                                    add_special_tokens=False))
        if not ids:
            raise PromptError("prompt encodes to no tokens")
        return ids


def payload_messages(payload: Mapping[str, Any]) -> list[dict[str, str]]:
    """The chat messages of a payload: its ``messages``, or its ``prompt`` as one user
    message. Raises ``PromptError`` when neither is usable."""
    if "messages" in payload:
        msgs = payload["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise PromptError("payload 'messages' must be a non-empty list")
        out = []
        for i, m in enumerate(msgs):
            if not isinstance(m, Mapping) or "role" not in m or "content" not in m:
                raise PromptError(f"payload messages[{i}] needs 'role' and 'content'")
            out.append({"role": str(m["role"]), "content": str(m["content"])})
        return out
    if "prompt" not in payload:
        raise PromptError("payload has neither 'prompt' nor 'messages'")
    if not isinstance(payload["prompt"], str | int | float) or isinstance(payload["prompt"], bool):
        raise PromptError("payload 'prompt' must be a string or number")
    return [{"role": "user", "content": str(payload["prompt"])}]


def engine_chat(engine: Any) -> ChatFormat:
    """The ``ChatFormat`` an engine was given (``engine.chat``), else the default."""
    chat = getattr(engine, "chat", None)
    return chat if isinstance(chat, ChatFormat) else ChatFormat()


__all__ = ["TEMPLATE_MODES", "ChatFormat", "PromptError", "engine_chat", "payload_messages"]
