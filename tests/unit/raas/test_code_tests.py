"""Code tasks and the ``code_tests`` workflow (solver + test generator), with scripted
engines and the real sandbox (few processes per test), and the feeder's code family."""

from __future__ import annotations

import argparse
import json
import os

import pytest

from astraflow.raas.workflows import WORKFLOWS, TaskError, make_workflow
from astraflow.raas.workflows.code_tests import CodeTests, parse_tests, solver_expression
from astraflow.sandbox import check_cases, interpreter_and_user
from astraflow.tasks.code import (
    LEVELS,
    CodeProblem,
    code_problems,
    evaluate_reference,
    generator_prompt,
)
from astraflow.wire.records import Task
from tests import fakes

# the kernel exempts uid 0 from RLIMIT_NPROC: the process limit needs a sandbox uid != 0
HAVE_NPROC = (interpreter_and_user()[1] or os.getuid()) != 0


class ScriptedEngine(fakes.ScriptedEngine):
    """A scripted engine whose replies are scripted per role.

    Prompts ending in ``return `` get the solver replies, the others the generator
    replies; each prompt takes ``params.n`` replies from the front of its list.
    """

    def __init__(self, policy: str, solver: list[str] = (), generator: list[str] = ()):
        super().__init__(policy, version=5)
        self.by_role = {"solver": list(solver), "generator": list(generator)}

    def next_reply(self, prompt: str, params) -> str:
        assert params.stop == ("\n",)
        role = "solver" if prompt.endswith("return ") else "generator"
        return self.by_role[role].pop(0)


# square x then add 9: f(x) = x*x+9
PROBLEM = CodeProblem(
    "square x then add 9",
    ("x",),
    "x*x+9",
    2,
    (((0,), 9), ((2,), 13), ((3,), 18), ((-1,), 10)),
)


def code_task(problem: CodeProblem = PROBLEM, tid: str = "t0") -> Task:
    return Task(
        task_id=tid,
        prompt_id=problem.prompt_id,
        workflow="code_tests",
        payload=json.dumps(problem.payload()),
        source="code",
        policies=["solver", "generator"],
    )


def check_invariants(s, prompt: str) -> None:
    n = len(s.token_ids)
    assert len(s.loss_mask) == len(s.logprobs) == len(s.versions) == n
    p = len(prompt)
    assert "".join(chr(t) for t in s.token_ids[:p]) == prompt
    assert s.loss_mask[:p] == [0] * p and s.versions[:p] == [-1] * p
    assert s.loss_mask[p:] == [1] * (n - p) and all(v == 5 for v in s.versions[p:])


# --- tasks --------------------------------------------------------------------------------
def test_code_tasks_are_seeded_split_and_fit_the_tiny_model():
    from astraflow.models.tiny import CHARSET, MAX_POSITIONS

    a = code_problems("1,2,3,4", "train", 200, seed=3)
    assert a == code_problems("1,2,3,4", "train", 200, seed=3)
    assert a != code_problems("1,2,3,4", "train", 200, seed=4)
    assert {p.level for p in a} == set(LEVELS)
    assert len({p.spec for p in a}) == len(a)
    held_out = code_problems("1,2,3,4", "eval", 200, seed=0)
    assert held_out and not {p.spec for p in held_out} & {p.spec for p in a}
    for p in a + held_out:
        payload = p.payload()
        assert payload["source"] == f"code-L{p.level}" and payload["answer"] == p.expr
        assert len(payload["tests"]) == 5
        for text in (p.prompt + p.expr, generator_prompt(p.spec, p.params) + "f(1)==2;"):
            assert set(text) <= set(CHARSET), text
        assert len(p.prompt) + 32 < MAX_POSITIONS
        assert len(generator_prompt(p.spec, p.params)) + 48 < MAX_POSITIONS
        for args, expected in p.tests:  # hidden tests agree with the reference
            assert evaluate_reference(p.params, p.expr, args) == expected
    with pytest.raises(ValueError):
        code_problems("5")
    # the reference source passes its hidden tests in the sandbox (one process per level)
    for level in LEVELS:
        p = next(q for q in a if q.level == level)
        report = check_cases(p.reference, "f", [(list(x), y) for x, y in p.tests])
        assert report.all_passed, (p, report.run.result)


