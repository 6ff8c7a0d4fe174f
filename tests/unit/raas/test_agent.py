"""The agent workflow's parts without a broker: token-exact stitching, chat rendering and
tool-call parsing, the OpenAI-compatible endpoint over HTTP (with the `openai` client) on a
real tiny engine, the program runner's outcomes, and whole tasks through the workflow."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from astraflow.models.chat import ChatFormat
from astraflow.raas.agent.chat import MessageError, check_messages, parse_tool_calls, render
from astraflow.raas.agent.program import Access, AgentProgram, Limits
from astraflow.raas.agent.trajectory import EpisodeTrajectory
from astraflow.raas.engine import Generation, SamplingParams
from astraflow.raas.workflows.base import TaskError
from astraflow.wire.records import Task


def gen(tokens: list[int], version: int = 3) -> Generation:
    return Generation(prompt_ids=[], token_ids=tokens, logprobs=[-0.5] * len(tokens),
                      finish_reason="stop", versions=[version] * len(tokens))


# --- stitching ------------------------------------------------------------------------------
def test_turns_that_extend_a_conversation_become_one_sequence_with_the_rest_masked():
    t = EpisodeTrajectory(sample_index=2)
    t.record("actor", [1, 2, 3], [gen([10, 11])])
    t.record("actor", [1, 2, 3, 10, 11, 7, 8], [gen([12], version=4)])  # tool output 7, 8
    (s,) = t.build(1.0)
    assert s.token_ids == [1, 2, 3, 10, 11, 7, 8, 12]
    assert s.loss_mask == [0, 0, 0, 1, 1, 0, 0, 1]
    assert s.logprobs == [0.0, 0.0, 0.0, -0.5, -0.5, 0.0, 0.0, -0.5]
    assert s.versions == [-1, -1, -1, 3, 3, -1, -1, 4]
    assert s.sample_index == 2 and s.reward == 1.0 and s.meta["turns"] == "2"


def test_a_prompt_that_does_not_extend_the_sampled_tokens_starts_a_new_sequence():
    t = EpisodeTrajectory(0)
    t.record("actor", [1, 2, 3], [gen([10, 11])])
    # the template rendered the answer as 10, 99 (not what was sampled): no re-tokenising
    t.record("actor", [1, 2, 3, 10, 99, 7], [gen([12])])
    a, b = t.build(0.5)
    assert a.token_ids == [1, 2, 3, 10, 11] and b.token_ids == [1, 2, 3, 10, 99, 7, 12]
    assert b.loss_mask == [0] * 6 + [1]
    assert (t.stats.requests, t.stats.extended, t.stats.started) == (2, 0, 2)


def test_policies_keep_their_own_sequences_and_rewards_and_n_choices_branch():
    t = EpisodeTrajectory(0)
    t.record("solver", [1, 2], [gen([5])])
    t.record("critic", [1, 2, 5, 9], [gen([6])])  # extends no solver sequence: its own
    t.record("solver", [1, 2, 5, 4], [gen([7]), gen([8])])  # n = 2
    seqs = t.build({"solver": 1.0, "critic": 0.0})
    by = {(s.policy, tuple(s.token_ids)): s for s in seqs}
    assert set(by) == {("solver", (1, 2, 5, 4, 7)), ("critic", (1, 2, 5, 9, 6)),
                       ("solver", (1, 2, 5, 4, 8))}
    branch = by[("solver", (1, 2, 5, 4, 8))]
    assert branch.loss_mask == [0, 0, 0, 0, 1]  # the first answer is trained once, not twice
    assert by[("solver", (1, 2, 5, 4, 7))].loss_mask == [0, 0, 1, 0, 1]
    assert {s.policy: s.reward for s in seqs} == {"solver": 1.0, "critic": 0.0}


# --- chat ------------------------------------------------------------------------------------
def test_tool_calls_are_parsed_from_the_hermes_format_and_bad_blocks_stay_text():
    text = ('Let me compute.<tool_call>{"name": "calculate", "arguments": {"expression": '
            '"3*4"}}</tool_call>')
    content, calls = parse_tool_calls(text)
    assert content == "Let me compute."
    assert calls[0]["function"] == {"name": "calculate", "arguments": '{"expression": "3*4"}'}
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert parse_tool_calls("<tool_call>not json</tool_call>") == (
        "<tool_call>not json</tool_call>", [])
    assert parse_tool_calls("just 82") == ("just 82", [])


def test_messages_are_checked_and_rendered_with_the_template_or_as_plain_lines():
    from astraflow.models.tiny import build_tokenizer

    with pytest.raises(MessageError, match="non-empty list"):
        check_messages([])
    with pytest.raises(MessageError, match=r"messages\[0\] needs a role"):
        check_messages([{"role": "robot", "content": "x"}])
    with pytest.raises(MessageError, match="arguments are not JSON"):
        check_messages([{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c", "function": {"name": "f", "arguments": "{oops"}}]}])
    with pytest.raises(MessageError, match=r"messages\[1\] \(user\) has no content"):
        check_messages([{"role": "assistant", "content": None}, {"role": "user"}])
    msgs = check_messages([{"role": "user", "content": "37+45="}])
    tok = build_tokenizer()  # no chat template: the contents, as single_turn prompts
    assert render(tok, ChatFormat(), msgs) == tok.encode("37+45=", add_special_tokens=False)


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TOOLS = [{"type": "function", "function": {"name": "calculate", "parameters": {
    "type": "object", "properties": {"expression": {"type": "string"}}}}}]
CALLED = [{"role": "user", "content": "37+45?"},
          {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "function": {
              "name": "calculate", "arguments": '{"expression": "37+45"}'}}]},
          {"role": "tool", "tool_call_id": "c1", "content": "82"}]


def test_a_template_without_tools_gets_them_in_the_system_message_and_calls_as_text():
    """SmolLM2-135M's template reads only role and content: the tools go into the system
    message in the Hermes form, and the assistant's call into its content, as the model
    would write it; a template that reads tools gets them as they are."""
    from astraflow.models.tiny import build_tokenizer

    tok = build_tokenizer()
    tok.chat_template = CHATML
    text = tok.decode(render(tok, ChatFormat(), check_messages(CALLED), TOOLS))
    system, user, assistant, tool, prompt = text.split("<|im_start|>")[1:]
    assert system.startswith("system\nYou may call one or more functions")
    assert '<tools>\n{"name": "calculate", "parameters"' in system
    assert assistant == ('assistant\n<tool_call>{"name": "calculate", "arguments": '
                         '{"expression": "37+45"}}</tool_call><|im_end|>\n')
    assert tool == "tool\n82<|im_end|>\n" and prompt == "assistant\n"
    # a system message of the program's own keeps its text, the tools after it
    own = check_messages([{"role": "system", "content": "Be brief."}, *CALLED])
    text = tok.decode(render(tok, ChatFormat(), own, TOOLS))
    assert text.startswith("<|im_start|>system\nBe brief.\n\nYou may call one or more")
    # no tools in the request: nothing is added to the system message
    assert "<tools>" not in tok.decode(render(tok, ChatFormat(), own[:2]))
    # the call written as text is parsed back to the same call
    content, calls = parse_tool_calls(assistant.removeprefix("assistant\n")
                                      .removesuffix("<|im_end|>\n"))
    assert content == "" and json.loads(calls[0]["function"]["arguments"]) == {
        "expression": "37+45"}

    tok.chat_template = ("{% if tools %}TOOLS {{ tools | length }};{% endif %}"
                         "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}"
                         "{% for c in m.get('tool_calls', []) %}[{{ c.function.name }}]"
                         "{% endfor %};{% endfor %}")
    text = tok.decode(render(tok, ChatFormat(), check_messages(CALLED), TOOLS))
    assert text == "TOOLS 1;user: 37+45?;assistant: [calculate];tool: 82;"


# --- the endpoint ----------------------------------------------------------------------------
def test_the_openai_client_gets_answers_and_every_token_is_what_the_engine_sampled(
        engine, server):
    from openai import OpenAI

    ep = server.open({"actor": engine}, 0, {"max_new_tokens": 6, "temperature": 0.0})
    client = OpenAI(base_url=server.base_url(ep), api_key="x")
    assert [m.id for m in client.models.list().data] == ["actor"]
    r = client.chat.completions.create(model="actor",
                                       messages=[{"role": "user", "content": "37+45="}])
    text = r.choices[0].message.content
    prompt = engine.encode("37+45=")
    want = engine.generate([prompt], SamplingParams(max_new_tokens=6, temperature=0.0,
                                                    stop_token_ids=(engine.eos_token_id,)))
    assert r.usage.prompt_tokens == len(prompt)
    (s,) = ep.trajectory.build(1.0)
    assert s.token_ids == prompt + want[0][0].token_ids  # token-exact, not re-tokenised
    assert text == engine.decode([t for t in want[0][0].token_ids if t != engine.eos_token_id])
    c = client.completions.create(model="actor", prompt=prompt, max_tokens=3, logprobs=1)
    assert len(c.choices[0].logprobs.token_logprobs) == len(c.choices[0].logprobs.tokens)
    assert len(ep.trajectory.sequences) == 2  # the same prompt again: a sequence of its own
    # a malformed call ends the episode with the reason; later calls get 410
    with pytest.raises(Exception, match="this node serves actor"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "1"}])
    assert ep.failure and "model 'nope'" in ep.failure
    with pytest.raises(Exception, match="has ended"):
        client.models.list()


def test_the_reward_call_ends_a_trusted_episode_and_checks_its_body(engine, server):
    assert server.handle("GET", "/nowhere", None)[0] == 404
    ep = server.open({"actor": engine}, 0, trusted=True)
    assert server.handle("POST", f"/ep/{ep.id}/reward", {"rewards": {"other": 1}})[0] == 400
    assert "not a served policy" in ep.failure
    ep = server.open({"actor": engine}, 0, trusted=True)
    assert server.handle("POST", f"/ep/{ep.id}/reward", {"reward": 0.75}) == (200, {"ok": True})
    assert ep.reward == 0.75 and ep.ended and ep.failure is None
    # an untrusted program's reward is refused, and its episode goes on
    ep = server.open({"actor": engine}, 0)
    status, body = server.handle("POST", f"/ep/{ep.id}/reward", {"reward": 1})
    assert status == 403 and "not trusted" in body["error"]["message"]
    assert ep.reward is None and not ep.ended and ep.failure is None
    assert server.access(ep).reward_url is None


# --- programs --------------------------------------------------------------------------------
def _script(tmp_path: Path, body: str) -> tuple[str, ...]:
    """A program's file, readable by the uid a root node runs it as (pytest's own
    directories are the node's alone)."""
    (tmp_path / "agent").mkdir(mode=0o755, exist_ok=True)
    path = tmp_path / "agent" / "agent.py"
    path.write_text(textwrap.dedent(body))
    path.chmod(0o644)
    return (sys.executable, str(path))


