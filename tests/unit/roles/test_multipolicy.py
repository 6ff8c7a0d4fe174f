"""Multi-policy runs (solver + verifier, solver + selector).

Without Kafka: the solve_verify and solve_select workflows against scripted engines
(rewards, roles, prompts, metrics), the role formats and warm-start examples, the router
split, the launcher's plan and progress. On the broker:
tests/integration/roles/test_multipolicy.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from astraflow.dataflow import Incoming
from astraflow.dataflow.router import PolicyRouter, RouterOptions, split_by_policy
from astraflow.raas.workflows import WORKFLOWS, TaskError, make_workflow
from astraflow.raas.workflows.solve_select import SolveSelect
from astraflow.raas.workflows.solve_verify import SolveVerify
from astraflow.roles.formats import (
    parse_pick,
    parse_verdict,
    retry_prompt,
    select_prompt,
    verify_prompt,
)
from astraflow.roles.scoring import role_eval_examples
from astraflow.roles.teacher import retry_examples, selector_examples, verifier_examples
from astraflow.wire.records import ComponentStatus, Task, TrajectoryGroup
from tests.conftest import REPO
from tests.fakes import ScriptedEngine


def task(prompt: str = "37+45=", answer: str = "82", workflow: str = "solve_verify") -> Task:
    return Task(task_id="t", prompt_id="p", workflow=workflow,
                payload=json.dumps({"prompt": prompt, "answer": answer}), source="test",
                policies=["solver", "verifier"])


def check_masks(s, prompt: str) -> None:
    n = len(s.token_ids)
    assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n
    assert "".join(chr(t) for t in s.token_ids[: len(prompt)]) == prompt
    assert s.loss_mask == [0] * len(prompt) + [1] * (n - len(prompt))
    assert s.versions[: len(prompt)] == [-1] * len(prompt)


# --- solve_verify ---------------------------------------------------------------------------
def test_solve_verify_is_registered_for_the_node():
    assert {"solve_verify", "solve_select", "single_turn"} <= set(WORKFLOWS)
    assert isinstance(make_workflow("solve_verify"), SolveVerify)


def test_solve_verify_rewards_roles_prompts_and_metrics():
    solver = ScriptedEngine("solver", ["82", "73", "82", "91", "80",
                                       # retries of the rejected answers 1 and 2
                                       "82", "82"], version=5)
    verifier = ScriptedEngine("verifier", ["y", "n", "n", "y", "x"], version=2)
    wf = make_workflow("solve_verify", max_new_tokens=4)
    seqs = wf.run(task(), {"solver": solver, "verifier": verifier}, 5)

    firsts = [s for s in seqs if s.role == "solver"]
    verdicts = [s for s in seqs if s.role == "verifier"]
    retries = [s for s in seqs if s.role == "solver_retry"]
    assert len(firsts) == len(verdicts) == 5 and len(retries) == 2
    assert {s.policy for s in firsts + retries} == {"solver"}
    assert {s.policy for s in verdicts} == {"verifier"}
    # solver: correctness of its own answers
    assert [s.reward for s in firsts] == [1.0, 0.0, 1.0, 0.0, 0.0]
    # verifier: verdict matches the truth of the first answer; "x" is unparseable
    assert [s.meta["verdict"] for s in verdicts] == ["y", "n", "n", "y", "?"]
    assert [s.reward for s in verdicts] == [1.0, 1.0, 0.0, 0.0, 0.0]
    # only explicit rejections are retried, with the rejection in the prompt
    assert [s.sample_index for s in retries] == [1, 2]
    assert [s.reward for s in retries] == [1.0, 1.0]
    assert verifier.prompts == ["37+45=82?", "37+45=73?", "37+45=82?", "37+45=91?", "37+45=80?"]
    assert solver.prompts[1:] == ["37+45=73?n 37+45=", "37+45=82?n 37+45="]
    assert retries[0].meta["rejected"] == "73" and retries[0].meta["attempt"] == "2"
    for s in firsts:
        check_masks(s, "37+45=")
        assert s.min_version == 5
    for s, shown in zip(verdicts, ["82", "73", "82", "91", "80"]):
        check_masks(s, f"37+45={shown}?")
        assert s.min_version == 2
    check_masks(retries[0], "37+45=73?n 37+45=")

    m = SolveVerify.group_metrics(seqs)
    assert m["verify/approval_rate"] == pytest.approx(2 / 5)
    assert m["verify/retry_rate"] == pytest.approx(2 / 5)
    assert m["verify/verifier_accuracy"] == pytest.approx(2 / 5)
    assert m["verify/solver_first_accuracy"] == pytest.approx(2 / 5)
    # finals: 82, retry 82, retry 82, 91, 80
    assert m["verify/solver_final_accuracy"] == pytest.approx(3 / 5)
    assert m["verify/unparseable_rate"] == pytest.approx(1 / 5)


def test_blind_verifier_answers_before_it_sees_the_candidate():
    solver = ScriptedEngine("solver", ["82", "73", "73", "82", "82"], version=5)
    # first turn: own answers (the third one never ends), then one verdict per own answer
    verifier = ScriptedEngine("verifier", ["82|", "73|", "8", "y", "y"], version=2)
    budgets: list[int] = []
    real = verifier.generate
    verifier.generate = lambda ps, params: budgets.append(params.max_new_tokens) or real(ps, params)
    wf = make_workflow("solve_verify", max_new_tokens=4, blind=True)
    seqs = wf.run(task(), {"solver": solver, "verifier": verifier}, 3)
    assert budgets == [8, 1]  # the second turn samples the verdict token only

    verdicts = [s for s in seqs if s.role == "verifier"]
    assert [s.policy for s in verdicts] == ["verifier"] * 3
    assert verifier.prompts == ["37+45=", "37+45=82|82?", "37+45=73|73?"]
    # right answer approved; a wrong answer its own (wrong) answer agrees with approved;
    # no own answer: no verdict asked, unparseable
    assert [s.meta["verdict"] for s in verdicts] == ["y", "y", "?"]
    assert [s.reward for s in verdicts] == [1.0, 0.0, 0.0]
    assert [s.meta["own"] for s in verdicts] == ["82", "73", ""]
    assert [s.meta["own_matches"] for s in verdicts] == ["1", "1", "0"]
    first, second, unfinished = verdicts
    assert "".join(map(chr, first.token_ids)) == "37+45=82|82?y"
    # trained: the own answer and the verdict, not the prompt nor the candidate shown
    assert first.loss_mask == [0] * 6 + [1] * 3 + [0] * 3 + [1]
    assert first.versions == [-1] * 6 + [2] * 3 + [-1] * 3 + [2]
    assert len(first.logprobs) == len(first.token_ids)
    check_masks(unfinished, "37+45=")
    # the rejected-answer retries follow the verdicts as in the seen format: none here
    assert not [s for s in seqs if s.role == "solver_retry"]
    assert SolveVerify.group_metrics(seqs)["verify/approval_rate"] == pytest.approx(2 / 3)


def test_verifier_judges_only_the_first_answers_it_is_asked_to():
    solver = ScriptedEngine("solver", ["73", "82", "73", "73", "82"])  # 4 tries, 1 retry
    verifier = ScriptedEngine("verifier", ["82|", "82|", "n", "y"])
    wf = make_workflow("solve_verify", blind=True, verdicts_per_prompt=2)
    seqs = wf.run(task(), {"solver": solver, "verifier": verifier}, 4)
    verdicts = [s for s in seqs if s.role == "verifier"]
    retries = [s for s in seqs if s.role == "solver_retry"]
    assert [s.sample_index for s in verdicts] == [0, 1]
    assert verifier.prompts == ["37+45=", "37+45=82|73?", "37+45=82|82?"]
    assert [s.reward for s in verdicts] == [1.0, 1.0]
    # answers 2 and 3 (wrong, never judged) are not retried
    assert [s.sample_index for s in retries] == [0] and retries[0].reward == 1.0
    m = SolveVerify.group_metrics(seqs)
    assert m["verify/approval_rate"] == pytest.approx(1 / 2)  # per verdict
    assert m["verify/retry_rate"] == pytest.approx(1 / 4)  # per answer
    with pytest.raises(ValueError, match="verdicts_per_prompt"):
        make_workflow("solve_verify", verdicts_per_prompt=0)


def test_blind_verifier_examples_train_own_answer_and_verdict_only():
    from astraflow.models.examples import encode_segments
    from astraflow.roles.formats import blind_verdict_context, own_answer
    from astraflow.tasks.arithmetic import train_problems

    problems = train_problems((1, 2), n=300)
    examples = verifier_examples(problems, 500, seed=2, blind=True)
    for e in examples:
        own_seg, cand_seg, verdict_seg = e["segments"]
        assert own_seg == [e["own"] + "|", 1] and cand_seg == [e["candidate"] + "?", 0]
        assert verdict_seg == [e["answer"], 1]
        # noise-free teacher: approves exactly the candidates equal to its own answer
        assert (e["answer"] == "y") == (e["own"] == e["candidate"])
    assert 0.4 < sum(e["truth"] for e in examples) / len(examples) < 0.6

    class CharTok:
        eos_token_id = 0

        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [ord(c) for c in text]}

    ids, mask = encode_segments(CharTok(), "37+45=", [["82|", 1], ["73?", 0], ["n", 1]])
    assert "".join(map(chr, ids[:-1])) == blind_verdict_context("37+45=", "82", "73") + "n"
    assert mask == [0] * 6 + [1] * 3 + [0] * 3 + [1, 1]
    assert own_answer("82|") == "82" and own_answer("82") is None


class _ByPrompt(ScriptedEngine):
    """Replies that depend only on the prompt and how often it was asked."""

    def __init__(self, policy, reply):
        super().__init__(policy)
        self.reply, self.asked = reply, {}

    def next_reply(self, prompt, params):
        k = self.asked[prompt] = self.asked.get(prompt, -1) + 1
        return self.reply(prompt, k)


def _engines():
    def solve(prompt, k):
        a, b = prompt.rsplit(" ", 1)[-1].rstrip("=").split("+")
        right = int(a) + int(b)
        return str(right) if "?n" in prompt or k % 3 == 0 else str(right + k)

    def verify(prompt, k):
        a, rest = prompt.split("+")
        b, cand = rest.rstrip("?").split("=")
        return "y" if int(cand) == int(a) + int(b) or k % 2 else "n"

    return {"solver": _ByPrompt("solver", solve), "verifier": _ByPrompt("verifier", verify)}


def test_solve_verify_batch_is_the_tasks_run_one_by_one():
    from astraflow.raas.workflows import TaskError

    wf = make_workflow("solve_verify", max_new_tokens=4)
    tasks = [task("12+30=", "42"), task("bad", "x"), task("7+5=", "12")]
    tasks[1] = Task(task_id="t2", prompt_id="p2", workflow="solve_verify",
                    payload=json.dumps({"prompt": "1+1="}), source="test")
    engines = _engines()
    batch = wf.run_batch(tasks, engines, 4)
    assert isinstance(batch[1], TaskError) and "answer" in str(batch[1])
    # one generate call per phase for all tasks: first tries and retries, verdicts
    assert len(engines["solver"].calls) == 2 and len(engines["verifier"].calls) == 1
    assert len(engines["solver"].calls[0]) == 2 and len(engines["verifier"].calls[0]) == 8
    for t, got in zip([tasks[0], tasks[2]], [batch[0], batch[2]]):
        alone = wf.run(t, _engines(), 4)
        assert [(s.policy, s.role, s.token_ids, s.reward, s.meta) for s in got] == [
            (s.policy, s.role, s.token_ids, s.reward, s.meta) for s in alone]
        assert {s.role for s in got} == {"solver", "verifier", "solver_retry"}
    st = make_workflow("single_turn", max_new_tokens=4)
    one = st.run_batch([task("12+30=", "42", "single_turn"), tasks[1],
                        task("7+5=", "12", "single_turn")], {"solver": _engines()["solver"]}, 3)
    assert isinstance(one[1], TaskError)
    assert [s.reward for s in one[0]] == [1.0, 0.0, 0.0] == [s.reward for s in one[2]]


def test_solve_verify_options_and_errors():
    solver = ScriptedEngine("alice", ["1", "2"])
    judge = ScriptedEngine("bob", ["n", "n"])
    wf = make_workflow("solve_verify", solver_policy="alice", verifier_policy="bob",
                       retry=False)
    seqs = wf.run(task("1+1=", "2"), {"alice": solver, "bob": judge}, 2)
    assert [(s.policy, s.role, s.reward) for s in seqs] == [
        ("alice", "solver", 0.0), ("alice", "solver", 1.0),
        ("bob", "verifier", 1.0), ("bob", "verifier", 0.0)]
    m = SolveVerify.group_metrics(seqs)
    assert m["verify/retry_rate"] == 0.0 and m["verify/approval_rate"] == 0.0
    # the verifier's sampling defaults to 8 new tokens (own answer, verdict, end)
    assert wf.judge_sampling.max_new_tokens == 8
    with pytest.raises(TaskError, match="verifier policy 'verifier'"):
        make_workflow("solve_verify").run(task(), {"solver": ScriptedEngine("solver", ["1"])}, 1)
    with pytest.raises(TaskError):
        make_workflow("solve_verify").run(
            Task(task_id="t", prompt_id="p", workflow="solve_verify", payload="{}", source="s"),
            {"solver": solver, "verifier": judge}, 1)
    # an answer without a number is shown as nothing and is wrong
    solver = ScriptedEngine("solver", ["abc", "82"])
    verifier = ScriptedEngine("verifier", ["n"])
    seqs = make_workflow("solve_verify").run(task(), {"solver": solver, "verifier": verifier}, 1)
    assert verifier.prompts == ["37+45=?"] and [s.reward for s in seqs] == [0.0, 1.0, 1.0]


def test_one_policy_can_play_both_roles_and_router_splits_roles():
    actor = ScriptedEngine("actor", ["82", "n", "83"])
    wf = make_workflow("solve_verify", solver_policy="actor", verifier_policy="actor")
    seqs = wf.run(task(), {"actor": actor}, 1)
    assert [(s.role, s.reward) for s in seqs] == [
        ("solver", 1.0), ("verifier", 0.0), ("solver_retry", 0.0)]
    g = group_of(seqs, "g")
    (only,) = PolicyRouter("r", ["trajectories"], ["samples.actor"]).process(incoming(g))
    assert only.record.group_id == "g/actor" and len(only.record.sequences) == 3
    router = PolicyRouter("r", ["trajectories"], ["samples.actor"],
                          RouterOptions(split_roles=True))
    outs = list(router.process(incoming(g)))
    assert [o.record.group_id for o in outs] == [
        "g/actor/solver", "g/actor/verifier", "g/actor/solver_retry"]
    assert [o.record.rewards for o in outs] == [[1.0], [0.0], [0.0]]


# --- solve_select ---------------------------------------------------------------------------
def test_solve_select_rewards_ties_and_metrics():
    answers = ["82", "73",  # exactly one right, picks 1: right
               "73", "82",  # exactly one right, picks 1: wrong
               "82", "82",  # both right: a tie
               "73", "91",  # neither right: a tie
               "82", "73"]  # exactly one right, unparseable pick
    picks = ["1", "1", "2", "1", "z"]

    def run(**opts):
        solver = ScriptedEngine("solver", answers)
        selector = ScriptedEngine("selector", picks)
        seqs = make_workflow("solve_select", **opts).run(
            task(workflow="solve_select"), {"solver": solver, "selector": selector}, 5)
        return seqs, selector

    seqs, selector = run()
    assert selector.prompts == ["37+45=82|73>", "37+45=73|82>", "37+45=82|82>",
                                "37+45=73|91>", "37+45=82|73>"]
    solver_seqs = [s for s in seqs if s.role == "solver"]
    assert [s.reward for s in solver_seqs] == [1, 0, 0, 1, 1, 1, 0, 0, 1, 0]
    assert [s.sample_index for s in solver_seqs] == list(range(10))
    picked = {s.sample_index: s for s in seqs if s.role == "selector"}
    # ties are skipped by default; an unparseable pick stays with reward 0
    assert sorted(picked) == [0, 1, 4]
    assert [picked[j].reward for j in (0, 1, 4)] == [1.0, 0.0, 0.0]
    assert all(s.policy == "selector" for s in picked.values())
    m = SolveSelect.group_metrics(seqs)
    assert m["select/solver_accuracy"] == pytest.approx(0.5)
    assert m["select/exactly_one_rate"] == pytest.approx(3 / 5)
    assert m["select/selector_accuracy"] == pytest.approx(1 / 3)
    # finals: right, wrong (picked 73), right (tie), wrong (tie), right (unparseable: first)
    assert m["select/final_accuracy"] == pytest.approx(3 / 5)
    assert m["select/unparseable_rate"] == pytest.approx(1 / 5)

    seqs, _ = run(ties="outcome")
    picked = {s.sample_index: s.reward for s in seqs if s.role == "selector"}
    assert picked == {0: 1.0, 1: 0.0, 2: 1.0, 3: 0.0, 4: 0.0}
    with pytest.raises(ValueError, match="ties"):
        make_workflow("solve_select", ties="maybe")


# --- role formats and warm-start examples ---------------------------------------------------
def test_role_formats_fit_the_tiny_model():
    from astraflow.models.tiny import CHARSET, MAX_POSITIONS

    for text in (verify_prompt("37+45=", "82"), retry_prompt("37+45=", "82"),
                 select_prompt("37+45=", "82", "83")):
        assert set(text) <= set(CHARSET) and len(text) < MAX_POSITIONS // 4
    assert retry_prompt("37+45=", "82") == "37+45=82?n 37+45="
    assert parse_verdict(" y") is True and parse_verdict("No") is False
    assert parse_verdict("82y") is True and parse_verdict("73 n") is False
    assert parse_verdict("") is None and parse_verdict("<|endoftext|>y") is None
    assert parse_verdict("maybe") is None and parse_verdict("82") is None
    assert parse_pick("2") == 2 and parse_pick(" 1x") == 1 and parse_pick("3") is None
    assert parse_pick("82:1") == 1 and parse_pick("82:2") == 2 and parse_pick("82") is None


def test_verifier_examples_are_balanced_and_noisy():
    from astraflow.tasks.arithmetic import train_problems

    problems = train_problems((1, 2), n=500)
    clean = verifier_examples(problems, 4000, seed=1)
    # the teacher recomputes (its own answer first), then judges
    assert all(parse_verdict(e["answer"]) == e["truth"] for e in clean)
    assert all(e["answer"][:-1] == e["prompt"][:-1].split("=")[1] for e in clean if e["truth"])
    assert 0.45 < sum(e["truth"] for e in clean) / len(clean) < 0.55
    for e in clean:  # the candidate answer is right exactly when truth says so
        prompt, cand = e["prompt"].split("=")
        from astraflow.tasks.check import check_answer

        want = next(p.answer for p in problems if p.prompt == prompt + "=")
        assert (check_answer(cand[:-1], want) == 1.0) == e["truth"]
    noisy = verifier_examples(problems, 4000, seed=1, slip=1.0, noise=0.1)
    wrong = [e for e in noisy if parse_verdict(e["answer"]) != e["truth"]]
    assert 0.1 < len(wrong) / len(noisy) < 0.5
    # the blind spot: forgotten carries are approved, right answers to carry problems
    # rejected, near misses still rejected
    carry = [e for e in noisy if e["kind"] == "carry"]
    near = [e for e in noisy if e["kind"] == "near"]
    approve = lambda es: sum(parse_verdict(e["answer"]) for e in es) / len(es)  # noqa: E731
    assert near and approve(near) < 0.2
    import astraflow.tasks.arithmetic as arith

    if hasattr(arith, "carry_slip_answer"):  # forgotten carries exist as wrong answers
        assert carry and approve(carry) > 0.8
    bare = verifier_examples(problems, 10, seed=1, think=False)
    assert {e["answer"] for e in bare} <= {"y", "n"}
    sel = selector_examples(problems, 1000, seed=2, noise=0.0)
    assert all(parse_pick(e["answer"]) == e["truth"] for e in sel)
    assert {e["answer"][-1] for e in sel} == {"1", "2"} and all(":" in e["answer"] for e in sel)
    assert {e["answer"] for e in selector_examples(problems, 50, seed=2, think=False)} == {
        "1", "2"}


def test_retry_examples_follow_a_rejected_mistake_with_the_teachers_answer():
    from astraflow.tasks.arithmetic import carry_slip_answer, train_problems

    problems = train_problems((1, 2), n=500)
    by_prompt = {p.prompt: p for p in problems}
    clean = retry_examples(problems, 2000, seed=3)
    for e in clean:
        first, again = e["prompt"].split("?n ")
        problem = by_prompt[again]
        rejected = first[len(again):]
        assert e["prompt"] == retry_prompt(again, rejected)
        assert rejected != problem.answer  # only wrong answers are rejected
        assert e["answer"] == e["truth"] == problem.answer
    assert {"carry", "near"} <= {e["kind"] for e in clean}
    slipping = retry_examples(problems, 2000, seed=3, slip=1.0)
    can_slip = [e for e in slipping
                if carry_slip_answer(by_prompt[e["prompt"].split("?n ")[1]]) != e["truth"]]
    assert can_slip and all(e["answer"] != e["truth"] for e in can_slip)
    assert retry_examples(problems, 5, seed=3) == retry_examples(problems, 5, seed=3)
    with pytest.raises(ValueError, match="needs problems"):
        retry_examples([], 1)


def test_role_eval_examples_are_held_out_and_balanced():
    from astraflow.tasks.arithmetic import split_of

    ver = role_eval_examples("verifier", (1, 2), 100)
    assert len(ver) == 100 and sum(e["label"] == "y" for e in ver) == 50
    assert all(split_of(e["prompt"].split("=")[0] + "=") == "eval" for e in ver)
    sel = role_eval_examples("selector", (1, 2), 10)
    assert [e["label"] for e in sel] == ["1", "2"] * 5
    with pytest.raises(ValueError):
        role_eval_examples("critic")


def test_init_role_cli_writes_a_role_model(tmp_path):
    from astraflow.cli.main import build_parser, main
    from astraflow.config.topology import PolicySpec
    from astraflow.launch.provision import model_init_command, tiny_model_outdated
    from astraflow.models.loading import load_policy
    from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE, init_recipe

    d = tmp_path / "verifier"
    spec = PolicySpec(model=str(d), role="verifier", warm_start={
        "steps": 3, "slip": 0.5, "train_size": 200, "eval_size": 10, "batch_size": 8,
        "levels": "1"})
    # recipes an earlier model left: neither describes the new one
    d.mkdir()
    (d / INIT_RECIPE).write_text(json.dumps({"model_command": "init"}))
    (d / OLD_ROLE_RECIPE).write_text("{}")
    assert tiny_model_outdated(spec).startswith("the topology changed")
    # the very command `astraflow up` runs
    cmd = model_init_command(spec)
    assert main(cmd) == 0
    assert not (d / OLD_ROLE_RECIPE).exists()
    recipe = json.loads((d / INIT_RECIPE).read_text())
    assert recipe == init_recipe(build_parser().parse_args(cmd))
    assert recipe["role"] == "verifier" and recipe["model_command"] == "init-role"
    assert recipe["label_noise"] == 0.02 and recipe["levels"] == "1" and recipe["seed"] == 0
    assert recipe["warm_start_steps"] == 3 and recipe["carry_slip"] == 0.5
    assert tiny_model_outdated(spec) == ""
    assert "role verifier -> selector" in tiny_model_outdated(
        spec.model_copy(update={"role": "selector"}))
    assert "warm_start_steps 3 -> 4" in tiny_model_outdated(spec.model_copy(update={
        "warm_start": spec.warm_start.model_copy(update={"steps": 4})}))
    model, tok = load_policy(d)  # loads (how well it verifies is a bench's question)
    assert model.config.vocab_size == len(tok)
    with pytest.raises(SystemExit):
        main(["model", "init-role", str(d), "--role", "critic"])


def test_init_role_blind_writes_and_scores_a_two_turn_verifier(tmp_path):
    from astraflow.cli.main import main
    from astraflow.config.topology import PolicySpec
    from astraflow.launch.provision import model_init_command, tiny_model_outdated
    from astraflow.models.loading import load_policy
    from astraflow.models.recipe import INIT_RECIPE
    from astraflow.roles.scoring import blind_verdicts

    d = tmp_path / "blind"
    spec = PolicySpec(model=str(d), role="verifier", warm_start={
        "steps": 3, "blind": True, "train_size": 200, "eval_size": 10, "batch_size": 8,
        "levels": "1"})
    assert main(model_init_command(spec)) == 0
    assert json.loads((d / INIT_RECIPE).read_text())["blind"] is True
    assert tiny_model_outdated(spec) == ""
    # the seen-format recipe is another model
    assert "blind True -> False" in tiny_model_outdated(spec.model_copy(update={
        "warm_start": spec.warm_start.model_copy(update={"blind": False})}))
    model, tok = load_policy(d)
    examples = role_eval_examples("verifier", (1,), 6)
    out = blind_verdicts(model, tok, examples)
    assert len(out) == 6
    for own, verdict in out:  # no own answer: no verdict asked
        assert own is not None or verdict == ""
    assert main(["model", "init-role", str(tmp_path / "s"), "--role", "selector", "--blind",
                 "--warm-start-steps", "0"]) == 2


def bigram_model(next_char: dict[str, str]):
    """A real Llama (the tiny model's tokenizer, one layer) whose greedy next token is a
    fixed function of the current one: ``next_char[c]`` after ``c``, else end of sequence.
    Attention and MLP write nothing (zero output projections), so the last position holds
    its token's one-hot embedding, and the untied head maps it to the chosen next token:
    what it answers is known, so is every accuracy it gets."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from astraflow.models.tiny import build_tokenizer

    tok = build_tokenizer()
    vocab = len(tok)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=8,
                      num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    assert vocab <= cfg.hidden_size
    model = LlamaForCausalLM(cfg).eval()
    ids = tok.convert_tokens_to_ids
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
        model.model.embed_tokens.weight[:, :vocab] = torch.eye(vocab)
        model.model.norm.weight.fill_(1.0)
        head = model.lm_head.weight
        head[tok.eos_token_id, :vocab] = 1.0  # by default: stop
        for a, b in next_char.items():
            head[:, ids(a)] = 0.0
            head[ids(b), ids(a)] = 1.0
    return model, tok


def test_evaluate_role_scores_known_answers_exactly():
    """Role models whose answers are known: a verifier that approves everything, blind or
    not, and a selector that always picks the first answer score exactly one half on the
    balanced held-out examples, and as many as their labels agree on a subset."""
    from astraflow.roles.scoring import blind_verdicts, evaluate_role

    verifier, tok = bigram_model({"?": "y"})  # "37+45=82?" -> "y"
    examples = role_eval_examples("verifier", (1, 2), 8)
    assert evaluate_role(verifier, tok, "verifier", examples) == 0.5
    # labels y, n, y: two of three approvals are right
    assert evaluate_role(verifier, tok, "verifier", examples[:3]) == 2 / 3
    rejecting, tok = bigram_model({"?": "n"})
    assert evaluate_role(rejecting, tok, "verifier", examples[:3]) == 1 / 3

    # blind: "37+45=" -> "|" (an empty own answer ends the first turn), "...|82?" -> "y"
    blind, tok = bigram_model({"=": "|", "?": "y"})
    assert blind_verdicts(blind, tok, examples) == [("", "y")] * 8
    assert evaluate_role(blind, tok, "verifier", examples, blind=True) == 0.5
    mute, tok = bigram_model({})  # ends every turn at once: no own answer, no verdict
    assert evaluate_role(mute, tok, "verifier", examples, blind=True) == 0.0
    with pytest.raises(ValueError, match="blind"):
        evaluate_role(blind, tok, "selector", examples, blind=True)

    selector, tok = bigram_model({">": "1"})  # "37+45=82|83>" -> "1"
    picks = role_eval_examples("selector", (1, 2), 6)
    assert [e["label"] for e in picks] == ["1", "2"] * 3
    assert evaluate_role(selector, tok, "selector", picks) == 0.5
    assert evaluate_role(selector, tok, "selector", picks[:1]) == 1.0


# --- router, launcher -----------------------------------------------------------------------
def group_of(seqs, gid: str) -> TrajectoryGroup:
    return TrajectoryGroup(group_id=gid, prompt_id=gid, task_id=gid, workflow="solve_verify",
                           source="test", raas_id="r", pool="p", sequences=list(seqs),
                           rewards=[s.reward for s in seqs])


def incoming(g: TrajectoryGroup) -> Incoming:
    return Incoming("trajectories", 0, 0, g.prompt_id.encode(), g)


def verify_group(gid: str, n: int = 4) -> TrajectoryGroup:
    solver = ScriptedEngine("solver", ["82", "73"] * n + ["82"] * n, version=0)
    verifier = ScriptedEngine("verifier", ["y", "n"] * n, version=0)
    seqs = make_workflow("solve_verify").run(task(), {"solver": solver, "verifier": verifier}, n)
    return group_of(seqs, gid)


def test_router_splits_a_solve_verify_group_per_policy():
    g = verify_group("g", 4)
    parts = split_by_policy(g)
    assert set(parts) == {"solver", "verifier"}
    assert [s.role for s in parts["solver"].sequences] == ["solver"] * 4 + ["solver_retry"] * 2
    assert [s.role for s in parts["verifier"].sequences] == ["verifier"] * 4
    assert parts["verifier"].rewards == [s.reward for s in parts["verifier"].sequences]
    from astraflow.wire.validate import InvalidRecord

    with pytest.raises(InvalidRecord, match="samples.verifier"):
        list(PolicyRouter("r", ["trajectories"], ["samples.solver"]).process(incoming(g)))
    outs = list(PolicyRouter("r", ["trajectories"], ["samples.solver", "samples.verifier"])
                .process(incoming(g)))
    assert {o.topic: len(o.record.sequences) for o in outs} == {
        "samples.solver": 6, "samples.verifier": 4}


def test_launcher_plans_one_trainer_and_evaluator_per_policy():
    from astraflow.cli.components import configuration
    from astraflow.config.topology import load_topology
    from astraflow.launch.plan import plan_processes

    path = "topology/solver-verifier.yaml"
    topo = load_topology(REPO / path)
    assert topo.policies["verifier"].role == "verifier" and topo.policies["solver"].role == "solver"
    procs = plan_processes(topo, path)
    assert {n for n in procs if n.startswith(("trainer-", "eval-"))} == {
        "trainer-solver", "trainer-verifier", "eval-solver", "eval-verifier"}
    # what each process runs with, as its command builds it from the file
    run = {name: configuration(cmd[3:], topo) for name, cmd in procs.items()
           if name.startswith(("trainer-", "eval-", "raas-", "feeder"))}
    assert run["trainer-verifier"].policy == "verifier"
    assert run["eval-solver"].role == "solver" and run["eval-verifier"].role == "verifier"
    raas = run["raas-local-0"].settings
    assert {p: str(m) for p, m in raas.models.items()} == {
        "solver": "runs/solver-verifier/solver", "verifier": "runs/solver-verifier/verifier"}
    assert {"processor-batcher-solver", "processor-batcher-verifier"} <= set(procs)
    assert run["feeder"].workflow == "solve_verify"


def test_policy_eval_settings_and_niceness_reach_its_processes():
    import pydantic

    from astraflow.cli.components import configuration
    from astraflow.config.topology import load_topology
    from astraflow.launch.plan import plan_processes, process_niceness

    topo = load_topology(REPO / "topology/solver-verifier.yaml")
    spec = topo.policies["verifier"]
    spec.eval, spec.nice = type(spec.eval)(blind=True, every_versions=20), 10
    procs = plan_processes(topo, "t.yaml")
    verifier, solver = (configuration(procs[f"eval-{p}"][3:], topo)
                        for p in ("verifier", "solver"))
    # the policy's own every_versions wins over the topology's
    assert verifier.every_versions == 20 and verifier.blind
    assert not solver.blind and solver.every_versions == 5
    assert process_niceness(topo) == {"trainer-verifier": 10, "eval-verifier": 10}
    with pytest.raises(pydantic.ValidationError, match="nice"):
        type(spec)(model="m", nice=20)


def test_progress_shows_each_policy():
    from astraflow.launch.progress import Progress

    pr = Progress()
    for policy, v, r in (("solver", 7, 0.6), ("verifier", 5, 0.8)):
        pr.fold(ComponentStatus(component_id=f"trainer.{policy}/up", kind="trainer", host="h",
                                policy=policy, weight_versions={policy: v},
                                metrics={"trainer/reward_mean": r, "trainer/wait_fraction": 0.1}))
        pr.fold(ComponentStatus(component_id=f"eval-{policy}/h", kind="evaluator", host="h",
                                policy=policy,
                                weight_versions={policy: v}, metrics={"eval/accuracy": r - 0.1}))
    pr.fold(ComponentStatus(component_id="raas.local/0", kind="raas", host="h", metrics={
        "rollout/reward_mean": 0.7, "rollout/reward_mean/solver": 0.55,
        "rollout/reward_mean/verifier": 0.85, "verify/retry_rate": 0.25,
        "raas/gen_tokens": 10.0}))
    line = pr.line(3)
    for part in ("solver v7 reward 0.600", "verifier v5 reward 0.800", "eval 0.700@v5",
                 "solver rollout reward 0.550", "verifier rollout reward 0.850",
                 "verify/retry_rate 0.25"):
        assert part in line, (part, line)
    summary = pr.policy_summary(["solver", "verifier"])
    assert summary["verifier"] == {"version": 5, "train_reward": 0.8, "rollout_reward": 0.85,
                                   "eval_accuracy": pytest.approx(0.7), "eval_version": 5}
    assert pr.workflow_metrics() == {"verify/retry_rate": 0.25}


def test_node_puts_workflow_metrics_into_the_group_and_status():
    from astraflow.config.topology import parse_topology
    from astraflow.raas.node import NodeOptions, RaaSNode

    topo = parse_topology({"run": "mp", "topics": {"tasks": {}, "trajectories.raw": {}}})
    solver = ScriptedEngine("solver", ["82", "73", "82"])
    verifier = ScriptedEngine("verifier", ["y", "n"])
    node = RaaSNode(topo, {"solver": solver, "verifier": verifier}, NodeOptions(n_samples=2))
    g = node.rollout(task())
    assert g.metrics["verify/retry_rate"] == 0.5
    assert g.metrics["verify/solver_final_accuracy"] == 1.0
    assert g.metrics["rollout/reward_mean/solver"] == pytest.approx(2 / 3)  # 82, 73, retry 82
    assert g.metrics["rollout/reward_mean/verifier"] == pytest.approx(1.0)
    solver.replies += ["73", "73", "73"]
    verifier.replies += ["y", "n"]
    g2 = node.rollout(task())
    assert g2.metrics["verify/solver_final_accuracy"] == 0.0
    st = node.status().metrics  # averaged over the two groups since the last status
    assert st["verify/solver_final_accuracy"] == pytest.approx(0.5)
    assert node.status().metrics["verify/solver_final_accuracy"] == pytest.approx(0.5)


def test_readme_documents_multi_policy_runs():
    text = (REPO / "README.md").read_text()
    assert "docs/multi-policy.md" in text
    assert "solve_verify" in (REPO / "docs" / "multi-policy.md").read_text()
    assert Path(REPO / "topology/solver-verifier.yaml").is_file()