def test_parse_tests():
    assert parse_tests("f(1)==2; f(-3)==-2\n", "f", 1) == [([1], 2), ([-3], -2)]
    assert parse_tests("f([1,2])==[2,1]\nf((3,))==(3,)", "f", 1) == [
        ([[1, 2]], [2, 1]),
        ([[3]], [3]),
    ]
    assert parse_tests("f(1,2)==3;f(1,2)==3;;", "f", 2) == [([1, 2], 3)]  # duplicates dropped
    assert parse_tests("f(1)==1;f(2)==2;f(3)==3", "f", 1, max_tests=2) == [([1], 1), ([2], 2)]
    for bad in [
        "",
        "  \n",
        "f(1)=2",  # not a comparison
        "f(1)==2;g(1)==2",  # another function
        "f(1,2)==3",  # wrong arity
        "f(x=1)==2",  # keyword
        "f(1)==2 and True",
        "f(1)<2",
        "f(1)==2==2",
        "f(__import__('os'))==1",  # not a literal
        "f(1)==",  # cut off
        "f({1,2})==1",  # JSON cannot hold a set
        "f(" + "1" * 300 + ")==1",
    ]:
        assert parse_tests(bad, "f", 1) is None, bad
    assert solver_expression("  x*2+1 \nmore") == "x*2+1"


# --- the workflow -------------------------------------------------------------------------
def test_code_tests_is_registered_for_the_node():
    import astraflow.raas.node  # noqa: F401  (what the RaaS node imports)

    assert WORKFLOWS["code_tests"] is CodeTests


def scripted_pair() -> tuple[ScriptedEngine, ScriptedEngine]:
    solver = ScriptedEngine(
        "solver",
        solver=[
            "x*x+9\n",  # right: passes all 4 hidden tests
            "x*3+9\n",  # wrong, passes f(0) and f(3) only; caught by f(2)==13
            "x*x+9 if x>=0 else 0\n",  # wrong only for negatives: passes 3 of 4
            "\n",  # empty: an error, not catchable
        ],
    )
    generator = ScriptedEngine(
        "generator",
        generator=[
            "f(2)==13;f(5)==34\n",  # valid, catches x*3+9
            "f(3)==18;f(0)==9\n",  # valid, catches nothing (both wrong attempts pass it)
            "f(1)==11\n",  # invalid: the reference gives 10
            "f(-4)==25\n",  # valid, catches the negatives bug
            "print(1)\n",  # unparseable
        ],
    )
    return solver, generator


def test_rewards_policies_roles_and_metrics():
    solver, generator = scripted_pair()
    wf = make_workflow("code_tests", n_generator=5)
    seqs = wf.run(code_task(), {"solver": solver, "generator": generator}, 4)
    sol = [s for s in seqs if s.role == "solver"]
    gen = [s for s in seqs if s.role == "generator"]
    assert len(sol) == 4 and len(gen) == 5 and len(seqs) == 9
    assert {s.policy for s in sol} == {"solver"} and {s.policy for s in gen} == {"generator"}
    assert [s.sample_index for s in sol] == [0, 1, 2, 3]
    assert [s.sample_index for s in gen] == [0, 1, 2, 3, 4]
    assert solver.prompts == ["square x then add 9\ndef f(x): return "]
    assert generator.prompts == ["square x then add 9\ntests of f(x): "]
    for s in sol:
        check_invariants(s, solver.prompts[0])
    for s in gen:
        check_invariants(s, generator.prompts[0])

    assert [s.reward for s in sol] == [1.0, 0.5, 0.75, 0.0]
    assert [s.meta["status"] for s in sol] == ["ok", "ok", "ok", "empty"]
    assert [s.meta["catchable"] for s in sol] == ["0", "1", "1", "0"]
    assert [s.meta["caught"] for s in sol] == ["0", "1", "1", "0"]
    assert [s.reward for s in gen] == [1.0, 0.0, 0.0, 1.0, 0.0]
    assert [s.meta["valid"] for s in gen] == ["1", "1", "0", "1", "0"]
    assert [s.meta["parsed"] for s in gen] == ["1", "1", "1", "1", "0"]
    assert [s.meta["discriminating"] for s in gen] == ["1", "0", "0", "1", "0"]

    m = CodeTests.group_metrics(seqs)
    assert m["code/solver_pass_rate"] == 0.25
    assert m["code/solver_case_rate"] == pytest.approx((4 + 2 + 3 + 0) / 16)
    assert m["code/solver_error_rate"] == 0.25
    assert m["code/tests_parse_rate"] == pytest.approx(0.8)
    assert m["code/tests_valid_rate"] == pytest.approx(0.6)
    assert m["code/tests_discriminating_rate"] == pytest.approx(0.4)
    assert m["code/failing_caught_rate"] == 1.0
    assert m["code/generator_reward_mean"] == pytest.approx(0.4)
    assert m["code/self_play"] == 0.0
    assert m["code/sandbox_runs"] == 4.0  # the reference and 3 distinct attempts