def test_a_command_gets_the_task_and_url_and_its_outcomes_are_told_apart(tmp_path):
    ok = AgentProgram(command=_script(tmp_path, """
        import json, os, sys
        task = json.loads(os.environ["ASTRAFLOW_TASK"])
        assert json.loads(sys.stdin.read()) == task
        print("thinking...")
        print(json.dumps({"answer": task["answer"], "url": os.environ["OPENAI_BASE_URL"]}))
    """))
    out = ok.run({"prompt": "1+1=", "answer": "2"}, Access("http://h/v1"), 30)
    assert out.error is None and out.result == {"answer": "2", "url": "http://h/v1"}
    crash = AgentProgram(command=_script(tmp_path, "import sys; sys.exit('bad things')"))
    out = crash.run({}, Access("u"), 30)
    assert out.error.startswith("exit code 1: bad things")
    slow = AgentProgram(command=_script(tmp_path, "import time; time.sleep(30)"))
    assert slow.run({}, Access("u"), 0.5).error == "timeout: still running after 0.5 s"
    out = AgentProgram(command=("/no/such/program",)).run({}, Access("u"), 5)
    assert out.error.startswith("exit code 127") and "/no/such/program" in out.error
    hog = AgentProgram(command=_script(tmp_path, "import time; time.sleep(0.5); "
                                       "x = bytearray(2 * 2**30)"), limits=Limits(mem_mb=400))
    assert "MemoryError" in hog.run({}, Access("u"), 30).error
    with pytest.raises(ValueError, match="one of them"):
        AgentProgram()
    with pytest.raises(ValueError, match="package.module:function"):
        AgentProgram(function="nocolon")
    with pytest.raises(ValueError, match="No module named"):
        AgentProgram(function="no_such_module_x:run").resolve()


