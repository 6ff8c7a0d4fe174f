"""The multi-policy workflows in their chat format (a pretrained chat model, issue 20),
without Kafka: scripted engines with a chat template play the roles; the prompts, the
parsers of the replies, the rewards (the verdict in the solver's, the selector's best of
N, the test generator's mutation reward through the real sandbox) and the held-out role
metrics. The broker-level run of each SmolLM2 topology: test_e2e_real_multipolicy.py."""

from __future__ import annotations

import json

import pytest

from astraflow.config.topology import parse_topology
from astraflow.raas.workflows import TaskError, make_workflow
from astraflow.raas.workflows.solve_select import SolveSelect
from astraflow.roles.chat_formats import (
    RETRY_MESSAGE,
    chat_candidate,
    parse_choice,
    parse_yes_no,
)
from astraflow.roles.chat_scoring import chat_role_examples
from astraflow.roles.code_scoring import mutation_reward
from astraflow.tasks.code import CodeProblem
from astraflow.tasks.code_parsing import extract_program, parse_assert_tests
from astraflow.tasks.mutants import mutants, mutants_source
from astraflow.wire.records import Task
from tests.fakes import ScriptedEngine

PROBLEM = "What is 37+45? Answer with the number only."


class ChatTokenizer:
    """A tokenizer with a chat template: ``[role]content`` per message, then
    ``[assistant]``; one character per token."""

    chat_template = "fake"

    def apply_chat_template(self, messages, tokenize=False, add_generation_prompt=True, **kw):
        return "".join(f"[{m['role']}]{m['content']}" for m in messages) + "[assistant]"

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [ord(c) for c in text]


class ChatEngine(ScriptedEngine):
    """A scripted engine of a chat model (its tokenizer has a template)."""

    tokenizer = ChatTokenizer()


def task(workflow: str, payload: dict, policies: list[str]) -> Task:
    return Task(task_id="t", prompt_id="p", workflow=workflow, payload=json.dumps(payload),
                source="test", policies=policies)


def arithmetic(workflow: str, judge: str) -> Task:
    return task(workflow, {"prompt": PROBLEM, "answer": "82"}, ["solver", judge])


# --- parsers ---------------------------------------------------------------------------------
@pytest.mark.parametrize("text,want", [
    ("yes", True), ("Yes.", True), (" No, it is 83", False), ("Correct!", True),
    ("incorrect", False), ("The answer is yes", None), ("", None), ("82", None),
    ("no<|im_end|>", False),
])
def test_parse_yes_no(text, want):
    assert parse_yes_no(text) is want


@pytest.mark.parametrize("text,k,want", [
    ("2", 3, 2), ("Answer 3: 82", 3, 3), ("4", 3, None), ("the first", 3, None),
    ("82", 4, None), ("1<|im_end|>", 2, 1),
])
def test_parse_choice(text, k, want):
    assert parse_choice(text, k) == want


def test_parse_choice_takes_a_repeated_answer_for_its_number():
    assert parse_choice("82, of course", 3, ["80", "82", "10"]) == 2
    assert parse_choice("82", 3, ["82", "82", "10"]) is None  # which one?
    assert parse_choice("3", 3, ["80", "82", "3"]) == 3  # a number in range is a number
    assert parse_choice("7", 3, ["80", "82", "10"]) is None


def test_chat_candidate_is_the_final_number_else_the_first_line():
    assert chat_candidate("37 + 45 = 82") == "82"
    assert chat_candidate("I do not know\nreally", 8) == "I do not"
    assert chat_candidate("") == ""


