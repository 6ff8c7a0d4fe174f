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