def agent_function(payload, base_url):  # a function program (see the next test)
    if payload.get("raise"):
        raise RuntimeError("it broke")
    return {"reward": 1.0 if base_url.endswith("/v1") else 0.0}


def test_a_function_program_returns_its_result_or_its_error():
    fn = AgentProgram(function=f"{__name__}:agent_function")
    assert fn.run({}, Access("http://h/v1"), 5).result == {"reward": 1.0}
    assert fn.run({"raise": True}, Access("u"), 5).error == "RuntimeError: it broke"


def test_a_command_without_network_reaches_its_endpoint_and_nothing_else(engine, server,
                                                                         tmp_path):
    """A jailed program (the default) has a network namespace of its own, where the
    endpoint's URL still answers and a port listening on the node's localhost does not."""
    import socket

    from astraflow.raas.agent import jail

    if (why := jail.probe(True, False)) is not None:
        pytest.skip(f"no network namespaces here: {why}")
    outside = socket.socket()
    outside.bind(("127.0.0.1", 0))
    outside.listen()
    program = AgentProgram(command=_script(tmp_path, f"""
        import json, os, socket
        from openai import OpenAI
        try:
            socket.create_connection(("127.0.0.1", {outside.getsockname()[1]}), timeout=2)
            reached = "yes"
        except OSError as e:
            reached = type(e).__name__
        r = OpenAI().chat.completions.create(
            model="actor", messages=[{{"role": "user", "content": "1+1="}}], max_tokens=2)
        print(json.dumps({{"reached": reached, "text": r.choices[0].message.content}}))
    """))
    try:
        ep = server.open({"actor": engine}, 0, keyed=True)
        out = program.run({}, server.access(ep), 60)
        assert out.error is None, out.stderr
        assert out.result["reached"] == "ConnectionRefusedError"  # the node's port: not there
        assert isinstance(out.result["text"], str) and len(ep.trajectory.sequences) == 1
        # the same program with the node's network reaches the port
        free = AgentProgram(command=program.command, limits=Limits(network=True))
        ep = server.open({"actor": engine}, 0, keyed=True)
        assert free.run({}, server.access(ep), 60).result["reached"] == "yes"
    finally:
        outside.close()
    with pytest.raises(ValueError, match="a function runs in the node's own process"):
        AgentProgram(function=f"{__name__}:agent_function", limits=Limits(network=False))