# --- solve_verify ----------------------------------------------------------------------------
def test_solve_verify_chat_prompts_verdicts_retries_and_the_verdict_in_the_solver_reward():
    # four first tries, then the retries of the two rejected answers (1 and 3)
    solver = ChatEngine("solver", ["82", "73", "37 + 45 = 82", "I think 80", "82", "81"],
                        version=3)
    verifier = ChatEngine("verifier", ["Yes", "no", "No.", "maybe"], version=1)
    wf = make_workflow("solve_verify", verdict_weight=0.25)
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 4)
    firsts = [s for s in seqs if s.role == "solver"]
    verdicts = [s for s in seqs if s.role == "verifier"]
    retries = [s for s in seqs if s.role == "solver_retry"]
    # the solver gets the task's own prompt through its template
    assert solver.prompts[0] == f"[user]{PROBLEM}[assistant]"
    # the verifier sees the problem and one proposed answer (the final number), in words
    assert verifier.prompts[1] == (f"[user]Problem: {PROBLEM}\nProposed answer: 73\nIs the "
                                   "proposed answer correct? Reply with yes or no only."
                                   "[assistant]")
    assert [s.meta["verdict"] for s in verdicts] == ["y", "n", "n", "?"]
    assert [s.meta["truth"] for s in verdicts] == ["1", "0", "1", "0"]
    assert [s.reward for s in verdicts] == [1.0, 1.0, 0.0, 0.0]
    # first tries: rightness, 0.25 of it the verdict (approved +0.25, rejected +0,
    # unparseable: the reward alone)
    assert [s.reward for s in firsts] == [1.0, 0.0, 0.75, 0.0]
    # the rejected answers are retried in the conversation, scored by their rightness
    assert [s.sample_index for s in retries] == [1, 2]
    assert solver.prompts[1] == (f"[user]{PROBLEM}[assistant]73[user]{RETRY_MESSAGE}"
                                 "[assistant]")
    assert [s.reward for s in retries] == [1.0, 0.0]


def test_solve_verify_reference_candidates_are_judged_but_never_trained_for_the_solver():
    solver = ChatEngine("solver", ["73", "73", "83", "82"])  # two answers, two retries
    verifier = ChatEngine("verifier", ["no", "no", "yes", "no", "yes"])
    wf = make_workflow("solve_verify", reference_candidates=3, verdict_weight=0.25)
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 2)
    verdicts = [s for s in seqs if s.role == "verifier"]
    # the solver's two answers (both wrong), then the right answer, a wrong one, the right one
    assert [s.sample_index for s in verdicts] == [0, 1, 2, 3, 4]
    assert [s.meta.get("source") for s in verdicts] == [None, None, "reference", "reference",
                                                        "reference"]
    assert [s.meta["answer"] for s in verdicts][2::2] == ["82", "82"]
    wrong = verdicts[3].meta["answer"]
    assert wrong != "82" and wrong.isdigit()
    assert [s.meta["truth"] for s in verdicts] == ["0", "0", "1", "0", "1"]
    assert [s.reward for s in verdicts] == [1.0, 1.0, 1.0, 1.0, 1.0]
    assert verifier.prompts[3].startswith(f"[user]Problem: {PROBLEM}\nProposed answer: {wrong}")
    # retries and the solver's rewards come from its own answers only
    retries = [s for s in seqs if s.role == "solver_retry"]
    assert [(s.sample_index, s.reward) for s in retries] == [(0, 0.0), (1, 1.0)]
    assert [s.reward for s in seqs if s.role == "solver"] == [0.0, 0.0]
    # the same task draws the same wrong candidate (a replay decides the same)
    again = make_workflow("solve_verify", reference_candidates=3, retry=False).run(
        arithmetic("solve_verify", "verifier"),
        {"solver": ChatEngine("solver", ["73", "73"]),
         "verifier": ChatEngine("verifier", ["no"] * 5)}, 2)
    assert [s.meta["answer"] for s in again if s.role == "verifier"][3] == wrong
    with pytest.raises(ValueError, match="reference_candidates"):
        make_workflow("solve_verify", reference_candidates=-1)


