"""Chat messages and tools to prompt token ids, and tool calls back out of generated text.

``render`` applies the policy's chat template (``astraflow.models.chat.ChatFormat``) to
OpenAI-format messages with ``add_generation_prompt``: the tokens the policy continues.
Tool definitions go to the template (``tools=``), which puts them where the model was
trained to read them; an assistant message's ``tool_calls`` are handed over with their
``arguments`` decoded from JSON, as Hugging Face templates expect, and ``tool`` messages
as they are. A tokenizer without a chat template (the tiny model) gets plain text, as
``ChatFormat.prompt_text`` makes it: the messages' contents, one per line.

A template that ignores tools (SmolLM2-135M's reads only ``role`` and ``content``) would
leave the model blind to them and drop its own earlier calls from the next prompt. For
such a template, ``render`` writes the tool definitions into the system message in the
Hermes form (``<tools>...</tools>`` and how to call one), and an assistant message's
calls into its content as ``<tool_call>`` blocks, so the model sees what it would see
under a template that has tools.

``render_after`` renders the next request of a conversation the policy has answered: the
tokens of the earlier prompt and of the answer exactly as sampled, then the template's
rendering of the messages after the answer alone. A re-rendered answer would not be the
sampled one: the client sends back the message the endpoint returned, whose tool calls
were parsed out of the text and whose content was stripped, and the template writes them
its own way; the trajectory would then no longer extend (``trajectory``).

``parse_tool_calls`` finds the calls a model wrote in the Hermes format that Qwen, SmolLM2
and most open chat models are trained on: ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, and returns them in the OpenAI format with the text around them.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from typing import Any

from astraflow.models.chat import ChatFormat

_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.S)


class MessageError(ValueError):
    """Messages, tools or a parameter the endpoint cannot use: a malformed call."""


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """The messages of a request, checked: a non-empty list of objects with a ``role``
    (``system``, ``user``, ``assistant`` or ``tool``) and a string ``content`` (an
    assistant message may have ``tool_calls`` instead)."""
    if not isinstance(messages, list) or not messages:
        raise MessageError("messages must be a non-empty list")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or m.get("role") not in ("system", "user", "assistant",
                                                                "tool"):
            raise MessageError(f"messages[{i}] needs a role: system, user, assistant or tool")
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text, joined
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, Mapping))
        if content is None and m["role"] != "assistant":  # an assistant's may be empty
            raise MessageError(f"messages[{i}] ({m['role']}) has no content")
        msg: dict[str, Any] = {"role": m["role"], "content": "" if content is None
                               else str(content)}
        if m.get("tool_calls"):
            msg["tool_calls"] = [_template_call(c, i) for c in m["tool_calls"]]
        for key in ("name", "tool_call_id"):
            if m.get(key) is not None:
                msg[key] = str(m[key])
        out.append(msg)
    return out


def _template_call(call: Any, i: int) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, Mapping) else None
    if not isinstance(fn, Mapping) or not fn.get("name"):
        raise MessageError(f"messages[{i}].tool_calls: each needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as e:
            raise MessageError(f"messages[{i}].tool_calls: arguments are not JSON ({e})") \
                from None
    return {"type": "function", "id": call.get("id"),
            "function": {"name": str(fn["name"]), "arguments": args}}


def render(tokenizer: Any, chat: ChatFormat, messages: list[dict[str, Any]],
           tools: Sequence[Mapping[str, Any]] | None = None) -> list[int]:
    """The prompt token ids of ``messages`` (checked by ``check_messages``) for a policy
    whose tokenizer and chat format are these."""
    if not chat.uses_template(tokenizer):  # as ChatFormat.prompt_text: the contents
        text = "\n".join(m["content"] for m in messages)
        return list(tokenizer.encode(text, add_special_tokens=False))
    ids = _apply(tokenizer, chat, messages, tools, tokenize=True)
    if isinstance(ids, Mapping):  # transformers 5 returns a BatchEncoding
        ids = ids["input_ids"]
    return [int(t) for t in ids]


# stands for a sampled answer in a rendering whose text around the answer is wanted: no
# whitespace or markup a template could trim or escape, nothing a conversation holds
_SAMPLED = "ASTRAFLOWSAMPLEDTURN7F3A"


def render_after(tokenizer: Any, chat: ChatFormat, sampled: list[int], known: int,
                 messages: list[dict[str, Any]],
                 tools: Sequence[Mapping[str, Any]] | None = None) -> list[int] | None:
    """The prompt ids of ``messages`` whose first ``known`` are a conversation the policy
    has already seen and answered: ``sampled``, the ids of that request's prompt and of the
    answer it sampled (``messages[known - 1]``, as the endpoint returned it), followed by
    the rendering of ``messages[known:]`` alone. The sampled answer keeps its tokens
    whatever the template would make of the message the client sent back (re-serialised
    tool calls, stripped text).

    With a chat template, the rest is the template's own text after the answer: the
    messages are rendered with a stand-in for the answer's content, and what follows the
    stand-in (the end of the assistant's turn, the new messages, the generation prompt) is
    encoded; an end-of-turn token the policy sampled is not repeated. None when the
    template does not render the conversation as the earlier prompt followed by the
    answer (the stand-in is not found once, or the text before it is not the start of the
    earlier prompt's): the caller renders the whole conversation. Without a template (plain lines,
    as ``render``), the rest is each new message's content on a line of its own."""
    if not 2 <= known <= len(messages) or not sampled:  # an answer follows a message
        return None
    if not chat.uses_template(tokenizer):
        rest = "".join("\n" + m["content"] for m in messages[known:])
        return [*sampled, *tokenizer.encode(rest, add_special_tokens=False)] if rest \
            else list(sampled)
    probe = [*messages[:known - 1], {"role": "assistant", "content": _SAMPLED},
             *messages[known:]]
    try:
        head = _apply(tokenizer, chat, messages[:known - 1], tools, tokenize=False)
        text = _apply(tokenizer, chat, probe, tools, tokenize=False)
    except MessageError:
        return None
    at = text.find(_SAMPLED)
    # the earlier prompt may hold more than the template writes before an answer of the
    # history (a generation prompt that opens an empty thinking block), never other text
    if at <= 0 or _SAMPLED in text[at + 1:] or not head.startswith(text[:at]):
        return None
    rest = text[at + len(_SAMPLED):]
    last = int(sampled[-1])
    if last in set(getattr(tokenizer, "all_special_ids", ()) or ()):
        marker = tokenizer.convert_ids_to_tokens(last)
        if isinstance(marker, str) and marker and rest.startswith(marker):
            rest = rest[len(marker):]  # the sampled end of turn closes the turn already
    return [*sampled, *tokenizer.encode(rest, add_special_tokens=False)]


def _apply(tokenizer: Any, chat: ChatFormat, messages: list[dict[str, Any]],
           tools: Sequence[Mapping[str, Any]] | None, tokenize: bool) -> Any:
    """The chat template applied to ``messages`` as ``render`` prepares them (the
    configured system prompt, tools and earlier calls in the text where the template has
    no place for them), with the generation prompt: token ids or text."""
    if chat.system_prompt is not None and (not messages or messages[0]["role"] != "system"):
        messages = [{"role": "system", "content": chat.system_prompt}, *messages]
    source = _template_source(tokenizer, chat)
    if tools and "tools" not in source:
        messages = _with_tools_in_system(messages, tools)
    if "tool_calls" not in source:
        messages = [_calls_in_content(m) for m in messages]
    try:
        return tokenizer.apply_chat_template(
            messages, tools=list(tools) if tools else None, add_generation_prompt=True,
            tokenize=tokenize, **dict(chat.options))
    except Exception as e:  # noqa: BLE001 - a template that cannot render these messages
        raise MessageError(f"the chat template cannot render these messages: {e}") from None


def _template_source(tokenizer: Any, chat: ChatFormat) -> str:
    """The chat template's text, as ``apply_chat_template`` would pick it."""
    template = dict(chat.options).get("chat_template") or tokenizer.chat_template or ""
    if isinstance(template, Mapping):  # named templates: the default one
        template = template.get("default", "")
    return str(template)


def tools_prompt(tools: Sequence[Mapping[str, Any]]) -> str:
    """The tool definitions and how to call one, in the Hermes form: for a system message
    under a template that has no place for tools."""
    listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    return ("You may call one or more functions to assist with the user query. The "
            f"functions are:\n<tools>\n{listed}\n</tools>\nTo call a function, write "
            '<tool_call>{"name": <function-name>, "arguments": <args-json-object>}'
            "</tool_call>")


def _with_tools_in_system(messages: list[dict[str, Any]],
                          tools: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    if messages[0]["role"] == "system":
        first = {**messages[0], "content": f"{messages[0]['content']}\n\n{tools_prompt(tools)}"}
        return [first, *messages[1:]]
    return [{"role": "system", "content": tools_prompt(tools)}, *messages]


def _calls_in_content(m: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's calls as the ``<tool_call>`` text the model writes them in."""
    if not m.get("tool_calls"):
        return m
    blocks = "".join(
        "<tool_call>" + json.dumps({"name": c["function"]["name"],
                                    "arguments": c["function"]["arguments"]}) + "</tool_call>"
        for c in m["tool_calls"])
    rest = {k: v for k, v in m.items() if k != "tool_calls"}
    return {**rest, "content": f"{m['content']}\n{blocks}" if m["content"] else blocks}


def check_tools(tools: Any) -> list[dict[str, Any]] | None:
    """OpenAI ``tools`` (function definitions), checked; None when absent."""
    if tools is None:
        return None
    if not isinstance(tools, list) or not all(
            isinstance(t, Mapping) and isinstance(t.get("function"), Mapping)
            and t["function"].get("name") for t in tools):
        raise MessageError("tools must be a list of {type: function, function: {name, ...}}")
    return [dict(t) for t in tools]


def parse_tool_calls(text: str) -> tuple[str, list[dict[str, Any]]]:
    """``(content, tool_calls)``: the text without its ``<tool_call>`` blocks, and each
    block that holds a JSON object with a ``name`` as an OpenAI tool call (``arguments`` a
    JSON string). A block that is not such an object stays in the content."""
    calls: list[dict[str, Any]] = []

    def take(m: re.Match[str]) -> str:
        try:
            obj = json.loads(m.group(1))
        except json.JSONDecodeError:
            return m.group(0)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            return m.group(0)
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append({"id": f"call_{uuid.uuid4().hex[:16]}", "type": "function",
                      "function": {"name": obj["name"],
                                   "arguments": args if isinstance(args, str)
                                   else json.dumps(args)}})
        return ""

    content = _CALL.sub(take, text)
    return (content.strip() if calls else content), calls


__all__ = ["MessageError", "check_messages", "check_tools", "parse_tool_calls", "render",
           "render_after", "tools_prompt"]