# --- whole tasks -----------------------------------------------------------------------------
def _task(answer: str = "82") -> Task:
    return Task(task_id="t1", prompt_id="p1", workflow="agent", source="test",
                payload=json.dumps({"prompt": "37+45=", "answer": answer}))


def test_the_workflow_runs_n_episodes_and_scores_their_answers(engine, tmp_path):
    from astraflow.config.options import AgentOptions
    from astraflow.raas.workflows.agent import AgentWorkflow

    program = _script(tmp_path, """
        import json, os
        from openai import OpenAI
        task = json.loads(os.environ["ASTRAFLOW_TASK"])
        r = OpenAI().chat.completions.create(
            model="actor", messages=[{"role": "user", "content": task["prompt"]}])
        print(json.dumps({"answer": r.choices[0].message.content}))
    """)
    wf = AgentWorkflow(AgentOptions(command=list(program), reward="exact_match",
                                    max_new_tokens=4, temperature=1.0, timeout_s=60))
    seqs = wf.run(_task(), {"actor": engine}, 3)
    assert len(seqs) == 3 and sorted(s.sample_index for s in seqs) == [0, 1, 2]
    for s in seqs:
        answer = engine.decode([t for t, m in zip(s.token_ids, s.loss_mask) if m
                                and t != engine.eos_token_id])
        assert s.reward == (1.0 if answer.strip() == "82" else 0.0)
    assert wf.group_metrics(seqs)["agent/failed_attempts"] == 0.0, [
        s.meta.get("agent_failures") for s in seqs]