def test_solve_verify_blind_chat_answers_first_then_judges_with_its_answer_in_view():
    solver = ChatEngine("solver", ["82", "73"])
    # own answers (one per candidate: 2 of the solver's, 2 reference), then the verdicts
    verifier = ChatEngine("verifier", ["82", "The answer is 82.", "80", "82",
                                       "yes", "yes", "no", "no"])
    wf = make_workflow("solve_verify", blind=True, retry=False, reference_candidates=2)
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 2)
    owns = [s for s in seqs if s.role == "verifier_own"]
    verdicts = [s for s in seqs if s.role == "verifier"]
    # the own answer is the task's own prompt, rewarded as the solver's answers are
    assert verifier.prompts[0] == f"[user]{PROBLEM}[assistant]"
    assert [(s.meta["own"], s.reward) for s in owns] == [("82", 1.0), ("82", 1.0),
                                                         ("80", 0.0), ("82", 1.0)]
    # then its answer is its turn, and it is shown the candidate
    wrong = verdicts[3].meta["answer"]
    assert verifier.prompts[1] == (f"[user]{PROBLEM}[assistant]82[user]Proposed answer: 82\n"
                                   "Is the proposed answer correct? Reply with yes or no only."
                                   "[assistant]")
    assert [s.meta["answer"] for s in verdicts] == ["82", "73", "82", wrong]
    assert [s.meta["truth"] for s in verdicts] == ["1", "0", "1", "0"]
    assert [s.meta["own_matches"] for s in verdicts] == ["1", "0", "0", "0"]
    assert [s.reward for s in verdicts] == [1.0, 0.0, 0.0, 1.0]
    assert [s.sample_index for s in verdicts] == [0, 1, 2, 3]
    # the solver's first tries: its own answers only
    assert [s.reward for s in seqs if s.role == "solver"] == [1.0, 0.0]
    assert wf.group_metrics(seqs)["verify/verifier_accuracy"] == 0.5


def test_solve_verify_blind_agreement_the_own_answer_is_the_verdict():
    solver = ChatEngine("solver", ["82", "73", "80"])
    verifier = ChatEngine("verifier", ["82", "The answer is 82.", "no idea"])  # own answers
    wf = make_workflow("solve_verify", blind=True, agreement=True, retry=False,
                       verdict_weight=0.25)
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 3)
    # one turn: the task's own prompt, never the candidate
    assert verifier.prompts == [f"[user]{PROBLEM}[assistant]"]  # 3 samples of one prompt
    verdicts = [s for s in seqs if s.role == "verifier"]
    assert not [s for s in seqs if s.role == "verifier_own"]
    assert [s.meta["answer"] for s in verdicts] == ["82", "73", "80"]
    # agrees with 82 (approve), not with 73 (reject); no number: unparseable
    assert [s.meta["verdict"] for s in verdicts] == ["y", "n", "?"]
    assert [s.meta["own_matches"] for s in verdicts] == ["1", "0", "0"]
    # rewarded as the solver's answers are: its own answer against the task's
    assert [s.reward for s in verdicts] == [1.0, 1.0, 0.0]
    assert [s.reward for s in seqs if s.role == "solver"] == [1.0, 0.0, 0.0]
    assert wf.group_metrics(seqs)["verify/verifier_accuracy"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="agreement"):
        make_workflow("solve_verify", agreement=True)
    # judge_reward: its own answers' reward spec, apart from the solver's
    wf = make_workflow("solve_verify", blind=True, agreement=True, retry=False,
                       reward="exact_match", judge_reward={
                           "name": "sum", "terms": [{"name": "exact_match", "weight": 1.0},
                                                    {"name": "closeness", "alone": True,
                                                     "weight": 0.2}]})
    seqs = wf.run(arithmetic("solve_verify", "verifier"),
                  {"solver": ChatEngine("solver", ["82", "80"]),
                   "verifier": ChatEngine("verifier", ["82", "80"])}, 2)
    assert [s.reward for s in seqs if s.role == "solver"] == [1.0, 0.0]
    own = [s.reward for s in seqs if s.role == "verifier"]
    assert own[0] == pytest.approx(1.2) and 0.0 < own[1] < 0.2  # exact: 1 + 0.2 closeness


