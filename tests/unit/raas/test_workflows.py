"""RaaS workflows without a broker: the calculator, single-turn rewards and masks, tool calls
masked and continued, seeded latency (the node on a real broker:
tests/integration/raas/test_raas.py)."""

from __future__ import annotations

import json

import pytest

from astraflow.raas.calc import CalcError, calculate, evaluate
from astraflow.raas.workflows import TaskError, make_workflow
from astraflow.raas.workflows.latency import Latency
from astraflow.wire.records import Task
from tests.conftest import REPO
from tests.fakes import ScriptedEngine


# --- calculator --------------------------------------------------------------------------
def test_calculator_parser():
    assert calculate("12*7") == "84"
    assert calculate(" (1 + 2) * -3 ") == "-9"
    assert calculate("2**10 - 2^3") == "1016"
    assert calculate("7/2") == "3.5"
    assert calculate("7//2 + 7%3") == "4"
    assert calculate("1/3") == "0.3333333333"
    assert evaluate("0.1+0.2") == evaluate("0.3")  # exact arithmetic
    for junk in [
        "",
        "1+",
        "(1",
        "1)",
        "a",
        "__import__('os').system('x')",
        "1 2",
        "2**1000",
        "9**9**9",
        "1/0",
        "2**0.5",
        "((((" * 20 + "1" + "))))" * 20,
        "1" * 300,
        "len([])",
        "1e5",
    ]:
        with pytest.raises(CalcError):
            evaluate(junk)
    src = (REPO / "astraflow/raas/calc.py").read_text()
    assert (
        "eval(" not in src.replace("def evaluate(", "").replace("= evaluate(", "")
        and "exec(" not in src
    )


# --- workflows ---------------------------------------------------------------------------
def task_of(payload, workflow="single_turn", tid="t0", policies=("actor",)) -> Task:
    return Task(
        task_id=tid,
        prompt_id=f"p-{tid}",
        workflow=workflow,
        payload=payload if isinstance(payload, str) else json.dumps(payload),
        source="test",
        policies=list(policies),
    )


def check_sequence_invariants(s, prompt_len: int) -> None:
    n = len(s.token_ids)
    assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n
    assert s.loss_mask[:prompt_len] == [0] * prompt_len
    for m, lp, v in zip(s.loss_mask, s.logprobs, s.versions):
        if m == 0:
            assert lp == 0.0 and v == -1
        else:
            assert v >= 0


def test_single_turn_rewards_and_masks():
    eng = ScriptedEngine("actor", ["84", " 84 ", "85"], version=3)
    wf = make_workflow("single_turn", checker=lambda c, a: float(c.strip() == a))
    seqs = wf.run(task_of({"prompt": "12*7=", "answer": "84", "level": 1}), {"actor": eng}, 3)
    assert [s.reward for s in seqs] == [1.0, 1.0, 0.0]
    assert [s.sample_index for s in seqs] == [0, 1, 2]
    for s in seqs:
        check_sequence_invariants(s, 5)
        assert s.policy == "actor" and s.token_ids[:5] == eng.encode("12*7=")
        assert s.min_version == 3
    # the default checker works whether or not astraflow.tasks exists yet
    seqs = make_workflow("single_turn").run(
        task_of({"prompt": "x", "answer": "84"}), {"actor": ScriptedEngine("actor", ["84"])}, 1
    )
    assert seqs[0].reward == 1.0
    for bad in [
        "not json",
        json.dumps([1]),
        json.dumps({"prompt": "x"}),
        json.dumps({"prompt": {"a": 1}, "answer": "1"}),
    ]:
        with pytest.raises(TaskError):
            wf.run(task_of(bad), {"actor": eng}, 1)
    with pytest.raises(TaskError, match="no engine"):
        wf.run(task_of({"prompt": "x", "answer": "1"}, policies=["critic"]), {"actor": eng}, 1)
    with pytest.raises(TaskError, match="unknown workflow"):
        make_workflow("nope")


def test_tool_calc_masks_tool_tokens_and_continues():
    eng = ScriptedEngine(
        "actor",
        [
            "let me <calc>12*7</calc>",  # sample 0, turn 1: tool call
            "it is 84",  # sample 1, turn 1: answers directly (wrong format)
            "<calc>2+</calc>",  # sample 0, turn 2: a broken call
            "84",  # sample 0, turn 3: final answer
        ],
        version=3,
    )
    wf = make_workflow(
        "tool_calc",
        checker=lambda c, a: float(c.strip() == a),
        max_turns=3,
        tool_latency={"dist": "pareto", "scale_s": 0.001, "alpha": 2.0, "max_s": 0.01, "seed": 1},
    )
    prompt = "what is 12*7?"
    seqs = wf.run(
        task_of({"prompt": prompt, "answer": "84"}, workflow="tool_calc"), {"actor": eng}, 2
    )
    s0, s1 = seqs
    text0 = eng.decode(s0.token_ids)
    assert text0 == (
        prompt + "let me <calc>12*7</calc><result>84</result>"
        "<calc>2+</calc><result>error: unexpected end of expression</result>84"
    )
    check_sequence_invariants(s0, len(prompt))
    # exactly the tool results are masked out after the prompt
    masked = "".join(chr(t) for t, m in zip(s0.token_ids, s0.loss_mask) if m == 0)
    assert (
        masked == prompt + "<result>84</result><result>error: unexpected end of expression</result>"
    )
    trained = "".join(chr(t) for t, m in zip(s0.token_ids, s0.loss_mask) if m == 1)
    assert trained == "let me <calc>12*7</calc><calc>2+</calc>84"
    assert s0.reward == 1.0 and s0.meta["tool_calls"] == "2"
    assert s1.reward == 0.0 and s1.meta["tool_calls"] == "0"
    assert eng.decode(s1.token_ids) == prompt + "it is 84"
    # turn 2 and 3 continue only sample 0, from its whole context
    assert len(eng.calls[1]) == 1 and eng.decode(eng.calls[1][0]).endswith("<result>84</result>")


def test_latency_distributions_are_seeded_and_long_tailed():
    a = [
        Latency(dist="pareto", scale_s=0.01, alpha=1.1, seed=7, max_s=100).draw() for _ in range(1)
    ]
    b = [
        Latency(dist="pareto", scale_s=0.01, alpha=1.1, seed=7, max_s=100).draw() for _ in range(1)
    ]
    assert a == b
    lat = Latency(dist="lognormal", median_s=0.01, sigma=1.5, seed=0, max_s=100)
    draws = sorted(lat.draw() for _ in range(2000))
    median, p99 = draws[1000], draws[1980]
    assert 0.007 < median < 0.014 and p99 > 10 * median
    assert Latency.from_option(0.5).draw() == 0.5
    with pytest.raises(ValueError):
        Latency(dist="gauss")

