"""Multi-policy math workflows: solver + verifier (``solve_verify``) and solver + selector
(``solve_select``).

Both take the arithmetic payload of ``single_turn`` (``{"prompt": "37+45=", "answer":
"82"}``) and call two engines, one per policy; the prompt formats are those of
``astraflow.roles``. Every returned ``Sequence`` carries its ``policy`` (the router sends it
to ``samples.<policy>``) and its ``role``; ``meta`` records what the role saw and said.

``solve_verify`` (n samples per prompt):

1. the solver answers the prompt n times (``37+45=`` -> ``82``), role ``solver``;
2. the verifier judges each answer once (``37+45=82?`` -> ``82y``: its own answer, then
   ``y``/``n``; a bare ``y``/``n`` is read as well), role ``verifier``: n verdicts per
   prompt;
   With ``blind: true`` the verifier answers the problem before it sees a candidate: n
   own answers per prompt (``37+45=`` -> ``82|``), then each is shown one candidate
   (``73?``, not trained on) -> ``n``; one sequence ``37+45=82|73?n`` per verdict, ``meta``
   ``own`` and ``own_matches``. An own answer not ended by ``|`` gets no verdict
   (unparseable). The verifier model must be warm-started on this format (``model
   init-role --blind``).
3. each answer the verifier rejects (an explicit ``n``) is retried once by the solver with
   the rejection in its prompt (``37+45=82?n 37+45=`` -> ``83``), role ``solver_retry``.
   An approved or unparseable verdict ends the attempt. ``retry: false`` turns retries off.

Rewards: each solver sequence (first try or retry) is scored by the correctness of its own
answer (``checker``, default ``astraflow.tasks.check_answer``); a verdict scores 1 when it
matches the truth of the first answer it judged (``y`` for a right answer, ``n`` for a
wrong one) and 0 when it is wrong or unparseable. The final answer of an attempt is the
retry's when there was one, else the first.

``solve_select`` (n samples per prompt): the solver answers 2n times, role ``solver``; the
selector sees the answers in pairs (``37+45=82|83>`` -> ``82:1``, own answer then ``1``/
``2``), role ``selector``, n picks per prompt. Selector reward when exactly one answer of
the pair is right: 1 for picking it, else 0. When both or neither are right the pick
changes nothing, so by default (``ties: skip``) such a selector sequence is not emitted
for training at all (a reward there would only add noise to the GRPO advantages);
``ties: outcome`` emits it with the correctness of the picked answer instead (1 when both
are right, 0 when neither is). An unparseable pick is always emitted with reward 0.

GRPO groups. The trainer of a policy computes group advantages over that policy's
sequences of one ``TrajectoryGroup``. The verifier's n verdicts of a prompt thus form one
group (its baseline is its accuracy on this problem), and so do the selector's picks. The
solver's group holds its n first tries *and* its retries: a retry's advantage is measured
against how well the solver does on this very problem, so a single retry (that fixes or
repeats a mistake) still carries signal. A run that wants strict per-role groups (first
tries apart from retries, or one policy playing both solver and verifier) sets the
router's ``split_roles: true``: each (policy, role) becomes its own group.

Metrics (``group_metrics``, put into ``TrajectoryGroup.metrics`` by the RaaS node):
``verify/approval_rate``, ``verify/retry_rate``, ``verify/verifier_accuracy``,
``verify/solver_first_accuracy``, ``verify/solver_final_accuracy``,
``verify/unparseable_rate`` (approval and unparseable rates per verdict, retry rate per
answer); ``select/solver_accuracy``, ``select/final_accuracy``,
``select/exactly_one_rate``, ``select/selector_accuracy`` (on pairs with exactly one right
answer, when there are any), ``select/unparseable_rate``.

Options (both workflows): ``solver_policy`` (default ``solver``), ``verifier_policy``
(``verifier``) or ``selector_policy`` (``selector``), the sampling options of
``single_turn`` (``max_new_tokens``, ``temperature``, ``top_p``, ``seed``) for the solver,
``verifier_sampling`` / ``selector_sampling`` (overrides for the judge; default
``{"max_new_tokens": 8}``, per turn), ``checker``, ``max_answer_chars`` (12: how much of an
answer the judge is shown); ``retry``, ``blind`` and ``verdicts_per_prompt`` (solve_verify:
only the first m of the n answers are judged, and so can be retried; default all n -- the
answers are independent samples, so the first m are a random subset), ``ties``
(solve_select). The task's
``policies`` list is informational: the engines are picked by the option names.
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from typing import Any

from astraflow.raas.engine import Engine
from astraflow.raas.workflows import (
    Checker,
    SequenceBuilder,
    TaskError,
    _sampling,
    default_checker,
    parse_payload,
    prepare_each,
    register_workflow,
    role_sequence,
    unbatched,
)
from astraflow.records import Sequence, Task
from astraflow.roles import (
    APPROVE,
    OWN_END,
    REJECT,
    candidate_answer,
    own_answer,
    parse_pick,
    parse_verdict,
    retry_prompt,
    select_prompt,
    verify_prompt,
)

ROLE_SOLVER = "solver"
ROLE_RETRY = "solver_retry"
ROLE_VERIFIER = "verifier"
ROLE_SELECTOR = "selector"
JUDGE_SAMPLING = {"max_new_tokens": 8}  # own answer, verdict (pick), end of sequence


def _engine(engines: Mapping[str, Engine], policy: str, role: str) -> Engine:
    if policy not in engines:
        raise TaskError(f"no engine for the {role} policy {policy!r} on this node "
                        f"(have {sorted(engines)})")
    return engines[policy]


def _encode(engine: Engine, text: str) -> list[int]:
    ids = engine.encode(text)
    if not ids:
        raise TaskError(f"prompt {text!r} encodes to no tokens")
    return ids


def _flag(x: bool) -> str:
    return "1" if x else "0"


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else 0.0


class _TwoPolicyWorkflow:
    judge_role = ""

    def __init__(self, solver_policy: str, judge_policy: str, checker: Checker | None,
                 judge_sampling: Mapping[str, Any] | None, max_answer_chars: int,
                 sampling: dict[str, Any]):
        if max_answer_chars < 1:
            raise ValueError("max_answer_chars must be at least 1")
        self.solver_policy = solver_policy
        self.judge_policy = judge_policy
        self.checker = checker
        self.max_answer_chars = max_answer_chars
        self.sampling = sampling
        self.judge_sampling = {**sampling, **JUDGE_SAMPLING, **dict(judge_sampling or {})}

    def _start(self, task: Task, engines: Mapping[str, Engine]):
        payload = parse_payload(task, ("prompt", "answer"))
        solver = _engine(engines, self.solver_policy, "solver")
        judge = _engine(engines, self.judge_policy, self.judge_role)
        return str(payload["prompt"]), str(payload["answer"]), solver, judge, (
            self.checker or default_checker())


@register_workflow("solve_verify")
class SolveVerify(_TwoPolicyWorkflow):
    """Solver answers, verifier approves or rejects, one retry on rejection (module doc)."""

    name = "solve_verify"
    judge_role = ROLE_VERIFIER

    def __init__(
        self,
        solver_policy: str = "solver",
        verifier_policy: str = "verifier",
        retry: bool = True,
        checker: Checker | None = None,
        verifier_sampling: Mapping[str, Any] | None = None,
        max_answer_chars: int = 12,
        blind: bool = False,
        verdicts_per_prompt: int | None = None,
        **sampling: Any,
    ):
        super().__init__(solver_policy, verifier_policy, checker, verifier_sampling,
                         max_answer_chars, sampling)
        if verdicts_per_prompt is not None and verdicts_per_prompt < 1:
            raise ValueError("verdicts_per_prompt must be at least 1")
        self.retry = bool(retry)
        self.blind = bool(blind)
        self.verdicts_per_prompt = verdicts_per_prompt

    @property
    def verifier_policy(self) -> str:
        return self.judge_policy

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        return unbatched(self.run_batch([task], engines, n))

    def run_batch(
        self, tasks: list[Task], engines: dict[str, Engine], n: int
    ) -> list[list[Sequence] | Exception]:
        """The three phases (first tries, verdicts, retries), each one ``generate`` call
        over all ``tasks``."""
        def prepare(task: Task):
            prompt, answer, solver, verifier, checker = self._start(task, engines)
            return prompt, answer, _encode(solver, prompt), (solver, verifier, checker)

        results, ready = prepare_each(tasks, prepare)
        if not ready:
            return results
        solver, verifier, checker = ready[0][1][3]  # the same for every task
        live = [(i, prompt, answer, p_ids) for i, (prompt, answer, p_ids, _) in ready]
        firsts = solver.generate([p for *_, p in live], _sampling(self.sampling, solver, n))
        cands, right = [], []
        for (_, _, answer, _), gens in zip(live, firsts):
            texts = [solver.decode(g.token_ids) for g in gens]
            cands.append([candidate_answer(t, self.max_answer_chars) for t in texts])
            right.append([checker(t, answer) > 0.5 for t in texts])

        m = min(n, self.verdicts_per_prompt or n)  # answers 0..m-1 are judged
        judged = (self._judge_blind if self.blind else self._judge_seen)(
            verifier, [prompt for _, prompt, _, _ in live], [c[:m] for c in cands],
            [r[:m] for r in right], m)

        rejected = [[s.sample_index for s in seqs if s.meta["verdict"] == REJECT]
                    if self.retry else [] for seqs in judged]
        r_ids = [[_encode(solver, retry_prompt(prompt, cands[k][j], REJECT)) for j in rej]
                 for k, ((_, prompt, _, _), rej) in enumerate(zip(live, rejected))]
        r_all = [x for ids in r_ids for x in ids]
        r_flat = solver.generate(r_all, _sampling(self.sampling, solver, 1)) if r_all else []

        at = 0
        for k, (i, _, answer, p_ids) in enumerate(live):
            out: list[Sequence] = []
            for j, g in enumerate(firsts[k]):
                ok = right[k][j]
                out.append(role_sequence(self.solver_policy, ROLE_SOLVER, p_ids, g, j,
                                         float(ok), attempt="1", answer=cands[k][j],
                                         correct=_flag(ok)))
            out += judged[k]
            for j, ids in zip(rejected[k], r_ids[k]):
                g = r_flat[at][0]
                at += 1
                text = solver.decode(g.token_ids)
                ok = checker(text, answer) > 0.5
                out.append(role_sequence(self.solver_policy, ROLE_RETRY, ids, g, j, float(ok),
                                         attempt="2",
                                         answer=candidate_answer(text, self.max_answer_chars),
                                         rejected=cands[k][j], correct=_flag(ok)))
            results[i] = out
        return results

    def _verdict(self, b: SequenceBuilder, v: bool | None, truth: bool, cand: str,
                 **meta: str) -> Sequence:
        """The verdict ``v`` (None: unparseable) of ``b``'s sequence, scored against the
        truth of the answer it judged."""
        b.meta.update(verdict="?" if v is None else (APPROVE if v else REJECT),
                      truth=_flag(truth), answer=cand, **meta)
        s = b.build(float(v is not None and v == truth))
        s.role = ROLE_VERIFIER
        return s

    def _judge_seen(self, verifier: Engine, prompts: list[str], cands: list[list[str]],
                    right: list[list[bool]], n: int) -> list[list[Sequence]]:
        """One turn per candidate: ``37+45=82?`` -> ``82y``."""
        v_ids = [[_encode(verifier, verify_prompt(prompt, c)) for c in cs]
                 for prompt, cs in zip(prompts, cands)]
        v_flat = verifier.generate([x for ids in v_ids for x in ids],
                                   _sampling(self.judge_sampling, verifier, 1))
        out = []
        for k, ids_k in enumerate(v_ids):
            row = []
            for j, ids in enumerate(ids_k):
                g = v_flat[k * n + j][0]
                b = SequenceBuilder(self.verifier_policy, ids, j)
                b.add_generated(g)
                row.append(self._verdict(b, parse_verdict(verifier.decode(g.token_ids)),
                                         right[k][j], cands[k][j]))
            out.append(row)
        return out

    def _judge_blind(self, verifier: Engine, prompts: list[str], cands: list[list[str]],
                     right: list[list[bool]], n: int) -> list[list[Sequence]]:
        """Two turns: the verifier answers the problem n times (``37+45=`` -> ``82|``), then
        each own answer is shown one candidate (``73?``, not trained) -> ``n``."""
        p_ids = [_encode(verifier, prompt) for prompt in prompts]
        owns = verifier.generate(p_ids, _sampling(self.judge_sampling, verifier, n,
                                                  stop=(OWN_END,)))
        builders, asked, ask_ids = [], [], []
        for k, gens in enumerate(owns):
            row = []
            for j, g in enumerate(gens):
                b = SequenceBuilder(self.verifier_policy, p_ids[k], j)
                b.add_generated(g)
                own = own_answer(verifier.decode(g.token_ids))
                if own is not None:
                    b.add_external(_encode(verifier, f"{cands[k][j]}?"))
                    asked.append((k, j))
                    ask_ids.append(list(b.token_ids))
                row.append((b, own))
            builders.append(row)
        # the verdict is the turn's first token: nothing after it is read or worth a step
        answers = (verifier.generate(ask_ids, _sampling({**self.judge_sampling,
                                                         "max_new_tokens": 1}, verifier, 1))
                   if ask_ids else [])
        verdict_gen = dict(zip(asked, (gs[0] for gs in answers)))
        out = []
        for k, row in enumerate(builders):
            judged = []
            for j, (b, own) in enumerate(row):
                g = verdict_gen.get((k, j))
                v = None
                if g is not None:
                    b.add_generated(g)
                    v = parse_verdict(verifier.decode(g.token_ids))
                judged.append(self._verdict(b, v, right[k][j], cands[k][j],
                                            own="" if own is None else own,
                                            own_matches=_flag(own == cands[k][j])))
            out.append(judged)
        return out

    @staticmethod
    def group_metrics(seqs: list[Sequence]) -> dict[str, float]:
        firsts = {s.sample_index: s for s in seqs if s.role == ROLE_SOLVER}
        verdicts = [s for s in seqs if s.role == ROLE_VERIFIER]
        retries = {s.sample_index: s for s in seqs if s.role == ROLE_RETRY}
        n, n_v = max(len(firsts), 1), max(len(verdicts), 1)
        final = [(retries.get(j) or s).meta.get("correct") == "1" for j, s in firsts.items()]
        return {
            "verify/approval_rate": sum(s.meta.get("verdict") == "y" for s in verdicts) / n_v,
            "verify/retry_rate": len(retries) / n,
            "verify/verifier_accuracy": _mean([s.reward for s in verdicts]),
            "verify/solver_first_accuracy": _mean([s.reward for s in firsts.values()]),
            "verify/solver_final_accuracy": _mean([float(x) for x in final]),
            "verify/unparseable_rate": sum(s.meta.get("verdict") == "?" for s in verdicts) / n_v,
        }


@register_workflow("solve_select")
class SolveSelect(_TwoPolicyWorkflow):
    """Two solver answers per sample, the selector picks one (module doc)."""

    name = "solve_select"
    judge_role = ROLE_SELECTOR

    def __init__(
        self,
        solver_policy: str = "solver",
        selector_policy: str = "selector",
        ties: str = "skip",
        checker: Checker | None = None,
        selector_sampling: Mapping[str, Any] | None = None,
        max_answer_chars: int = 12,
        **sampling: Any,
    ):
        if ties not in ("skip", "outcome"):
            raise ValueError(f"ties must be 'skip' or 'outcome', not {ties!r}")
        super().__init__(solver_policy, selector_policy, checker, selector_sampling,
                         max_answer_chars, sampling)
        self.ties = ties

    @property
    def selector_policy(self) -> str:
        return self.judge_policy

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        prompt, answer, solver, selector, checker = self._start(task, engines)
        p_ids = _encode(solver, prompt)
        gens = solver.generate([p_ids], _sampling(self.sampling, solver, 2 * n))[0]
        texts = [solver.decode(g.token_ids) for g in gens]
        cands = [candidate_answer(t, self.max_answer_chars) for t in texts]
        right = [checker(t, answer) > 0.5 for t in texts]

        s_ids = [_encode(selector, select_prompt(prompt, cands[2 * j], cands[2 * j + 1]))
                 for j in range(n)]
        s_gens = selector.generate(s_ids, _sampling(self.judge_sampling, selector, 1))

        out: list[Sequence] = []
        for k, g in enumerate(gens):
            out.append(role_sequence(self.solver_policy, ROLE_SOLVER, p_ids, g, k, float(right[k]),
                                     answer=cands[k], correct=_flag(right[k]), pair=str(k // 2),
                                     slot=str(k % 2 + 1)))
        for j, (ids, g) in enumerate(zip(s_ids, s_gens)):
            pick = parse_pick(selector.decode(g[0].token_ids))
            ok1, ok2 = right[2 * j], right[2 * j + 1]
            if pick is None:
                reward = 0.0
            elif ok1 != ok2:
                reward = float(ok1 if pick == 1 else ok2)
            elif self.ties == "outcome":
                reward = float(ok1)
            else:
                continue  # a tie: the pick changes nothing, nothing to learn
            out.append(role_sequence(self.selector_policy, ROLE_SELECTOR, ids, g[0], j, reward,
                                     pick=str(pick or "?"), tie=_flag(ok1 == ok2),
                                     right="".join(_flag(x) for x in (ok1, ok2))))
        return out

    @staticmethod
    def group_metrics(seqs: list[Sequence]) -> dict[str, float]:
        solver = [s for s in seqs if s.role == ROLE_SOLVER]
        picks = {s.sample_index: s for s in seqs if s.role == ROLE_SELECTOR}
        pairs: dict[int, list[bool]] = {}
        for s in sorted(solver, key=lambda s: s.sample_index):
            pairs.setdefault(int(s.meta.get("pair", s.sample_index // 2)), []).append(
                s.meta.get("correct") == "1")
        n = max(len(pairs), 1)
        final, informative, unparseable = [], [], 0
        for j, oks in pairs.items():
            sel = picks.get(j)
            pick = sel.meta.get("pick") if sel is not None else "?"
            if pick == "?" and sel is not None:
                unparseable += 1
            final.append(oks[int(pick) - 1] if pick in ("1", "2") and len(oks) == 2 else oks[0])
            if len(oks) == 2 and oks[0] != oks[1]:
                informative.append(sel.reward if sel is not None else 0.0)
        out = {
            "select/solver_accuracy": _mean([s.reward for s in solver]),
            "select/final_accuracy": _mean([float(x) for x in final]),
            "select/exactly_one_rate": len(informative) / n,
            "select/unparseable_rate": unparseable / n,
        }
        if informative:
            out["select/selector_accuracy"] = _mean(informative)
        return out


__all__ = ["ROLE_RETRY", "ROLE_SELECTOR", "ROLE_SOLVER", "ROLE_VERIFIER", "SolveSelect",
           "SolveVerify"]