def test_solve_verify_corrective_verifier_replies_with_the_answer_its_verdict_is_agreement():
    solver = ChatEngine("solver", ["82", "73"])
    # replies to the solver's two answers, then to the two references (right, wrong)
    verifier = ChatEngine("verifier", ["82", "The answer is 82.", "80", "I am not sure"])
    wf = make_workflow("solve_verify", corrective=True, retry=False, reference_candidates=2,
                       verdict_weight=0.25)
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 2)
    verdicts = [s for s in seqs if s.role == "verifier"]
    wrong = verdicts[3].meta["answer"]
    assert verifier.prompts[1] == (f"[user]Problem: {PROBLEM}\nProposed answer: 73\n"
                                   "Reply with the correct answer, the number only.[assistant]")
    assert [s.meta["answer"] for s in verdicts] == ["82", "73", "82", wrong]
    # agreement: it repeats 82 (approve), corrects 73 to 82 (reject), misses the right 82
    # (reject); a reply with no number is unparseable
    assert [s.meta["verdict"] for s in verdicts] == ["y", "n", "n", "?"]
    assert [s.meta["reply"] for s in verdicts] == ["82", "82", "80", "I am not sur"]
    # rewarded as the solver's answers are: its reply against the task's answer
    assert [s.reward for s in verdicts] == [1.0, 1.0, 0.0, 0.0]
    assert [s.meta["correct"] for s in verdicts] == ["1", "1", "0", "0"]
    # the verdict in the solver's reward: 82 approved, 73 rejected
    assert [s.reward for s in seqs if s.role == "solver"] == [1.0, 0.0]
    m = wf.group_metrics(seqs)
    assert m["verify/verifier_accuracy"] == 0.5 and m["verify/unparseable_rate"] == 0.25
    with pytest.raises(ValueError, match="corrective"):
        make_workflow("solve_verify", corrective=True, blind=True)
    with pytest.raises(TaskError, match="corrective"):
        make_workflow("solve_verify", corrective=True).run(
            task("solve_verify", {"prompt": "37+45=", "answer": "82"}, ["solver", "verifier"]),
            {"solver": ScriptedEngine("solver", ["82"]),
             "verifier": ScriptedEngine("verifier")}, 1)


def test_solve_verify_chat_takes_a_reward_spec():
    solver = ChatEngine("solver", ["82", "80"])
    verifier = ChatEngine("verifier", ["yes", "yes"])
    wf = make_workflow("solve_verify", retry=False, reward={
        "name": "sum", "terms": [{"name": "exact_match", "weight": 1.0},
                                 {"name": "closeness", "alone": True, "weight": 0.5}]})
    seqs = wf.run(arithmetic("solve_verify", "verifier"), {"solver": solver,
                                                           "verifier": verifier}, 2)
    rewards = [s.reward for s in seqs if s.role == "solver"]
    # exact: 1 + 0.5 closeness; a near miss (80 for 82) earns closeness only: 0.5 (1 - 2/82)
    assert rewards[0] == 1.5 and rewards[1] == pytest.approx(0.5 * (1 - 2 / 82))
    with pytest.raises(ValueError, match="verdict_weight"):
        make_workflow("solve_verify", verdict_weight=1.5)


def test_auto_format_stays_compact_on_the_tiny_model():
    solver = ScriptedEngine("solver", ["82"])
    verifier = ScriptedEngine("verifier", ["82y"])
    make_workflow("solve_verify").run(task("solve_verify", {"prompt": "37+45=", "answer": "82"},
                                           ["solver", "verifier"]),
                                      {"solver": solver, "verifier": verifier}, 1)
    assert solver.prompts == ["37+45="] and verifier.prompts == ["37+45=82?"]


