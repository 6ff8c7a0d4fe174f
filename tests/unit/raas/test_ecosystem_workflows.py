"""The ecosystem workflows without a broker, on a scripted policy: a verifiers multi-turn
environment's turns stay one sequence, its own message masked, its rubric the reward; an
OpenEnv server that cannot be reached fails the task after its attempts, with the reason."""

from __future__ import annotations

import json
import socket

import pytest

from astraflow.wire.records import Task
from tests.fakes import ScriptedEngine

pytest.importorskip("verifiers", reason="the verifiers extra")
pytest.importorskip("openenv", reason="the openenv extra")


def _task(payload: dict, workflow: str) -> Task:
    return Task(task_id="t", prompt_id="p", workflow=workflow, payload=json.dumps(payload),
                source="test", policies=["actor"])


def test_a_multi_turn_environment_answers_again_in_one_sequence():
    from astraflow.raas.workflows.registry import make_workflow
    from astraflow.tasks.verifiers_data import verifiers_payloads

    env = "astraflow.envs.verifiers_examples:load_multi_turn"
    (p, *_) = verifiers_payloads(f"verifiers:{env}:train?size=2&eval_size=2")
    right, wrong = f"<answer>{p['answer']}</answer>", "<answer>x</answer>"
    engine = ScriptedEngine(replies=[wrong, right, wrong, wrong])
    wf = make_workflow("verifiers", environment=env, args={"size": 2, "eval_size": 2},
                       max_new_tokens=32)
    seqs = wf.run(_task(p, "verifiers"), {"actor": engine}, 1)
    (s,) = seqs  # the retry extends the first turn's sampled tokens
    text = engine.decode(s.token_ids)
    assert text.endswith(wrong + "\nThat is not right. Try again." + right), text
    trained = "".join(chr(t) for t, m in zip(s.token_ids, s.loss_mask) if m)
    assert trained == wrong + right  # the environment's message is not trained
    assert s.reward == 1.0 and s.meta["vf_metric:num_turns"] == "2.0"
    again = wf.run(_task(p, "verifiers"), {"actor": engine}, 1)  # two wrong answers
    assert [x.reward for x in again] == [0.0]


def test_an_unreachable_openenv_server_fails_the_task_with_the_reason():
    from astraflow.raas.workflows.base import TaskError
    from astraflow.raas.workflows.registry import make_workflow

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    wf = make_workflow("openenv", base_url=f"http://127.0.0.1:{port}", attempts=2,
                       timeout_s=20)
    engine = ScriptedEngine(replies=["1"] * 8)
    with pytest.raises(TaskError, match=r"failed after 2 attempt\(s\): attempt 1: "):
        wf.run(_task({"prompt": "x", "answer": "1", "seed": 1}, "openenv"),
               {"actor": engine}, 2)
    assert not engine.calls  # no episode reached the policy
    with pytest.raises(ValueError, match="one of them"):
        make_workflow("openenv")
    with pytest.raises(TaskError, match="mapping"):
        wf.run(_task({"reset": [1]}, "openenv"), {"actor": engine}, 1)


def test_an_empty_answer_is_scored_not_retried():
    """The model answers nothing (verifiers' EmptyModelResponseError ends its rollout):
    the episode is scored 0 by the rubric beside the right answer of the other, with
    nothing of it trained, and the group is not run again."""
    from astraflow.raas.workflows.registry import make_workflow
    from astraflow.tasks.verifiers_data import verifiers_payloads

    env = "astraflow.envs.verifiers_examples:load_single_turn"
    (p, *_) = verifiers_payloads(f"verifiers:{env}:train?size=2&eval_size=2")
    engine = ScriptedEngine(replies=["", f"<answer>{p['answer']}</answer>"])
    wf = make_workflow("verifiers", environment=env, args={"size": 2, "eval_size": 2},
                       max_new_tokens=32, attempts=1)
    empty, right = wf.run(_task(p, "verifiers"), {"actor": engine}, 2)
    assert (empty.reward, sum(empty.loss_mask)) == (0.0, 0)
    assert empty.meta["vf_model_error"] == "EmptyModelResponseError"
    assert right.reward == 1.0 and "vf_model_error" not in right.meta
    assert len(engine.calls) == 1 and not engine.replies  # one attempt
    assert wf.group_metrics([empty, right])["verifiers/model_errors"] == 0.5


def test_only_errors_of_the_models_own_output_keep_an_episode():
    """The rule: an invalid or empty response or a tool error is the model's to learn
    from; the endpoint's failure, the transport's (verifiers' plain ModelError), the
    infrastructure's, or no call at all makes the group run again."""
    from types import SimpleNamespace

    import verifiers as vf

    from astraflow.raas.workflows.verifiers_env import _episode_failure

    def ep(failure=None, sequences=("s",)):
        return SimpleNamespace(failure=failure, trajectory=SimpleNamespace(sequences=sequences))

    for own in (vf.InvalidModelResponseError("x"), vf.EmptyModelResponseError("x"),
                vf.ToolParseError("x"), vf.ToolCallError("x"), None):
        assert _episode_failure(ep(), {"error": own}) is None, own
    for other in (vf.ModelError("connection"), vf.InfraError("x"), vf.Error("x")):
        assert "ended with an error" in _episode_failure(ep(), {"error": other})
    assert _episode_failure(ep("bad_call: x"), {"error": None}) == "bad_call: x"
    assert _episode_failure(ep(sequences=()), {"error": None}).startswith("no_request")
