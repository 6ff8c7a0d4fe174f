"""An assistant turn is rendered back exactly as it was sampled, without a broker: a
conversation the episode answered goes on from its sampled tokens (``chat.render_after``,
``EpisodeTrajectory.chat_prompt``), so a tool-calling conversation whose answers are
untidy (spaces around them, JSON spaced otherwise than ``json.dumps`` writes it) stays one
sequence; an edited history is rendered whole and starts a new one. With the tiny
tokenizer under a ChatML template, with no template, and with SmolLM2-135M-Instruct's
tokenizer and template through the endpoint and the ``openai`` client."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import pytest

from astraflow.models.chat import ChatFormat
from astraflow.raas.agent.chat import (
    check_messages,
    check_tools,
    parse_tool_calls,
    render,
    render_after,
)
from astraflow.raas.agent.trajectory import EpisodeTrajectory
from astraflow.raas.engine import Generation, SamplingParams

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = check_tools([{"type": "function", "function": {
    "name": "calculate", "parameters": {"type": "object", "properties": {
        "expression": {"type": "string"}}}}}])
# what a model wrote: spaces around it, its JSON spaced its own way
UNTIDY_CALL = ('  Let me compute.  <tool_call> {"name":"calculate",  "arguments":'
               '{"expression" : "37+45"}} </tool_call>\n ')
UNTIDY_ANSWER = "  82 "


def gen(tokens: list[int]) -> Generation:
    return Generation(prompt_ids=[], token_ids=list(tokens), logprobs=[-0.5] * len(tokens),
                      finish_reason="stop", versions=[1] * len(tokens))


def reply(text: str) -> dict[str, Any]:
    """The assistant message the endpoint returns for ``text`` (as chat_completion)."""
    content, calls = parse_tool_calls(text)
    message: dict[str, Any] = {"role": "assistant",
                               "content": (content or None) if calls else content}
    if calls:
        message["tool_calls"] = calls
    return message


def echoed(message: Mapping[str, Any]) -> dict[str, Any]:
    """The message as an OpenAI client sends it back (``model_dump(exclude_none=True)``)."""
    return {k: v for k, v in message.items() if v is not None}


def turn(t: EpisodeTrajectory, tok: Any, chat: ChatFormat, messages: list[dict[str, Any]],
         answer: list[int], tools=TOOLS) -> tuple[list[int], dict[str, Any]]:
    """One chat request as the endpoint serves it: its prompt, then ``answer`` sampled,
    recorded and remembered. Returns the prompt and the returned message."""
    checked = check_messages(messages)
    prompt = t.chat_prompt("actor", tok, chat, checked, tools)
    g = gen(answer)
    t.record("actor", prompt, [g])
    message = reply(tok.decode(answer, skip_special_tokens=True))
    t.remember("actor", checked, tools, prompt, [g], [message])
    return prompt, message


def sampled(seq) -> list[int]:
    return [x for x, m in zip(seq.token_ids, seq.loss_mask) if m]


@pytest.fixture
def chatml():
    from astraflow.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHATML
    return tok


def test_an_untidy_tool_calling_conversation_stays_one_sequence(chatml):
    tok, chat = chatml, ChatFormat()
    t = EpisodeTrajectory(sample_index=1)
    first = tok.encode(UNTIDY_CALL, add_special_tokens=False)
    history = [{"role": "user", "content": "What is 37+45?"}]
    p1, m1 = turn(t, tok, chat, history, first)
    assert p1 == render(tok, chat, check_messages(history), TOOLS)  # nothing to go on from
    history += [echoed(m1), {"role": "tool", "tool_call_id": m1["tool_calls"][0]["id"],
                             "content": "82"}]
    p2, m2 = turn(t, tok, chat, history, tok.encode(UNTIDY_ANSWER, add_special_tokens=False))
    # the answer as sampled, then the template's end of turn, the tool's message and the
    # generation prompt
    assert p2[:len(p1) + len(first)] == p1 + first
    assert tok.decode(p2[len(p1) + len(first):]) == (
        "<|im_end|>\n<|im_start|>tool\n82<|im_end|>\n<|im_start|>assistant\n")
    # the whole history rendered again writes the call with json.dumps, stripped: it would
    # not extend the first turn (the split this avoids)
    full = render(tok, chat, check_messages(history), TOOLS)
    assert full[:len(p1) + len(first)] != p1 + first
    (s,) = t.build(1.0)
    assert sampled(s) == first + tok.encode(UNTIDY_ANSWER, add_special_tokens=False)
    assert s.meta["turns"] == "2" and s.meta["episode"] == "1"
    assert (t.stats.requests, t.stats.extended, t.stats.started, t.stats.continued) == (
        2, 1, 1, 1)
    assert m2["content"] == UNTIDY_ANSWER


def test_an_edited_history_is_rendered_whole_and_starts_a_sequence(chatml):
    tok, chat = chatml, ChatFormat()
    t = EpisodeTrajectory(0)
    history = [{"role": "user", "content": "What is 37+45?"}]
    _, m1 = turn(t, tok, chat, history, tok.encode(UNTIDY_CALL, add_special_tokens=False))
    edited = {**echoed(m1), "content": "I will call a tool."}
    later = [*history, edited, {"role": "tool", "tool_call_id": "x", "content": "82"}]
    p2, _ = turn(t, tok, chat, later, tok.encode("82", add_special_tokens=False))
    assert p2 == render(tok, chat, check_messages(later), TOOLS)
    # other tools, or another policy, are another conversation too
    same = [*history, echoed(m1), {"role": "tool", "tool_call_id": "x", "content": "82"}]
    assert t.chat_prompt("actor", tok, chat, check_messages(same), None) == render(
        tok, chat, check_messages(same), None)
    assert t.chat_prompt("critic", tok, chat, check_messages(same), TOOLS) == render(
        tok, chat, check_messages(same), TOOLS)
    assert len(t.build(0.0)) == 2 and t.stats.continued == 0


def test_the_newest_answer_a_history_begins_with_is_the_one_continued(chatml):
    """Three turns: the third request goes on from the second answer (the longest
    conversation answered), and a branch of an n > 1 request from its own choice."""
    tok, chat = chatml, ChatFormat()
    t = EpisodeTrajectory(0)
    a1 = tok.encode(" 1 ", add_special_tokens=False)
    h = [{"role": "user", "content": "count"}]
    p1, m1 = turn(t, tok, chat, h, a1, tools=None)
    h += [echoed(m1), {"role": "user", "content": "more"}]
    p2, m2 = turn(t, tok, chat, h, tok.encode(" 2", add_special_tokens=False), tools=None)
    h += [echoed(m2), {"role": "user", "content": "again"}]
    p3, _ = turn(t, tok, chat, h, tok.encode("3", add_special_tokens=False), tools=None)
    assert p3[:len(p2) + 2] == p2 + tok.encode(" 2", add_special_tokens=False)
    (s,) = t.build(1.0)
    assert s.meta["turns"] == "3"
    # n = 2: the client goes on with the second choice
    checked = check_messages([{"role": "user", "content": "pick"}])
    prompt = t.chat_prompt("actor", tok, chat, checked, None)
    gens = [gen(tok.encode("a", add_special_tokens=False)),
            gen(tok.encode(" b ", add_special_tokens=False))]
    t.record("actor", prompt, gens)
    replies = [reply("a"), reply(" b ")]
    t.remember("actor", checked, None, prompt, gens, replies)
    nxt = check_messages([{"role": "user", "content": "pick"}, echoed(replies[1]),
                          {"role": "user", "content": "why"}])
    p = t.chat_prompt("actor", tok, chat, nxt, None)
    assert p[:len(prompt) + 3] == prompt + tok.encode(" b ", add_special_tokens=False)
    t.record("actor", p, [gen([5])])
    assert len(t.build(1.0)) == 3  # the first conversation, and the two choices of "pick"


def test_without_a_template_the_new_messages_follow_on_lines_of_their_own():
    from astraflow.models.tiny import build_tokenizer

    tok, chat = build_tokenizer(), ChatFormat()
    t = EpisodeTrajectory(0)
    h = [{"role": "user", "content": "37+45="}]
    p1, m1 = turn(t, tok, chat, h, tok.encode("82", add_special_tokens=False), tools=None)
    h += [echoed(m1), {"role": "user", "content": "sure?"}]
    p2, _ = turn(t, tok, chat, h, tok.encode("y", add_special_tokens=False), tools=None)
    assert tok.decode(p2) == "37+45=82\nsure?"
    assert len(t.build(1.0)) == 1


def test_a_template_that_does_not_continue_its_prompt_is_rendered_whole(chatml):
    """A template whose earlier prompt is not the start of the next conversation's text
    (here: the generation prompt is not how it opens an assistant turn) gets no
    continuation; the request is rendered whole."""
    tok = chatml
    tok.chat_template = ("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}ASSISTANT:{% endif %}")
    chat = ChatFormat()
    msgs = check_messages([{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "yo"},
                           {"role": "user", "content": "and?"}])
    assert render_after(tok, chat, [1, 2, 3], 2, msgs) is None
    t = EpisodeTrajectory(0)
    _, m1 = turn(t, tok, chat, msgs[:1], tok.encode("yo", add_special_tokens=False),
                 tools=None)
    assert t.chat_prompt("actor", tok, chat, msgs, None) == render(tok, chat, msgs)
    assert render_after(tok, chat, [], 2, msgs) is None  # nothing sampled
    assert render_after(tok, chat, [1], 1, msgs) is None  # no message before the answer


def test_a_generation_prompt_longer_than_a_history_turn_still_continues(chatml):
    """A template whose generation prompt opens an empty thinking block that it does not
    write before the answers of the history (as Qwen3's with thinking off): the answer
    was sampled after the whole generation prompt, and the conversation goes on from it."""
    tok = chatml
    tok.chat_template = CHATML.replace("<|im_start|>assistant\n{% endif %}",
                                       "<|im_start|>assistant\n<think></think>{% endif %}")
    chat = ChatFormat()
    t = EpisodeTrajectory(0)
    h = [{"role": "user", "content": "hi"}]
    p1, m1 = turn(t, tok, chat, h, tok.encode(" yo ", add_special_tokens=False), tools=None)
    assert tok.decode(p1).endswith("<|im_start|>assistant\n<think></think>")
    h += [echoed(m1), {"role": "user", "content": "and?"}]
    p2, _ = turn(t, tok, chat, h, tok.encode("ok", add_special_tokens=False), tools=None)
    assert tok.decode(p2) == tok.decode(p1) + (
        " yo <|im_end|>\n<|im_start|>user\nand?<|im_end|>\n<|im_start|>assistant\n"
        "<think></think>")
    assert len(t.build(1.0)) == 1


# --- SmolLM2-135M-Instruct's tokenizer and template, through the endpoint ------------------
class Scripted:
    """An engine that samples the given texts in turn, encoded by a real tokenizer and
    ended by its end-of-turn token: what the endpoint renders, parses and records is
    under test, not what a model would write."""

    def __init__(self, tokenizer: Any, answers: list[str]):
        self.tokenizer = tokenizer
        self.chat = ChatFormat()
        self.policy = "actor"
        self.eos_token_id = tokenizer.eos_token_id
        self.answers = list(answers)
        self.prompts: list[list[int]] = []

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams) -> list[list[Generation]]:
        out = []
        for p in prompts:
            self.prompts.append(list(p))
            ids = [*self.encode(self.answers.pop(0)), self.eos_token_id]
            out.append([Generation(prompt_ids=list(p), token_ids=ids,
                                   logprobs=[-0.25] * len(ids), finish_reason="stop",
                                   versions=[2] * len(ids))])
        return out


def test_smollm2_a_react_conversation_through_the_openai_client_stays_one_sequence(
        smollm2_dir):
    """react_calc's loop (the client sends back ``model_dump(exclude_none=True)`` of the
    message it got) on SmolLM2's tokenizer and template, with untidy answers: one
    sequence, whose trained tokens are exactly the sampled ones, each turn's prompt
    starting with the last turn's prompt and answer (its <|im_end|> once)."""
    from openai import OpenAI
    from transformers import AutoTokenizer

    from astraflow.raas.agent.server import AgentServer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    answers = [UNTIDY_CALL, ' <tool_call>{"name": "calculate", "arguments": {"expression":'
               ' "82*2"}}</tool_call>', UNTIDY_ANSWER]
    engine = Scripted(tok, answers)
    server = AgentServer()
    try:
        ep = server.open({"actor": engine}, 3, {"max_new_tokens": 64})
        client = OpenAI(base_url=server.base_url(ep), api_key="x", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "What is 37+45, twice?"}]
        for _ in range(4):
            r = client.chat.completions.create(model="actor", messages=messages,
                                               tools=[dict(t) for t in TOOLS])
            message = r.choices[0].message
            if not message.tool_calls:
                break
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls:
                expression = json.loads(call.function.arguments)["expression"]
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": str(eval(expression))})  # noqa: S307 - ours
        assert message.content == UNTIDY_ANSWER and not engine.answers
        (s,) = ep.trajectory.build(1.0)
        eos = tok.eos_token_id
        want = [t for a in answers for t in [*tok.encode(a, add_special_tokens=False), eos]]
        assert sampled(s) == want
        assert s.meta["turns"] == "3" and ep.trajectory.stats.continued == 2
        for before, after in zip(engine.prompts, engine.prompts[1:]):
            assert after[:len(before)] == before
        assert tok.decode(engine.prompts[1]).count("<|im_end|>\n<|im_start|>tool\n") == 1
        assert tok.decode(engine.prompts[2]).endswith(
            "<|im_end|>\n<|im_start|>tool\n164<|im_end|>\n<|im_start|>assistant\n")
        # what today's full rendering would have made of the second request: a split
        full = render(tok, ChatFormat(), check_messages(messages[:3]), TOOLS)
        assert full[:len(engine.prompts[1]) - 8] != engine.prompts[1][:-8]
    finally:
        server.stop()