# --- solve_select ----------------------------------------------------------------------------
def test_solve_select_chat_picks_the_best_of_n_scaled_and_skips_ties():
    # two picks over 3 answers each: (82, 80, 10) and three without a number
    solver = ChatEngine("solver", ["82", "80", "10", "no idea", "?", "I do not know"])
    selector = ChatEngine("selector", ["2", "Answer 1"])
    wf = make_workflow("solve_select", candidates=3, reward={
        "name": "sum", "terms": [{"name": "exact_match", "weight": 1.0},
                                 {"name": "closeness", "alone": True, "weight": 0.5}]})
    seqs = wf.run(arithmetic("solve_select", "selector"), {"solver": solver,
                                                           "selector": selector}, 2)
    picks = [s for s in seqs if s.role == "selector"]
    assert selector.prompts[0] == (f"[user]Problem: {PROBLEM}\nAnswer 1: 82\nAnswer 2: 80\n"
                                   "Answer 3: 10\nWhich answer is correct? Reply with its "
                                   "number (1 to 3) only.[assistant]")
    scores = [s.reward for s in seqs if s.role == "solver"]
    assert scores[0] == 1.5 and scores[2] < scores[1] < 0.5
    # pick 2 (80): between the worst (10) and the best (82) of its set
    assert picks[0].reward == pytest.approx((scores[1] - scores[2]) / (1.5 - scores[2]))
    assert picks[0].meta["right"] == "100" and picks[0].meta["tie"] == "0"
    # the second set scores 0 three times: a tie, not trained
    assert len(picks) == 1
    m = SolveSelect.group_metrics(seqs)
    assert m["select/solver_accuracy"] == pytest.approx(1 / 6)
    assert m["select/exactly_one_rate"] == pytest.approx(1 / 2)
    with pytest.raises(ValueError, match="candidates"):
        make_workflow("solve_select", candidates=3, prompt_format="compact")
    with pytest.raises(TaskError, match="candidates"):
        make_workflow("solve_select", candidates=3).run(
            task("solve_select", {"prompt": "37+45=", "answer": "82"}, ["solver", "selector"]),
            {"solver": ScriptedEngine("solver"), "selector": ScriptedEngine("selector")}, 1)


def two_sets_of_two(replies: list[str], **options):
    """``solve_select`` over the solver's sets (80, 82) and (70, 71), the selector replying
    ``replies``: (its sequences, the selector's engine)."""
    selector = ChatEngine("selector", replies)
    seqs = make_workflow("solve_select", **options).run(
        arithmetic("solve_select", "selector"),
        {"solver": ChatEngine("solver", ["80", "82", "70", "71"]), "selector": selector}, 2)
    return seqs, selector


def test_solve_select_corrective_picks_the_answer_it_repeats_and_is_rewarded_by_its_reply():
    seqs, selector = two_sets_of_two(["82", "82"], corrective=True)
    picks = [s for s in seqs if s.role == "selector"]
    assert selector.prompts[0] == (f"[user]Problem: {PROBLEM}\nAnswer 1: 80\nAnswer 2: 82\n"
                                   "Reply with the correct answer, the number only.[assistant]")
    # a set with no right answer is not a tie here: its right reply is rewarded
    assert [(s.meta["pick"], s.meta["reply"], s.reward) for s in picks] == [
        ("2", "82", 1.0), ("?", "82", 1.0)]
    m = SolveSelect.group_metrics(seqs)
    assert m["select/selector_accuracy"] == 1.0 and m["select/final_accuracy"] == 0.5
    with pytest.raises(ValueError, match="corrective"):
        make_workflow("solve_select", corrective=True, prompt_format="compact")


def test_solve_select_blind_picks_the_answer_its_own_agrees_with():
    seqs, selector = two_sets_of_two(["82", "75"], blind=True)  # it answers twice
    assert selector.prompts == [f"[user]{PROBLEM}[assistant]"] * 2  # never the answers
    picks = [s for s in seqs if s.role == "selector"]
    # agrees with answer 2 of the first set; with neither of the second: the first answer
    assert [(s.meta["pick"], s.meta["agreed"], s.meta["own"], s.reward) for s in picks] == [
        ("2", "1", "82", 1.0), ("1", "0", "75", 0.0)]
    assert SolveSelect.group_metrics(seqs)["select/selector_accuracy"] == 1.0
    with pytest.raises(ValueError, match="not both"):
        make_workflow("solve_select", blind=True, corrective=True)


def test_solve_select_chat_unparseable_pick_gets_0():
    solver = ChatEngine("solver", ["82", "81"])
    selector = ChatEngine("selector", ["the first one"])
    seqs = make_workflow("solve_select").run(arithmetic("solve_select", "selector"),
                                             {"solver": solver, "selector": selector}, 1)
    (pick,) = [s for s in seqs if s.role == "selector"]
    assert pick.reward == 0.0 and pick.meta["pick"] == "?"