def test_episodes_that_start_together_share_one_endpoint(tmp_path):
    """The endpoint starts on a task's first episode; episodes start in threads at once,
    and one that opened its episode on an endpoint must be served by that endpoint."""
    import threading

    from astraflow.config.options import AgentOptions
    from astraflow.raas.workflows.agent import AgentWorkflow

    wf = AgentWorkflow(AgentOptions(command=list(_script(tmp_path, "print(1)")),
                                    reward="exact_match"))
    barrier = threading.Barrier(8)
    seen = []

    def first_use() -> None:
        barrier.wait()
        seen.append(wf.server)

    threads = [threading.Thread(target=first_use) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    started = {id(s): s for s in seen}
    try:
        assert len(started) == 1
    finally:
        for s in started.values():
            s.stop()


def test_a_long_failure_reason_keeps_its_kind_and_its_last_line():
    from astraflow.raas.workflows.agent import _kind
    from astraflow.raas.workflows.episodes import shorten as _shorten

    reason = "attempt 1: exit code 1: Traceback\n" + "  frame\n" * 100 + "ValueError: bad"
    short = _shorten(reason)
    assert len(short) <= 240 and short.endswith("ValueError: bad")
    assert _kind(short) == "exit" and _shorten("attempt 1: timeout") == "attempt 1: timeout"


def test_an_episode_that_keeps_failing_sends_its_task_to_the_dlq_with_the_reasons(
        engine, tmp_path):
    from astraflow.config.options import AgentOptions
    from astraflow.raas.workflows.agent import AgentWorkflow

    wf = AgentWorkflow(AgentOptions(
        command=list(_script(tmp_path, "print('no call, no reward')")), attempts=2,
        reward="exact_match"))
    with pytest.raises(TaskError, match=r"3 of 3 episodes failed after 2 attempt\(s\): "
                       r"attempt 1: no_request.*attempt 2: no_request"):
        wf.run(_task(), {"actor": engine}, 3)


def test_concurrent_requests_share_generate_calls_and_each_gets_its_own_answer(engine):
    import threading

    from astraflow.raas.agent.batching import Coalescer

    c = Coalescer(engine, window_s=0.05)
    c.episodes = 6
    prompts = [engine.encode(f"{i}+{i}=") for i in range(6)]
    greedy = SamplingParams(max_new_tokens=4, temperature=0.0)
    out: dict[int, list[int]] = {}

    def ask(i: int) -> None:
        out[i] = c.generate(prompts[i], greedy)[0].token_ids

    threads = [threading.Thread(target=ask, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert c.prompts == 6 and c.calls < 6  # batched
    assert sorted(out) == list(range(6)) and all(0 < len(t) <= 4 for t in out.values())
    if c.calls == 1:  # one batch of the six: what one call of them all gives, in order
        alone = engine.generate(prompts, greedy)
        assert [out[i] for i in range(6)] == [g[0].token_ids for g in alone]
