"""``solve_select`` (n samples per prompt): the solver answers 2n times, role ``solver``; the
selector sees the answers in pairs (``37+45=82|83>`` -> ``82:1``, own answer then ``1``/
``2``), role ``selector``, n picks per prompt. Selector reward when exactly one answer of
the pair is right: 1 for picking it, else 0. When both or neither are right the pick
changes nothing, so by default (``ties: skip``) such a selector sequence is not emitted
for training at all (a reward there would only add noise to the GRPO advantages);
``ties: outcome`` emits it with the correctness of the picked answer instead (1 when both
are right, 0 when neither is). An unparseable pick is always emitted with reward 0.

Metrics (``group_metrics``, put into ``TrajectoryGroup.metrics`` by the RaaS node):
``select/solver_accuracy``, ``select/final_accuracy``, ``select/exactly_one_rate``,
``select/selector_accuracy`` (on pairs with exactly one right answer, when there are any),
``select/unparseable_rate``.

Options: those of ``astraflow.raas.workflows.two_policy``, and ``ties``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker
from astraflow.raas.workflows.inputs import encode_prompt, sampling_params
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.sequences import role_sequence
from astraflow.raas.workflows.two_policy import ROLE_SOLVER, TwoPolicyWorkflow, flag, mean
from astraflow.records import Sequence, Task
from astraflow.roles.formats import candidate_answer, parse_pick, select_prompt

ROLE_SELECTOR = "selector"


@register_workflow("solve_select")
class SolveSelect(TwoPolicyWorkflow):
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
        p_ids = encode_prompt(solver, prompt)
        gens = solver.generate([p_ids], sampling_params(self.sampling, solver, 2 * n))[0]
        texts = [solver.decode(g.token_ids) for g in gens]
        cands = [candidate_answer(t, self.max_answer_chars) for t in texts]
        right = [checker(t, answer) > 0.5 for t in texts]

        s_ids = [encode_prompt(selector, select_prompt(prompt, cands[2 * j], cands[2 * j + 1]))
                 for j in range(n)]
        s_gens = selector.generate(s_ids, sampling_params(self.judge_sampling, selector, 1))

        out: list[Sequence] = []
        for k, g in enumerate(gens):
            out.append(role_sequence(self.solver_policy, ROLE_SOLVER, p_ids, g, k, float(right[k]),
                                     answer=cands[k], correct=flag(right[k]), pair=str(k // 2),
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
                                     pick=str(pick or "?"), tie=flag(ok1 == ok2),
                                     right="".join(flag(x) for x in (ok1, ok2))))
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
            "select/solver_accuracy": mean([s.reward for s in solver]),
            "select/final_accuracy": mean([float(x) for x in final]),
            "select/exactly_one_rate": len(informative) / n,
            "select/unparseable_rate": unparseable / n,
        }
        if informative:
            out["select/selector_accuracy"] = mean(informative)
        return out


__all__ = ["ROLE_SELECTOR", "ROLE_SOLVER", "SolveSelect"]
