"""The example environments' own logic, without a node or a server: the OpenEnv arithmetic
environment's episode (a problem from the seed, ended by the first answer or after
``MAX_TRIES``, scored on the first number) and the verifiers examples' helpers (the final
assistant text, the calculator tool and its errors). A node rolling them out and training a
step on them: tests/integration/raas/test_ecosystems.py."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("verifiers", reason="the verifiers extra")
pytest.importorskip("openenv", reason="the openenv extra")


def test_a_problem_is_its_seeds_and_its_answer_is_right():
    from astraflow.envs.openenv_arith import problem

    assert problem(7) == problem(7)
    questions = {problem(seed) for seed in range(200)}
    assert len(questions) > 150
    for question, answer in questions:
        a, op, b = re.fullmatch(r"(\d+)([+-])(\d+)=", question).groups()
        assert int(answer) == (int(a) + int(b) if op == "+" else int(a) - int(b))
        assert int(a) < 50 and int(b) < 50


@pytest.mark.parametrize("message, answer, reward", [
    ("12", "12", 1.0), ("it is -3, not 5", "-3", 1.0), ("5 then -3", "-3", 0.0),
    ("121", "12", 0.0), ("no number", "12", 0.0)])
def test_the_score_is_the_first_number_of_the_message(message, answer, reward):
    from astraflow.envs.openenv_arith import score

    assert score(message, answer) == reward


def test_an_episode_ends_at_the_first_answer_or_after_its_tries():
    from astraflow.envs.openenv_arith import (
        MAX_TRIES,
        ArithAction,
        ArithEnvironment,
        problem,
    )

    question, answer = problem(3)
    env = ArithEnvironment()
    first = env.reset(seed=3, episode_id="e1")
    assert (first.prompt, first.done, first.answer) == (question, False, None)
    asked = env.step(ArithAction(message="let me think"))  # no number: asked again
    assert not asked.done and asked.reward == 0.0 and question in asked.prompt
    assert MAX_TRIES == 2
    last = env.step(ArithAction(message="still thinking"))
    assert last.done and last.reward == 0.0 and last.answer == answer
    assert env.state.step_count == 2 and env.state.episode_id == "e1"

    env.reset(seed=3)
    right = env.step(ArithAction(message=f"{answer}, I think"))
    assert right.done and right.reward == 1.0 and env.state.step_count == 1
    env.reset(seed=3)
    wrong = env.step(ArithAction(message=f"{int(answer) + 1}"))
    assert wrong.done and wrong.reward == 0.0 and wrong.answer == answer


def test_the_final_text_is_the_last_assistant_message():
    from astraflow.envs.verifiers_examples import final_text

    class Message:
        def __init__(self, role, content):
            self.role, self.content = role, content

    chat = [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "3"},
            {"role": "user", "content": "again"}, {"role": "assistant", "content": "2"},
            {"role": "user", "content": "thanks"}]
    assert final_text(chat) == "2"
    assert final_text([Message("assistant", "7"), Message("tool", "x")]) == "7"
    assert final_text("plain") == "plain"
    assert final_text([{"role": "user", "content": "hi"}]) == ""
    assert final_text([{"role": "assistant", "content": None}]) == ""
    assert final_text(None) == ""


def test_the_calculator_tool_answers_or_says_what_went_wrong():
    from astraflow.envs.verifiers_examples import _tool_error, calculate

    assert calculate("(12 + 5) * 3") == "51"
    assert calculate("1/0").startswith("error: ")
    assert calculate("import os").startswith("error: ")
    assert _tool_error(KeyError("apply")) == (
        "error: no tool 'apply'; the tool is calculate(expression)")
    assert _tool_error(ValueError("bad")) == "error: ValueError: bad"


def test_a_call_counts_only_when_the_calculator_gave_a_number():
    from astraflow.envs.verifiers_examples import used_tool

    class Message:
        def __init__(self, role, content):
            self.role, self.content = role, content

    call = {"role": "assistant", "content": "", "tool_calls": [{"id": "c"}]}
    assert used_tool([call, {"role": "tool", "content": "-3.5"},
                      {"role": "assistant", "content": "<answer>-3.5</answer>"}]) == 1.0
    assert used_tool([call, Message("tool", "182")]) == 1.0
    # an unknown tool or a malformed expression (verifiers' and TRL's error texts)
    assert used_tool([call, {"role": "tool", "content": "error: no tool 'add'"}]) == 0.0
    assert used_tool([call, {"role": "tool", "content": "{'error': 'Tool x not found.'}"}]) == 0.0
    # no call, or a number the model wrote itself
    assert used_tool([{"role": "assistant", "content": "182"}]) == 0.0
    assert used_tool("182") == 0.0


def test_the_call_bonus_is_a_weighted_rubric_function_and_the_control_takes_it():
    from astraflow.envs.verifiers_examples import (
        correct,
        load_single_turn,
        load_tool,
        tool_reward,
        used_tool,
    )

    assert tool_reward() == ([correct], [1.0])
    assert tool_reward(0.2) == ([correct, used_tool], [1.0, 0.2])

    def scored(env):  # the environment's own rubric (verifiers adds weight-0 monitors)
        return [(f, w) for r in getattr(env.rubric, "rubrics", [env.rubric])
                for f, w in zip(r.funcs, r.weights) if w]

    assert scored(load_tool(size=8, eval_size=4)) == [(correct, 1.0)]
    bonus = load_tool(size=8, eval_size=4, call_bonus=0.2)
    assert scored(bonus) == [(correct, 1.0), (used_tool, 0.2)]
    # the control shares the tool environment's arguments; it has no call to reward
    control = load_single_turn(size=8, eval_size=4, call_bonus=0.2)
    assert scored(control) == [(correct, 1.0)]
    assert [r["answer"] for r in control.dataset] == [r["answer"] for r in bonus.dataset]
