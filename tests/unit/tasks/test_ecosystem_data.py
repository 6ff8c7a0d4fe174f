"""The ecosystems' datasets without a broker: reasoning-gym paths, splits held out by seed
and the task's own scorer as the reward; verifiers dataset paths and rows; the workflows'
options that fail at start and payloads that are dead-lettered."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("reasoning_gym", reason="the reasoning-gym extra")
pytest.importorskip("verifiers", reason="the verifiers extra")

ENV = "astraflow.envs.verifiers_examples:load_single_turn"


def test_reasoning_gym_paths_parse_and_bad_ones_name_the_form():
    from astraflow.tasks.reasoning_gym import ReasoningGymError, parse_path

    assert parse_path("gsm8k:train") is None
    assert parse_path("reasoning_gym:basic_arithmetic:eval?max_terms=2&x=a") == (
        "basic_arithmetic", "eval", {"max_terms": 2, "x": "a"})
    for bad in ("reasoning_gym:basic_arithmetic", "reasoning_gym::train",
                "reasoning_gym:basic_arithmetic:test"):
        with pytest.raises(ReasoningGymError, match="NAME:SPLIT"):
            parse_path(bad)


def test_reasoning_gym_splits_are_held_out_and_the_feeder_seed_draws_the_train_split():
    from astraflow.dataflow.feeder import load_payloads

    path = "reasoning_gym:basic_arithmetic:{}?max_terms=2&max_digits=1"
    train = load_payloads(dataset=path.format("train"), size=200, seed=1)
    again = load_payloads(dataset=path.format("train"), size=200, seed=1)
    other = load_payloads(dataset=path.format("train"), size=200, seed=2)
    held = load_payloads(dataset=path.format("eval"), size=1000)
    assert train == again and train != other
    assert len(held) == 1000 and train
    # a small problem space: the train split drops the questions the eval split asks
    assert not {p["question"] for p in train} & {p["question"] for p in held}
    assert all(p["prompt"].startswith(p["question"]) for p in train)


def test_the_reasoning_gym_reward_is_the_tasks_own_scorer_on_the_drawn_entry():
    import reasoning_gym

    from astraflow.tasks.reasoning_gym import reasoning_gym_payloads
    from astraflow.tasks.rewards import RewardError, make_reward

    reward = make_reward("reasoning_gym")
    (p, *_) = reasoning_gym_payloads("reasoning_gym:basic_arithmetic:eval", size=3)
    p = json.loads(json.dumps(p))  # as a task payload travels
    ref = p["reasoning_gym"]
    ds = reasoning_gym.create_dataset("basic_arithmetic", seed=ref["seed"], size=ref["size"])
    entry = ds[ref["index"]]
    assert entry["question"] == p["question"]
    for completion, text in ((f"so <answer>{p['answer']}</answer>", p["answer"]),
                             ("<answer>nope</answer>", "nope"), (p["answer"], p["answer"])):
        assert reward(completion, p) == ds.score_answer(text, entry)
    assert reward(f"<answer>{p['answer']}</answer>", p) == 1.0
    assert make_reward({"name": "reasoning_gym", "tag": None})("<answer>1</answer>", p) == 0.0
    with pytest.raises(ValueError, match="reasoning_gym"):
        reward("1", {"prompt": "x", "answer": "1"})
    with pytest.raises(RewardError):
        make_reward({"name": "reasoning_gym", "tags": "x"})


def test_verifiers_paths_rows_and_their_payloads():
    from astraflow.tasks.verifiers_data import (
        VerifiersError,
        load_environment,
        parse_path,
        row_input,
        verifiers_payloads,
    )

    assert parse_path(f"verifiers:{ENV}:eval?size=4") == (ENV, "eval", {"size": 4})
    with pytest.raises(VerifiersError, match="ENV:SPLIT"):
        parse_path(f"verifiers:{ENV}")
    payloads = verifiers_payloads(f"verifiers:{ENV}:train?size=4&eval_size=2", limit=3)
    assert len(payloads) == 3
    env = load_environment(ENV, {"size": 4, "eval_size": 2})
    assert env is load_environment(ENV, {"eval_size": 2, "size": 4})  # one per arguments
    for i, p in enumerate(payloads):
        row = row_input(env, p["verifiers"])
        assert p["verifiers"]["index"] == i and row["answer"] == p["answer"]
        assert row["prompt"][-1]["content"] == p["prompt"]
    assert len(verifiers_payloads(f"verifiers:{ENV}:eval?size=4&eval_size=2")) == 2
    with pytest.raises(VerifiersError, match="rows"):
        row_input(env, {"split": "train", "index": 4})
    with pytest.raises(VerifiersError, match="no_such_module"):
        load_environment("no_such_module:load")


def test_the_verifiers_workflow_runs_only_its_own_environment():
    from astraflow.raas.workflows.base import TaskError
    from astraflow.raas.workflows.registry import make_workflow
    from astraflow.tasks.verifiers_data import verifiers_payloads
    from astraflow.wire.records import Task
    from tests.fakes import ScriptedEngine

    with pytest.raises(ValueError, match="environment: Field required"):
        make_workflow("verifiers")
    wf = make_workflow("verifiers", environment=ENV, args={"size": 4})
    (p, *_) = verifiers_payloads(f"verifiers:{ENV}:train?size=3")  # other arguments
    task = Task(task_id="t", prompt_id="p", workflow="verifiers", payload=json.dumps(p),
                source="x", policies=["actor"])
    with pytest.raises(TaskError, match="this node runs"):
        wf.run(task, {"actor": ScriptedEngine()}, 2)
    bare = Task(task_id="t", prompt_id="p", workflow="verifiers",
                payload=json.dumps({"prompt": "1+1", "answer": "2"}), source="x")
    with pytest.raises(TaskError, match="names no row"):
        wf.run(bare, {"actor": ScriptedEngine()}, 2)


def test_workflow_options_fail_at_load_naming_the_key():
    from pydantic import ValidationError

    from astraflow.config.options import WORKFLOW_OPTIONS

    with pytest.raises(ValidationError, match="environment"):
        WORKFLOW_OPTIONS["verifiers"].model_validate({"args": {}})
    with pytest.raises(ValidationError, match="one of them"):
        WORKFLOW_OPTIONS["openenv"].model_validate({"max_turns": 2})
    with pytest.raises(ValidationError, match="max_turns"):
        WORKFLOW_OPTIONS["openenv"].model_validate({"app": "a:b", "max_turns": 0})
    assert WORKFLOW_OPTIONS["openenv"].model_validate(
        {"base_url": "http://h:8000"}).given() == {"base_url": "http://h:8000"}


def test_the_verifiers_reward_is_the_environments_rubric_on_a_held_out_row():
    from astraflow.envs.verifiers_examples import correct
    from astraflow.tasks.rewards import make_reward
    from astraflow.tasks.verifiers_data import load_environment, row_input, verifiers_payloads

    args = {"size": 4, "eval_size": 4}
    reward = make_reward({"name": "verifiers", "environment": ENV, "args": args})
    env = load_environment(ENV, args)
    for p in verifiers_payloads(f"verifiers:{ENV}:eval?size=4&eval_size=4"):
        info = row_input(env, p["verifiers"])["info"]
        for text in (f"<answer>{p['answer']}</answer>", "<answer>x</answer>", p["answer"]):
            assert reward(text, p) == correct([{"role": "assistant", "content": text}], info)
        assert reward(f"<answer>{p['answer']}</answer>", p) == 1.0
    other = verifiers_payloads(f"verifiers:{ENV}:eval?size=3&eval_size=4")[0]
    with pytest.raises(ValueError, match="scores rows of that environment"):
        reward("1", other)
