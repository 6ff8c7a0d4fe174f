"""The task sources and the answer checker: the arithmetic train/eval split, task records from
payloads, check_answer and the final number, the dataset loader, carry slips."""

from __future__ import annotations

import json

import pytest

from astraflow.tasks import (
    ArithProblem,
    arithmetic_problems,
    carry_slip_answer,
    check_answer,
    eval_problems,
    extract_final_number,
    load_dataset_file,
    make_task,
    prompt_id,
    split_of,
    train_problems,
    with_carry_slips,
)
from astraflow.tasks.datasets import DatasetError
from astraflow.wire.records import Task


def test_arithmetic_split_is_disjoint_and_deterministic():
    train = train_problems((1, 2, 3, 4), n=3000, seed=1)
    evals = eval_problems((1, 2, 3, 4), n=300)
    assert train == train_problems((1, 2, 3, 4), n=3000, seed=1)
    assert evals == eval_problems((1, 2, 3, 4), n=300)
    assert not {p.prompt for p in train} & {p.prompt for p in evals}
    assert all(split_of(p.prompt) == "train" for p in train)
    assert all(split_of(p.prompt) == "eval" for p in evals)
    # another seed draws other train prompts, still never an eval one
    other = train_problems((1, 2, 3, 4), n=3000, seed=2)
    assert other != train and not {p.prompt for p in other} & {p.prompt for p in evals}
    # answers are exact and short; levels are what was asked for
    for p in train + evals:
        assert eval(p.prompt[:-1]) == int(p.answer)  # noqa: S307 - our own arithmetic
        assert len(p.answer) <= 4 and p.level in (1, 2, 3, 4)
    # level 1 has only 100 prompts: unique draws stop at what the split holds
    l1 = arithmetic_problems(1, "train", 1000)
    assert len(l1) == len({p.prompt for p in l1}) < 100


def test_task_records_from_payloads():
    p = train_problems((2,), n=1)[0]
    task = make_task(p.payload(), policy="actor")
    assert isinstance(task, Task)
    assert task.prompt_id == prompt_id(p.prompt) == p.prompt_id
    assert task.source == "arith-L2" and task.workflow == "single_turn"
    assert task.policies == ["actor"] and task.meta["level"] == "2"
    payload = json.loads(task.payload)
    assert payload["prompt"] == p.prompt and payload["answer"] == p.answer
    assert payload["level"] == 2
    with pytest.raises(ValueError):
        make_task({"prompt": "x"})


@pytest.mark.parametrize(
    "completion, answer, expected",
    [
        ("46", "46", 1.0),
        ("46<|endoftext|>", "46", 1.0),
        ("46<|endoftext|>999", "46", 1.0),
        ("  46  ", "46", 1.0),
        ("47", "46", 0.0),
        ("", "46", 0.0),
        ("The total is 1,234 dollars.", "#### 1234", 1.0),
        ("so 10 + 32 = 42\n#### 42", "42", 1.0),
        ("#### 42 and then 7", "42", 1.0),
        ("the answer is \\boxed{1,000}. Check: 7", "1000", 1.0),
        ("\\boxed{\\frac{1}{2}} no", "1/2", 0.0),
        ("-5", "-5", 1.0),
        ("5", "-5", 0.0),
        ("42.0", "42", 1.0),
        ("3.5", "3.50", 1.0),
        ("Natalia sold 48 then 24. #### 72", "Natalia sold 48/2 = 24.\n#### 72", 1.0),
        ("yes</s>", "yes", 1.0),
    ],
)
def test_check_answer(completion, answer, expected):
    assert check_answer(completion, answer) == expected


def test_extract_final_number():
    assert extract_final_number("a 1 b 2,500 c") == "2500"
    assert extract_final_number("no digits") is None
    assert extract_final_number("x=3<|im_end|>4") == "3"


def test_dataset_loader_jsonl(tmp_path):
    path = tmp_path / "gsm.jsonl"
    rows = [
        {"question": "Tom has 3 apples and buys 4. How many?", "answer": "3+4=7\n#### 7"},
        {"question": "What is 1,000 + 234?", "answer": "#### 1,234"},
        {"prompt": "2*3=", "answer": "6", "level": "Level 3"},
    ]
    path.write_text("\n".join(json.dumps(r) for r in rows) + "\n\n")
    payloads = load_dataset_file(path)
    assert [p["answer"] for p in payloads] == ["7", "1234", "6"]
    assert payloads[0]["solution"] == "3+4=7\n#### 7" and "solution" not in payloads[2]
    assert payloads[2]["level"] == 3 and payloads[0]["source"] == "gsm"
    assert payloads[1]["prompt_id"] == prompt_id("What is 1,000 + 234?")
    assert check_answer("it is 1234", payloads[1]["answer"]) == 1.0
    assert len(load_dataset_file(path, limit=2)) == 2
    task = make_task(payloads[0])
    assert task.source == "gsm"
    with pytest.raises(DatasetError, match="no field 'q'"):
        load_dataset_file(path, prompt_field="q")
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset_file(tmp_path / "nope.jsonl")
    bad = tmp_path / "x.csv"
    bad.write_text("a,b\n")
    with pytest.raises(DatasetError, match="unknown dataset format"):
        load_dataset_file(bad)


@pytest.mark.parametrize(
    "prompt, answer, slipped",
    [
        ("7+5=", "12", "2"),  # the carry out of the units is forgotten
        ("38+45=", "83", "73"),
        ("31+16=", "47", "47"),  # nothing to carry: the slip changes nothing
        ("53-17=", "36", "46"),  # the borrow is forgotten
        ("100-1=", "99", "109"),
        ("96-51=", "45", "45"),
        ("3*4=", "12", "12"),  # other shapes are left alone
        ("1+2+3=", "6", "6"),
    ],
)
def test_carry_slip_answer(prompt, answer, slipped):
    assert carry_slip_answer(ArithProblem(prompt, answer, 1)) == slipped


def test_with_carry_slips_changes_only_carry_problems_at_the_rate():
    problems = train_problems((1, 2), n=4000, unique=False)
    taught = with_carry_slips(problems, 0.7, seed=3)
    assert [p.prompt for p in taught] == [p.prompt for p in problems]
    assert taught == with_carry_slips(problems, 0.7, seed=3)
    carry = [(p, t) for p, t in zip(problems, taught) if carry_slip_answer(p) != p.answer]
    plain = [(p, t) for p, t in zip(problems, taught) if carry_slip_answer(p) == p.answer]
    assert len(carry) > 1000 and len(plain) > 1000
    assert all(t.answer == p.answer for p, t in plain)
    slipped = sum(t.answer == carry_slip_answer(p) for p, t in carry) / len(carry)
    assert 0.65 < slipped < 0.75
    assert with_carry_slips(problems, 0.0) == problems
    with pytest.raises(ValueError, match="slip"):
        with_carry_slips(problems, 1.5)