def test_a_batch_of_tasks_samples_each_role_in_one_call_and_a_bad_task_fails_alone():
    def engines():
        return {"solver": ScriptedEngine("solver", solver=["x*x+9\n", "\n", "x*3+9\n",
                                                           "x*x+9\n"]),
                "generator": ScriptedEngine("generator", generator=[
                    "f(2)==13\n", "f(1)==11\n", "f(2)==13\n", "f(0)==9\n"])}

    bad = code_task(tid="bad")
    bad.payload = json.dumps({k: v for k, v in PROBLEM.payload().items() if k != "tests"})
    eng = engines()
    out = make_workflow("code_tests").run_batch(
        [code_task(tid="a"), bad, code_task(tid="c")], eng, 2)
    assert [len(c) for c in eng["solver"].calls] == [2]  # tasks a and c, one call
    assert [len(c) for c in eng["generator"].calls] == [2]
    assert isinstance(out[1], TaskError) and "tests" in str(out[1])
    assert [(s.role, s.reward) for s in out[0]] == [
        ("solver", 1.0), ("solver", 0.0),  # right; empty (an error, not catchable)
        ("generator", 0.0), ("generator", 0.0)]  # nothing to catch; invalid
    assert [(s.role, s.reward) for s in out[2]] == [
        ("solver", 0.5), ("solver", 1.0),
        ("generator", 1.0), ("generator", 0.0)]  # catches x*3+9; valid, catches nothing
    # the same replies, task by task, give the same sequences
    eng = engines()
    one_by_one = [make_workflow("code_tests").run(code_task(tid=t), eng, 2) for t in "ac"]
    assert [[s.token_ids for s in g] for g in one_by_one] == [
        [s.token_ids for s in g] for g in (out[0], out[2])]


def test_node_puts_the_code_metrics_into_the_group():
    from astraflow.config.topology import parse_topology
    from astraflow.raas.node import NodeOptions, RaaSNode

    solver, generator = scripted_pair()
    topo = parse_topology({"run": "code", "topics": {"tasks": {}, "trajectories.raw": {}}})
    node = RaaSNode(
        topo,
        {"solver": solver, "generator": generator},
        NodeOptions(n_samples=4, workflow_options={"code_tests": {"n_generator": 5}}),
    )
    g = node.rollout(code_task())
    assert g.workflow == "code_tests" and len(g.sequences) == 9
    assert g.rewards == [s.reward for s in g.sequences]
    assert g.metrics["code/tests_valid_rate"] == pytest.approx(0.6)
    assert g.metrics["code/solver_pass_rate"] == 0.25


def test_all_passing_solvers_leave_nothing_to_discriminate():
    def run(**options):
        solver = ScriptedEngine("solver", solver=["x*x+9\n", "x*x+9\n"])
        generator = ScriptedEngine("generator", generator=["f(7)==58\n", "f(7)==57\n"])
        wf = make_workflow("code_tests", **options)
        return wf.run(code_task(), {"solver": solver, "generator": generator}, 2)

    seqs = run()
    assert [(s.role, s.reward) for s in seqs] == [
        ("solver", 1.0),
        ("solver", 1.0),
        ("generator", 0.0),  # valid, but no failing attempt to catch
        ("generator", 0.0),  # invalid
    ]
    m = CodeTests.group_metrics(seqs)
    assert m["code/sandbox_runs"] == 2.0  # identical attempts run once
    assert "code/failing_caught_rate" not in m
    seqs = run(no_failures_reward=1.0, solver_reward="all")
    assert [s.reward for s in seqs] == [1.0, 1.0, 1.0, 0.0]