# --- code: parsing, mutants, the mutation reward --------------------------------------------
def test_assert_tests_and_programs_are_read_from_chat_replies():
    reply = ('Here are tests:\n```python\nassert f(1) == 4\n    assert f(2) == 5, "two"\n'
             'assert f(3) == 6.\nassert isinstance(f(1), int)\nassert f(1) == 4\n```')
    assert parse_assert_tests(reply, "f", 1) == ([([1], 4), ([2], 5), ([3], 6)], 5)
    assert parse_assert_tests("no tests", "f", 1) is None
    assert parse_assert_tests("assert g(1) == 2", "f", 1) == ([], 1)
    code = "Sure:\n```python\ndef f(x):\n    return x + 3\nprint(f(2))\n```\nDone."
    assert extract_program(code, "f") == "def f(x):\n    return x + 3\n"
    assert extract_program("def f(x, y):\n    return max(x, y)\n\nf(1, 2)", "f") == \
        "def f(x, y):\n    return max(x, y)\n"
    assert extract_program("def add(x):\n    return x + 3", "f") == ""


def test_mutants_change_one_thing():
    assert mutants("x+3") == ["x - 3", "x + 4", "x + 2"]
    assert mutants("max(x,y)") == ["min(x, y)"]
    assert mutants("sorted(xs)") == [] and mutants("(") == []
    assert len(mutants("3*x+2*y", limit=4)) == 4
    ns: dict = {}
    exec(mutants_source(["x"], ["x+4", "1//x"]), ns)  # noqa: S102 - our own source
    assert ns["f"](0) == [[True, 4], [False, None]]


# square x then add 9; mutants x*x-9, x+x+9, x*x+10, x*x+8 (all told apart by the tests)
CODE = CodeProblem("square x then add 9", ("x",), "x*x+9", 2,
                   (((0,), 9), ((2,), 13), ((3,), 18), ((-1,), 10)))


class CodeChatEngine(ChatEngine):
    def __init__(self, policy: str, by_role: dict[str, list[str]]):
        super().__init__(policy, [], version=5)
        self.by_role = by_role

    def next_reply(self, prompt: str, params) -> str:
        assert params.stop == ()
        return self.by_role["generator" if "test cases" in prompt else "solver"].pop(0)


def code_replies() -> dict[str, list[str]]:
    return {
        "solver": ["def f(x):\n    return x*x+9",
                   "Here:\n```python\ndef f(x):\n    return x*x\n```",  # fails, returns values
                   "I cannot.",  # no program
                   "def f(x):\n    return x+x+9"],  # right on 0 and 2 only
        "generator": ["```python\nassert f(2) == 13\nassert f(0) == 9\n```",
                      "assert f(3) == 18\nassert f(1) == 5\nassert f(2) == 4, 'sq'",
                      "I cannot write tests.",
                      "assert isinstance(f(1), int)\nassert f(0) == 9."],
    }


def run_code(**options):
    replies = code_replies()
    engines = {"solver": CodeChatEngine("solver", replies),
               "generator": CodeChatEngine("generator", replies)}
    wf = make_workflow("code_tests", generator_reward="mutation", **options)
    seqs = wf.run(task("code_tests", CODE.payload(), ["solver", "generator"]), engines, 4)
    return engines["solver"], seqs


def test_code_tests_chat_rewards_the_generator_by_the_wrong_programs_its_valid_tests_catch():
    engine, seqs = run_code()
    sol = [s for s in seqs if s.role == "solver"]
    gen = [s for s in seqs if s.role == "generator"]
    assert engine.prompts[0].startswith("[user]Write a Python function `def f(x):` for this "
                                        "task: square x then add 9.")
    assert [s.reward for s in sol] == [1.0, 0.0, 0.0, 0.5]
    assert [s.meta["status"] for s in sol] == ["ok", "ok", "empty", "ok"]
    # wrong programs: 4 live mutants and the 2 failing attempts that return values.
    # f(2)==13, f(0)==9: both valid, catch x*x-9, x*x+10, x*x+8 and `x*x` (4 of 6);
    # f(3)==18 valid, 2 of 3 asserts wrong: 1/3 of the asserts times all 6 caught;
    # unparseable: 0; f(0)==9 valid, one assert unusable: 1/2 times 4 of 6
    assert [s.reward for s in gen] == pytest.approx([4 / 6, 1 / 3, 0.0, 1 / 3])
    assert [s.meta.get("valid_share") for s in gen] == ["1.000", "0.333", "0.000", "0.500"]


