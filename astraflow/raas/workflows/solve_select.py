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

With ``prompt_format: chat`` (``auto`` on a chat model) the selector is shown the problem
and ``candidates`` (k, default 2) numbered answers and asked for the number of the right
one (``astraflow.roles.chat_formats``); the solver answers k·n times, n picks per prompt.
The answers are scored by the solver's reward (``reward``, default 1 right / 0 wrong) and
the selector's reward is the picked answer's score scaled between the set's worst (0) and
best (1): with 0/1 scores, 1 for picking a right answer from a mixed set, else 0 (the rule
above); ``ties`` applies when all k scores are equal. The metrics' "pair" is then a set
of k, ``exactly_one_rate`` the share of sets with both right and wrong answers.

``corrective: true`` (chat only): the selector is shown the problem and the k answers
and replies with the correct answer itself (``correction_messages``); its pick is the
first answer its reply repeats (none: unparseable), and it is rewarded as the solver's
answers are, its reply against the task's answer (``meta`` ``reply``, ``correct``), so
``ties`` does not apply. A right reply picks a right answer whenever the set has one.
Why: as ``solve_verify``'s corrective verifier.

``blind: true`` (chat only, not with ``corrective``): the selector answers the task's own
prompt, not shown the answers (one answer per set); its pick is the first answer of the
set that its own agrees with (``meta`` ``agreed``), else the first answer; it is rewarded
as the solver's answers are (``meta`` ``own``, ``correct``). The selector then picks by
solving the problem independently, the one way of picking an untrained 135M model learnt
in 30 minutes on two cores (docs/multi-policy.md, "Why the judges solve").

Options (``SolveSelectOptions``): those of ``astraflow.raas.workflows.two_policy``, and
``ties``, ``candidates`` (chat only where not 2), ``corrective``, ``blind``.
"""

from __future__ import annotations

from astraflow.config.options import SolveSelectOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker, TaskError
from astraflow.raas.workflows.inputs import encode_prompt, sampling_params
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.sequences import role_sequence
from astraflow.raas.workflows.two_policy import ROLE_SOLVER, TwoPolicyWorkflow, flag, mean
from astraflow.roles.chat_formats import (
    agreement,
    correction_messages,
    parse_choice,
    select_messages,
)
from astraflow.roles.formats import parse_pick, select_prompt
from astraflow.wire.records import Sequence, Task

ROLE_SELECTOR = "selector"


@register_workflow("solve_select")
class SolveSelect(TwoPolicyWorkflow):
    """Two solver answers per sample, the selector picks one (module doc)."""

    name = "solve_select"
    judge_role = ROLE_SELECTOR

    Options = SolveSelectOptions

    def __init__(self, options: SolveSelectOptions | None = None,
                 checker: Checker | None = None):
        options = options or SolveSelectOptions()
        super().__init__(options, options.selector_policy, options.selector_sampling,
                         checker)
        self.ties = options.ties
        self.candidates = options.candidates
        self.corrective = options.corrective
        self.blind = options.blind

    @property
    def selector_policy(self) -> str:
        return self.judge_policy

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload, solver, selector, checker = self._start(task, engines)
        prompt, answer = str(payload["prompt"]), str(payload["answer"])
        chat = self.chat(solver)
        k = self.candidates
        if k != 2 and not chat:
            raise TaskError(f"candidates: {k} needs the chat format; the compact one shows 2")
        if (self.corrective or self.blind) and not chat:
            raise TaskError("corrective, blind: need a chat model (this one has no chat "
                            "template)")
        p_ids = self.solver_ids(solver, prompt, chat)
        gens = solver.generate([p_ids], sampling_params(self.sampling, solver, k * n))[0]
        texts = [solver.decode(g.token_ids) for g in gens]
        cands = [self.candidate(t, chat) for t in texts]
        right = [checker(t, answer) > 0.5 for t in texts]
        scores = [self.answer_reward(t, payload, ok) for t, ok in zip(texts, right)]

        s_ids = [self._select_ids(selector, prompt, cands[k * j: k * j + k], chat)
                 for j in range(n)]
        s_gens = selector.generate(s_ids, sampling_params(self.judge_sampling, selector, 1))

        out: list[Sequence] = []
        for i, g in enumerate(gens):
            out.append(role_sequence(self.solver_policy, ROLE_SOLVER, p_ids, g, i, scores[i],
                                     answer=cands[i], correct=flag(right[i]), pair=str(i // k),
                                     slot=str(i % k + 1)))
        for j, (ids, g) in enumerate(zip(s_ids, s_gens)):
            text = selector.decode(g[0].token_ids)
            shown, oks = cands[k * j: k * j + k], right[k * j: k * j + k]
            meta = {}
            if self.corrective or self.blind:  # its own answer is rewarded, not its pick
                pick = agreement(text, shown)
                ok = checker(text, answer) > 0.5
                reward = self.judge_answer_reward(text, payload, ok)
                meta = {"reply" if self.corrective else "own": self.candidate(text, chat),
                        "correct": flag(ok)}
                if self.blind:
                    meta["agreed"] = flag(pick is not None)
                    pick = pick or 1
            else:
                pick = parse_choice(text, k, shown) if chat else parse_pick(text)
                reward = self._pick_reward(pick, scores[k * j: k * j + k])
            if reward is None:
                continue  # a tie: the pick changes nothing, nothing to learn
            out.append(role_sequence(self.selector_policy, ROLE_SELECTOR, ids, g[0], j, reward,
                                     pick=str(pick or "?"), tie=flag(len(set(oks)) == 1),
                                     right="".join(flag(x) for x in oks), **meta))
        return out

    def _select_ids(self, selector: Engine, prompt: str, cands: list[str],
                    chat: bool) -> list[int]:
        if self.corrective:
            return self.chat_ids(selector, correction_messages(prompt, cands))
        if self.blind:  # the same prompt for every set: the engine's prefix cache reuses it
            return self.chat_ids(selector, {"prompt": prompt})
        if chat:
            return self.chat_ids(selector, select_messages(prompt, cands))
        return encode_prompt(selector, select_prompt(prompt, *cands))

    def _pick_reward(self, pick: int | None, scores: list[float]) -> float | None:
        """The selector's reward for ``pick`` among answers with ``scores``: where they
        differ, the picked score scaled between the worst (0) and the best (1); where all
        are equal, None (``ties: skip``) or the common score (``ties: outcome``); 0 for an
        unparseable pick."""
        if pick is None:
            return 0.0
        lo, hi = min(scores), max(scores)
        if hi > lo:
            return (scores[pick - 1] - lo) / (hi - lo)
        return scores[pick - 1] if self.ties == "outcome" else None

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
            valid = pick.isdigit() and 1 <= int(pick) <= len(oks)
            chosen = int(pick) if valid else 1
            final.append(oks[chosen - 1])
            if len(oks) >= 2 and len(set(oks)) > 1:  # the pick, where it matters
                informative.append(float(sel is not None and valid and oks[chosen - 1]))
        out = {
            "select/solver_accuracy": mean([float(s.meta.get("correct") == "1")
                                            for s in solver]),
            "select/final_accuracy": mean([float(x) for x in final]),
            "select/exactly_one_rate": len(informative) / n,
            "select/unparseable_rate": unparseable / n,
        }
        if informative:
            out["select/selector_accuracy"] = mean(informative)
        return out


__all__ = ["ROLE_SELECTOR", "ROLE_SOLVER", "SolveSelect"]