def test_one_engine_plays_both_roles_and_missing_engines_are_errors():
    actor = ScriptedEngine("actor", solver=["x*x\n"], generator=["f(1)==10\n"])
    seqs = make_workflow("code_tests").run(code_task(), {"actor": actor}, 1)
    assert [(s.policy, s.role, s.reward) for s in seqs] == [
        ("actor", "solver", 0.0),  # x*x misses +9 everywhere
        ("actor", "generator", 1.0),
    ]
    assert all(s.meta["self_play"] == "1" for s in seqs)
    assert CodeTests.group_metrics(seqs)["code/self_play"] == 1.0

    strict = make_workflow("code_tests", self_play=False)
    with pytest.raises(TaskError, match="no engine for the solver policy 'solver'"):
        strict.run(code_task(), {"actor": ScriptedEngine("actor")}, 1)
    two = {"a": ScriptedEngine("a"), "b": ScriptedEngine("b")}
    with pytest.raises(TaskError, match="no engine"):
        make_workflow("code_tests").run(code_task(), two, 1)
    named = make_workflow("code_tests", solver_policy="a", generator_policy="b")
    assert named.engines_for(two) == ("a", two["a"], "b", two["b"])


def test_bad_payloads_and_options_are_rejected():
    eng = {"solver": ScriptedEngine("solver"), "generator": ScriptedEngine("generator")}
    wf = make_workflow("code_tests")
    good = PROBLEM.payload()
    for change in [
        {"spec": None},
        {"params": "x"},
        {"params": ["x y"]},
        {"func": "f()"},
        {"tests": []},
        {"tests": [[[1, 2], 3]]},  # wrong arity
        {"tests": [[1, 3]]},
        {"reference": 3},
    ]:
        payload = {**good, **change}
        if change.get("spec", 1) is None:
            payload.pop("spec")
        t = code_task()
        t.payload = json.dumps(payload)
        with pytest.raises(TaskError):
            wf.run(t, eng, 1)
    for bad in [
        {"solver_reward": "most"},
        {"n_solver": 0},
        {"n_generator": -1},
        {"max_tests": 0},
        {"sandbox": {"cpu": 1}},
    ]:
        with pytest.raises(ValueError):
            make_workflow("code_tests", **bad)


@pytest.mark.skipif(not HAVE_NPROC, reason="the sandbox runs as uid 0, exempt from RLIMIT_NPROC")
def test_bombs_in_solver_code_get_reward_0_with_the_reason():
    sleeper = "__import__('threading').Thread(target=__import__('time').sleep,args=(9,))"
    bomb = f"[{sleeper}.start() for _ in range(99)]"
    solver = ScriptedEngine(
        "solver",
        solver=[
            f"x*x+9 if x==0 else {bomb}\n",  # passes f(0), then a thread bomb
            "bytearray(2**40)\n",  # a memory bomb
            "__import__('os').fork()\n",  # refused by the audit hook in every call
            "x*x+9\n",
        ],
    )
    generator = ScriptedEngine("generator")
    wf = make_workflow("code_tests", n_generator=0, sandbox={"mem_mb": 1024, "max_procs": 8})
    seqs = wf.run(code_task(), {"solver": solver, "generator": generator}, 4)
    assert [s.reward for s in seqs] == [0.0, 0.0, 0.0, 1.0]
    assert [s.meta["passed"] for s in seqs] == ["1", "0", "0", "4"]
    assert [s.meta["status"] for s in seqs] == ["limit", "memory", "ok", "ok"]
    assert [s.meta["reason"] for s in seqs] == [
        "process limit",
        "memory limit",
        "PermissionError: sandbox: os.fork is not allowed",
        "",
    ]
    assert CodeTests.group_metrics(seqs)["code/solver_error_rate"] == 0.5


# --- feeder -------------------------------------------------------------------------------
def test_feeder_feeds_code_tasks_to_code_tests():
    from astraflow.cli.feeder import register
    from astraflow.dataflow.feeder import TASK_FAMILIES, iter_tasks, load_payloads

    payloads = load_payloads(family="code", levels="1,3", size=12, seed=1)
    assert len(payloads) == 12 and {p["source"] for p in payloads} <= {"code-L1", "code-L3"}
    workflow, policies = TASK_FAMILIES["code"]
    assert (workflow, policies) == ("code_tests", ["solver", "generator"])
    tasks = [t for _, t in iter_tasks(payloads, workflow=workflow, policies=policies)]
    assert {t.workflow for t in tasks} == {"code_tests"}
    assert tasks[0].policies == ["solver", "generator"]
    assert tasks[0].source.startswith("code-L")
    assert json.loads(tasks[0].payload)["tests"]
    with pytest.raises(ValueError, match="task family"):
        load_payloads(family="poetry")

    parser = argparse.ArgumentParser()
    register(parser.add_subparsers())
    args = parser.parse_args(["feeder", "run", "--topology", "x.yaml", "--task-family", "code"])
    assert args.task_family == "code" and args.workflow is None and args.policy is None
