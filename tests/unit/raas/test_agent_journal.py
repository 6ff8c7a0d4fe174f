"""An agent episode's durable log without a broker: what the endpoint appends for each call,
how a replay answers a program from the log (no token sampled again, the tokens recorded as
first sampled), where it diverges, and how the log of open episodes is folded."""

from __future__ import annotations

from astraflow.raas.agent.journal import EpisodeLog, fold, request_digest
from astraflow.raas.agent.program import AgentProgram
from astraflow.wire.records import EpisodeCall
from tests.unit.raas.test_agent import _script


class Recorder:
    """The journal's writing side, kept in a list (the topic's part is tested on a broker:
    tests/integration/raas/test_agent_durable.py)."""

    raas_id = "raas.test/a"

    def __init__(self):
        self.calls: list[EpisodeCall] = []

    def append(self, rec: EpisodeCall) -> None:
        self.calls.append(rec)


# three turns, each prompt built from the answers before it; TURN2 changes the second
PROGRAM = """
    import json, os
    from openai import OpenAI
    client, said = OpenAI(), []
    messages = [{"role": "user", "content": "1+2="}]
    for turn in range(3):
        extra = os.environ.get("TURN2", "") if turn == 1 else ""
        r = client.chat.completions.create(model="actor", messages=messages + (
            [{"role": "user", "content": extra}] if extra else []), max_tokens=3)
        said.append(r.choices[0].message.content)
        messages += [{"role": "assistant", "content": said[-1]},
                     {"role": "user", "content": "and?"}]
    print(json.dumps({"said": said}))
"""


def _run(server, engine, program, replay, journal):
    ep = server.open({"actor": engine}, 0, keyed=True)
    ep.log = EpisodeLog(journal, "t/0/0", "t", replay=list(replay))
    out = program.run({}, server.access(ep), 60)
    assert out.error is None, out.stderr
    return ep, out.result["said"]


def test_a_replay_answers_from_the_log_and_records_the_tokens_first_sampled(
        engine, server, tmp_path, monkeypatch):
    program = AgentProgram(command=_script(tmp_path, PROGRAM))
    first = Recorder()
    ep, said = _run(server, engine, program, [], first)
    assert [c.index for c in first.calls] == [0, 1, 2] and ep.log.replayed_calls == 0
    calls = []
    real = engine.generate
    monkeypatch.setattr(engine, "generate", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = Recorder()
    ep2, said2 = _run(server, engine, program, first.calls, again)
    assert said2 == said and calls == [] and again.calls == []  # nothing sampled again
    assert ep2.log.replayed_calls == 3 and not ep2.log.diverged
    assert ep2.log.replayed_tokens == sum(len(t) for c in first.calls for t in c.token_ids)
    built = lambda e: [(s.token_ids, s.loss_mask, s.logprobs, s.versions)  # noqa: E731
                       for s in e.trajectory.build(1.0)]
    assert built(ep2) == built(ep)  # the same sequences, token for token


def test_a_call_that_differs_ends_the_replay_and_the_episode_goes_on_live(
        engine, server, tmp_path, monkeypatch):
    program = AgentProgram(command=_script(tmp_path, PROGRAM))
    first = Recorder()
    _run(server, engine, program, [], first)
    program = AgentProgram(command=program.command, env={"TURN2": "think first"})
    again = Recorder()
    ep, _ = _run(server, engine, program, first.calls, again)
    assert ep.log.replayed_calls == 1 and ep.log.diverged
    # the live calls are logged from where the replay stopped
    assert [c.index for c in again.calls] == [1, 2]
    assert again.calls[0].request_sha256 != first.calls[1].request_sha256


def _call(index, episode="t/0/0", task="t"):
    return EpisodeCall(episode=episode, task_id=task, kind="call", index=index,
                       route="v1/completions")


def test_the_open_episodes_fold_calls_rewrites_and_ends():
    calls: dict[str, list[EpisodeCall]] = {}
    for rec in (_call(0), _call(1), _call(0, "t/1/0"), _call(0, "u/0/0", "u"), _call(2)):
        fold(calls, rec)
    assert [c.index for c in calls["t/0/0"]] == [0, 1, 2]
    fold(calls, _call(1))  # a run that diverged after call 0 wrote call 1 anew
    assert [c.index for c in calls["t/0/0"]] == [0, 1]
    fold(calls, _call(5))  # a gap: never replayable, ignored
    assert [c.index for c in calls["t/0/0"]] == [0, 1]
    fold(calls, EpisodeCall(episode="", task_id="t", kind="end", index=0))
    assert list(calls) == ["u/0/0"]
    assert request_digest("r", {"a": 1, "b": [2]}) == request_digest("r", {"b": [2], "a": 1})