def test_code_tests_format_weight_pays_for_well_formed_asserts():
    _, seqs = run_code(format_weight=0.5)
    gen = [s.reward for s in seqs if s.role == "generator"]
    # well-formed shares 2/2, 3/3, none, 1/2; half of each, plus half the reward above
    assert gen == pytest.approx([0.5 + 0.5 * 4 / 6, 0.5 + 0.5 / 3, 0.0, 0.25 + 0.5 / 3])
    with pytest.raises(ValueError, match="format_weight"):
        make_workflow("code_tests", format_weight=2)


def test_code_tests_value_weight_pays_for_asserted_values_near_the_references():
    _, seqs = run_code(value_weight=0.5)
    gen = [s for s in seqs if s.role == "generator"]
    # f(x) = x*x+9. Suite 2: f(3)==18 right (1), f(1)==5 against 10 (1 - 5/10), f(2)==4
    # against 13 (1 - 9/13). Suite 4: one item well-formed and right of two read
    near = [1.0, (1 + 0.5 + 4 / 13) / 3, 0.0, 0.5]
    assert [s.reward for s in gen] == pytest.approx(
        [0.5 * n + 0.5 * r for n, r in zip(near, [4 / 6, 1 / 3, 0.0, 1 / 3])])
    assert [float(s.meta["value_nearness"]) for s in gen] == pytest.approx(near, abs=1e-3)
    from astraflow.raas.workflows.code_tests import _nearness
    from astraflow.sandbox import CaseResult

    # what a model may assert: past float's range, infinite, not a number, a string
    for odd in (10 ** 400, float("inf"), float("nan"), "25", None):
        assert _nearness(CaseResult(True, 25), odd) == 0.0
    assert _nearness(CaseResult(True, "ab"), "ab") == 1.0  # right, of any type
    assert _nearness(CaseResult(False, None, "boom"), 25) == 0.0
    with pytest.raises(ValueError, match="value_weight: "):
        make_workflow("code_tests", value_weight=-0.1)
    with pytest.raises(ValueError, match="format_weight \\+ value_weight"):
        make_workflow("code_tests", format_weight=0.6, value_weight=0.5)


def test_code_tests_new_options_are_checked():
    with pytest.raises(ValueError, match="generator_reward"):
        make_workflow("code_tests", generator_reward="coverage")
    with pytest.raises(ValueError, match="prompt_format"):
        make_workflow("code_tests", prompt_format="markdown")


def test_the_held_out_tester_score_is_the_mutation_reward_without_attempts():
    assert mutation_reward("assert f(2) == 13\nassert f(0) == 9", CODE) == pytest.approx(3 / 4)
    assert mutation_reward("assert f(3) == 18\nassert f(1) == 1", CODE) == pytest.approx(1 / 2)
    assert mutation_reward("nothing", CODE) == 0.0


def test_held_out_judge_examples_are_balanced():
    payloads = [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(10, 30)]
    ver = chat_role_examples("verifier", payloads)
    assert sum(e["label"] for e in ver) == 10
    assert "Proposed answer: 20" in ver[0]["messages"][0]["content"]
    sel = chat_role_examples("selector", payloads)
    assert [e["label"] for e in sel[:4]] == [1, 2, 1, 2]
    with pytest.raises(ValueError, match="role"):
        chat_role_examples("coder", payloads)


@pytest.mark.parametrize("knows,want", [(True, 1.0), (False, 0.5)])
def test_a_blind_verifier_is_scored_on_its_own_answer_then_its_verdict(monkeypatch, knows,
                                                                     want):
    import re

    import astraflow.roles.chat_scoring as scoring
    from astraflow.models.chat import ChatFormat

    payloads = [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(10, 20)]
    asked = []

    def fake_generate(model, tokenizer, prompts, max_new_tokens=8, **kw):
        asked.append(prompts)
        if "Proposed answer" not in prompts[0]:  # the problem alone: the own answer
            return [str(2 * int(re.search(r"(\d+)\+", p).group(1))) if knows else "0"
                    for p in prompts]
        # judges by its own answer: yes when the candidate is what it answered
        return ["yes" if re.search(r"\[assistant\](\d+)\[user\]Proposed answer: (\d+)",
                                   p).group(1) == re.search(r"answer: (\d+)", p).group(1)
                else "no" for p in prompts]

    monkeypatch.setattr(scoring, "generate_answers", fake_generate)
    score = scoring.chat_role_scorer("verifier", payloads, ChatFormat(), 8, blind=True)
    assert score(None, ChatTokenizer()) == want
    assert asked[0][0] == "[user]What is 10+10?[assistant]"
    # agreement: its own answer is the verdict (right: 1.0; always 0: never agrees, 0.5)
    agree = scoring.chat_role_scorer("verifier", payloads, ChatFormat(), 8, blind=True,
                                     agreement=True)
    assert agree(None, ChatTokenizer()) == want
    with pytest.raises(ValueError, match="agreement"):
        scoring.chat_role_scorer("verifier", payloads, ChatFormat(), agreement=True)
    # a blind selector picks the answer its own agrees with, else the first (right in
    # turn: 0.5)
    pick = scoring.chat_role_scorer("selector", payloads, ChatFormat(), 8, blind=True)
    assert pick(None, ChatTokenizer()) == want


@pytest.mark.parametrize("role,knows,want", [("verifier", True, 1.0), ("verifier", False, 0.5),
                                             ("selector", True, 1.0), ("selector", False, 0.0)])
def test_a_corrective_judge_is_scored_by_agreement(monkeypatch, role, knows, want):
    import re

    import astraflow.roles.chat_scoring as scoring
    from astraflow.models.chat import ChatFormat

    payloads = [{"prompt": f"What is {a}+{a}?", "answer": str(2 * a)} for a in range(10, 20)]
    asked = []

    def fake_generate(model, tokenizer, prompts, max_new_tokens=8, **kw):
        asked.extend(prompts)  # replies with the sum when it knows it, else with 0
        return [str(2 * int(re.search(r"(\d+)\+", p).group(1))) if knows else "0"
                for p in prompts]

    monkeypatch.setattr(scoring, "generate_answers", fake_generate)
    score = scoring.chat_role_scorer(role, payloads, ChatFormat(), 8, corrective=True)
    assert score(None, ChatTokenizer()) == want
    assert asked[0].endswith("Reply with the correct answer, the number only.[assistant]")
    with pytest.raises(ValueError, match="not both"):
        scoring.chat_role_scorer(role, payloads, ChatFormat(), blind=True, corrective=True)


def test_a_code_role_needs_a_pretrained_model():
    base = {"run": "r", "policies": {"solver": {"model": "m", "role": "coder"}}}
    with pytest.raises(ValueError, match="role: a coder has no tiny warm start"):
        parse_topology(base)
    base["policies"]["solver"]["import_from"] = "smollm2"
    assert parse_topology(base).policies["solver"].role == "coder"


@pytest.mark.parametrize("role,evals,error", [
    ("selector", {"blind": True}, None),
    ("coder", {"blind": True}, "eval.blind"),
    ("selector", {"blind": True, "agreement": True}, "eval.agreement"),
    ("verifier", {"agreement": True}, "eval.agreement"),
    ("verifier", {"blind": True, "agreement": True}, None),
    ("solver", {"corrective": True}, "eval.corrective"),
])
def test_a_judges_evaluation_flags_are_checked_at_parse(role, evals, error):
    base = {"run": "r", "policies": {"p": {"model": "m", "role": role, "init_tiny": False,
                                           "import_from": "smollm2", "eval": evals}}}
    if error is None:
        assert parse_topology(base).policies["p"].eval.blind
    else:
        with pytest.raises(ValueError, match=error):
            parse_topology(base)
