"""``solve_verify`` (n samples per prompt):

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

With ``prompt_format: chat`` (``auto`` on a chat model) the verifier is asked in words
(the problem, ``Proposed answer: 82``, reply ``yes`` or ``no``), and a rejected answer is
retried in the same conversation (``That answer is wrong. Try again. ...``);
``astraflow.roles.chat_formats``. ``blind`` in chat: the verifier first answers the task's
own prompt (one answer per candidate, role ``verifier_own``, rewarded as the solver's
answers are), then, with its answer as its turn, is shown the candidate and replies
``yes`` or ``no`` (role ``verifier``; ``meta`` ``own``, ``own_matches``). A verifier that
must work the answer out before it judges can learn to judge by learning the task, which a
small model cannot do in one yes/no token. Route with ``split_roles: true`` so the two
roles are separate GRPO groups. With ``agreement: true`` as well there is no second turn:
the verdict is the agreement of the verifier's own answer with the candidate (approve when
its final number is the candidate; no number: unparseable), and the own answer is the
verdict's sequence (role ``verifier``, rewarded as the solver's answers are; ``meta``
``own``, ``own_matches``, ``verdict``, ``truth``). The verifier then judges by solving the
problem independently, the one judgement an untrained 135M model can learn in 30 minutes
on two cores (docs/multi-policy.md, "Why the judges solve").

With ``reference_candidates`` r > 0 the verifier also judges r answers per prompt that are
not the solver's: the right answer and a wrong one in turn (a forgotten carry or a near
miss, ``astraflow.roles.teacher.wrong_answer``, drawn from a generator seeded by the task
id), ``meta["source"] = "reference"``, sample indices n..n+r-1. Their verdicts are scored
like the others; the solver is not trained on them and its rewards do not use them. They
keep both classes in every group whatever the solver's accuracy: an untrained solver is
nearly never right and a trained one nearly always, and a verifier that sees one class
learns to give that verdict to everything (docs/multi-policy.md, "On the real model").

``corrective: true`` (chat only, not with ``blind``): the verifier is shown the problem
and the candidate and replies with the correct answer itself (``correction_messages``);
its verdict is agreement (approve when its reply's number is the candidate, else reject; a
reply without a number is unparseable), and it is rewarded as the solver's answers are
(``judge_reward``), its reply against the task's answer (``meta`` ``reply``, ``correct``).
A right reply is always a right verdict. A 135M model's yes/no token carries no sign of an
addition's correctness (docs/multi-policy.md, "Why the judges solve"), while writing the
answer is what it learns as a solver; the candidate in view lets it learn to keep a right
one.

Rewards: each solver sequence (first try or retry) is scored by the correctness of its own
answer (``checker``, default ``astraflow.tasks.check_answer``; or the ``reward`` spec),
and with ``verdict_weight`` w > 0 a first try's reward becomes ``(1 - w) * reward + w``
when the verifier approved it and ``(1 - w) * reward`` when it rejected it (unjudged or
unparseable: the reward alone), so the solver also earns the verifier's approval; a
verdict scores 1 when it
matches the truth of the first answer it judged (``y`` for a right answer, ``n`` for a
wrong one) and 0 when it is wrong or unparseable (``corrective``: its reply's reward). The
final answer of an attempt is the retry's when there was one, else the first.

Metrics (``group_metrics``, put into ``TrajectoryGroup.metrics`` by the RaaS node):
``verify/approval_rate``, ``verify/retry_rate``, ``verify/verifier_accuracy``,
``verify/solver_first_accuracy``, ``verify/solver_final_accuracy``,
``verify/unparseable_rate`` (approval and unparseable rates per verdict, retry rate per
answer).

Options (``SolveVerifyOptions``): those of ``astraflow.raas.workflows.two_policy``, and
``verdict_weight``, ``retry``, ``blind``, ``agreement``, ``corrective``,
``reference_candidates``, ``verdicts_per_prompt`` (only the first m of the n answers are
judged, and so can be retried; default all n -- the answers are independent samples, so
the first m are a random subset) and ``env_latency`` (seconds or a ``Latency`` mapping:
an extra delay per rollout after its three phases, the time the task's environment takes,
as ``single_turn``'s).
"""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

from astraflow.config.options import SolveVerifyOptions
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker, TaskError
from astraflow.raas.workflows.inputs import encode_prompt, sampling_params
from astraflow.raas.workflows.latency import Latency
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.sequences import (
    SequenceBuilder,
    prepare_each,
    role_sequence,
    unbatched,
)
from astraflow.raas.workflows.two_policy import ROLE_SOLVER, TwoPolicyWorkflow, flag, mean
from astraflow.roles.chat_formats import (
    agreement,
    correction_messages,
    own_verdict_messages,
    parse_yes_no,
    retry_messages,
    verify_messages,
)
from astraflow.roles.formats import (
    APPROVE,
    OWN_END,
    REJECT,
    own_answer,
    parse_verdict,
    retry_prompt,
    verify_prompt,
)
from astraflow.roles.teacher import wrong_answer
from astraflow.tasks.check import cut_at_stop, extract_final_number
from astraflow.wire.records import Sequence, Task

ROLE_RETRY = "solver_retry"
ROLE_VERIFIER = "verifier"
ROLE_OWN = "verifier_own"


def agreement_verdict(text: str, candidate: str) -> str:
    """The verdict of a judge that answered ``text`` itself (``agreement``, ``corrective``):
    approve when its final number is ``candidate``, reject when it is another, ``?`` when
    it has none."""
    if not extract_final_number(text):
        return "?"
    return APPROVE if agreement(text, [candidate]) else REJECT


@register_workflow("solve_verify")
class SolveVerify(TwoPolicyWorkflow):
    """Solver answers, verifier approves or rejects, one retry on rejection (module doc)."""

    name = "solve_verify"
    judge_role = ROLE_VERIFIER

    Options = SolveVerifyOptions

    def __init__(self, options: SolveVerifyOptions | None = None,
                 checker: Checker | None = None):
        options = options or SolveVerifyOptions()
        super().__init__(options, options.verifier_policy, options.verifier_sampling,
                         checker)
        self.verdict_weight = options.verdict_weight
        self.retry = options.retry
        self.blind = options.blind
        self.corrective = options.corrective
        self.agreement = options.agreement
        self.verdicts_per_prompt = options.verdicts_per_prompt
        self.reference_candidates = options.reference_candidates
        self.env_latency = Latency.from_option(options.env_latency)

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
            payload, solver, verifier, checker = self._start(task, engines)
            chat = self.chat(solver)
            if not chat:
                self._check_compact()
            return payload, self.solver_ids(solver, str(payload["prompt"]), chat), (
                solver, verifier, checker, chat)

        results, ready = prepare_each(tasks, prepare)
        if not ready:
            return results
        solver, verifier, checker, chat = ready[0][1][2]  # the same for every task
        live = [(i, payload, p_ids) for i, (payload, p_ids, _) in ready]
        firsts = solver.generate([p for *_, p in live], sampling_params(self.sampling, solver, n))
        texts, cands, right = self._read(solver, checker, [p for _, p, _ in live], firsts, chat)

        m = min(n, self.verdicts_per_prompt or n)  # answers 0..m-1 are judged
        prompts = [str(payload["prompt"]) for _, payload, _ in live]
        judged = self._judge(verifier, checker, [tasks[i].task_id for i, *_ in live], prompts,
                             [payload for _, payload, _ in live], cands, right, m, n, chat)
        # per task, the verdicts on the solver's own answers (not the reference candidates)
        verdicts = [{s.sample_index: s.meta["verdict"] for s in seqs
                     if s.role == ROLE_VERIFIER and s.sample_index < m} for seqs in judged]
        rejected = [[j for j, v in vs.items() if v == REJECT] if self.retry else []
                    for vs in verdicts]
        r_ids = [[self._retry_ids(solver, prompts[k], cands[k][j], texts[k][j], chat)
                  for j in rej] for k, rej in enumerate(rejected)]
        r_all = [x for ids in r_ids for x in ids]
        r_flat = solver.generate(r_all, sampling_params(self.sampling, solver, 1)) if r_all else []

        at = 0
        for k, (i, payload, p_ids) in enumerate(live):
            out: list[Sequence] = []
            for j, g in enumerate(firsts[k]):
                ok = right[k][j]
                reward = self._first_reward(texts[k][j], payload, ok, verdicts[k].get(j))
                out.append(role_sequence(self.solver_policy, ROLE_SOLVER, p_ids, g, j,
                                         reward, attempt="1", answer=cands[k][j],
                                         correct=flag(ok)))
            out += judged[k]
            for j, ids in zip(rejected[k], r_ids[k]):
                g = r_flat[at][0]
                at += 1
                text = solver.decode(g.token_ids)
                ok = checker(text, str(payload["answer"])) > 0.5
                out.append(role_sequence(self.solver_policy, ROLE_RETRY, ids, g, j,
                                         self.answer_reward(text, payload, ok), attempt="2",
                                         answer=self.candidate(text, chat),
                                         rejected=cands[k][j], correct=flag(ok)))
            results[i] = out
        if self.env_latency is not None:  # the batch waits for the slowest environment
            self.env_latency.wait_longest(tasks[i].task_id for i, *_ in live)
        return results

    def _check_compact(self) -> None:
        """TaskError for an option the compact format (a model without a chat template)
        does not have."""
        if self.blind and self.reference_candidates:
            raise TaskError("reference_candidates: not with the compact blind format "
                            "(this model has no chat template)")
        for name in ("agreement", "corrective"):
            if getattr(self, name):
                raise TaskError(f"{name}: needs a chat model (this one has no chat "
                                "template)")

    def _read(self, solver: Engine, checker: Checker, payloads: list[dict[str, Any]],
              gens: list[list[Any]], chat: bool):
        """Per task, the solver's texts, what the verifier is shown of them, and whether
        each is right."""
        texts = [[solver.decode(g.token_ids) for g in row] for row in gens]
        cands = [[self.candidate(t, chat) for t in row] for row in texts]
        right = [[checker(t, str(p["answer"])) > 0.5 for t in row]
                 for p, row in zip(payloads, texts)]
        return texts, cands, right

    def _first_reward(self, text: str, payload: Mapping[str, Any], right: bool,
                      verdict: str | None) -> float:
        """A first try's reward: its answer's, blended with the verifier's verdict on it
        (``verdict_weight`` w: ``(1 - w) * reward + w * approved``) where there is one."""
        reward = self.answer_reward(text, payload, right)
        if self.verdict_weight and verdict in (APPROVE, REJECT):
            reward = (1 - self.verdict_weight) * reward + self.verdict_weight * float(
                verdict == APPROVE)
        return reward

    def _retry_ids(self, solver: Engine, prompt: str, cand: str, text: str,
                   chat: bool) -> list[int]:
        """The retry's prompt: the rejected answer, then the problem again (compact), or
        the conversation with the rejection as the user's next turn (chat)."""
        if chat:
            return self.chat_ids(solver, retry_messages(prompt, cut_at_stop(text).strip()))
        return encode_prompt(solver, retry_prompt(prompt, cand, REJECT))

    def _verdict(self, b: SequenceBuilder, v: bool | None, truth: bool, cand: str,
                 **meta: str) -> Sequence:
        """The verdict ``v`` (None: unparseable) of ``b``'s sequence, scored against the
        truth of the answer it judged."""
        b.meta.update(verdict="?" if v is None else (APPROVE if v else REJECT),
                      truth=flag(truth), answer=cand, **meta)
        s = b.build(float(v is not None and v == truth))
        s.role = ROLE_VERIFIER
        return s

    def _judge(self, verifier: Engine, checker: Checker, task_ids: list[str],
               prompts: list[str], payloads: list[dict[str, Any]], cands: list[list[str]],
               right: list[list[bool]], m: int, n: int, chat: bool) -> list[list[Sequence]]:
        """Per task, the verdicts on the first ``m`` answers (and the reference
        candidates)."""
        if self.blind and not chat:
            return self._judge_blind(verifier, prompts, [c[:m] for c in cands],
                                     [r[:m] for r in right], m)
        shown = [self._shown(t, p, c[:m], r[:m], n)
                 for t, p, c, r in zip(task_ids, payloads, cands, right)]
        if self.blind:
            return self._judge_own_first(verifier, checker, prompts, payloads, shown)
        if self.corrective:
            return self._judge_corrective(verifier, checker, prompts, payloads, shown)
        return self._judge_seen(verifier, prompts, shown, chat=chat)

    def _judge_corrective(self, verifier: Engine, checker: Checker, prompts: list[str],
                          payloads: list[dict[str, Any]],
                          shown: list[list[tuple[int, str, bool, dict[str, str]]]]
                          ) -> list[list[Sequence]]:
        """The corrective format (module doc): one reply per candidate, the correct
        answer as the verifier sees it; the verdict is agreement."""
        ids = [[self.chat_ids(verifier, correction_messages(prompt, [cand]))
                for _, cand, _, _ in row] for prompt, row in zip(prompts, shown)]
        gens = iter(verifier.generate([x for row in ids for x in row],
                                      sampling_params(self.judge_sampling, verifier, 1)))
        out = []
        for payload, ids_k, row in zip(payloads, ids, shown):
            judged = []
            for v_ids, (j, cand, truth, meta) in zip(ids_k, row):
                g = next(gens)[0]
                text = verifier.decode(g.token_ids)
                ok = checker(text, str(payload["answer"])) > 0.5
                judged.append(role_sequence(
                    self.verifier_policy, ROLE_VERIFIER, v_ids, g, j,
                    self.judge_answer_reward(text, payload, ok),
                    verdict=agreement_verdict(text, cand), truth=flag(truth), answer=cand,
                    reply=self.candidate(text, True), correct=flag(ok), **meta))
            out.append(judged)
        return out

    def _judge_own_first(self, verifier: Engine, checker: Checker, prompts: list[str],
                         payloads: list[dict[str, Any]],
                         shown: list[list[tuple[int, str, bool, dict[str, str]]]]
                         ) -> list[list[Sequence]]:
        """The blind chat format (module doc): own answers, then one verdict each (with
        ``agreement``, the own answer is the verdict: no second turn)."""
        p_ids = [self.chat_ids(verifier, {"prompt": prompt}) for prompt in prompts]
        owns = verifier.generate(p_ids, sampling_params(self.judge_sampling, verifier,
                                                        len(shown[0])))
        out: list[list[Sequence]] = [[] for _ in shown]
        asked = []  # (task, sample index, candidate, truth, meta, own answer, verdict prompt)
        for k, (payload, row) in enumerate(zip(payloads, shown)):
            for g, (j, cand, truth, meta) in zip(owns[k], row):
                text = verifier.decode(g.token_ids)
                own, ok = self.candidate(text, True), checker(text, str(payload["answer"])) > 0.5
                said = {"own": own, "correct": flag(ok), "truth": flag(truth), **meta}
                if self.agreement:
                    said.update(answer=cand, own_matches=flag(own == cand),
                                verdict=agreement_verdict(text, cand))
                out[k].append(role_sequence(
                    self.verifier_policy, ROLE_VERIFIER if self.agreement else ROLE_OWN,
                    p_ids[k], g, j, self.judge_answer_reward(text, payload, ok), **said))
                if self.agreement:
                    continue
                asked.append((k, j, cand, truth, meta, own, self.chat_ids(
                    verifier, own_verdict_messages(prompts[k], cut_at_stop(text).strip(), cand))))
        gens = verifier.generate([a[-1] for a in asked],
                                 sampling_params(self.judge_sampling, verifier, 1)) if asked else []
        for (k, j, cand, truth, meta, own, ids), (g, *_) in zip(asked, gens):
            b = SequenceBuilder(self.verifier_policy, ids, j)
            b.add_generated(g)
            out[k].append(self._verdict(b, parse_yes_no(verifier.decode(g.token_ids)), truth,
                                        cand, own=own, own_matches=flag(own == cand), **meta))
        return out

    def _shown(self, task_id: str, payload: Mapping[str, Any], cands: list[str],
               right: list[bool], n: int) -> list[tuple[int, str, bool, dict[str, str]]]:
        """What the verifier judges for one prompt: ``(sample index, candidate, truth,
        meta)`` for the solver's answers, then the reference candidates (module doc)."""
        shown = [(j, c, ok, {}) for j, (c, ok) in enumerate(zip(cands, right))]
        rng = random.Random(f"reference:{task_id}")
        problem, answer = str(payload["prompt"]), str(payload["answer"])
        for r in range(self.reference_candidates):
            truth = r % 2 == 0
            cand = answer if truth else wrong_answer(problem, answer, rng)[0]
            shown.append((n + r, cand, truth, {"source": "reference"}))
        return shown

    def _judge_seen(self, verifier: Engine, prompts: list[str],
                    shown: list[list[tuple[int, str, bool, dict[str, str]]]],
                    chat: bool = False) -> list[list[Sequence]]:
        """One turn per candidate shown (``_shown``): ``37+45=82?`` -> ``82y`` (chat: the
        problem and the proposed answer -> ``yes``/``no``)."""
        def ids_of(prompt: str, c: str) -> list[int]:
            if chat:
                return self.chat_ids(verifier, verify_messages(prompt, c))
            return encode_prompt(verifier, verify_prompt(prompt, c))

        parse = parse_yes_no if chat else parse_verdict
        v_ids = [[ids_of(prompt, c) for _, c, _, _ in row] for prompt, row in zip(prompts, shown)]
        v_flat = iter(verifier.generate([x for ids in v_ids for x in ids],
                                        sampling_params(self.judge_sampling, verifier, 1)))
        out = []
        for ids_k, row_k in zip(v_ids, shown):
            row = []
            for ids, (j, cand, truth, meta) in zip(ids_k, row_k):
                g = next(v_flat)[0]
                b = SequenceBuilder(self.verifier_policy, ids, j)
                b.add_generated(g)
                row.append(self._verdict(b, parse(verifier.decode(g.token_ids)), truth, cand,
                                         **meta))
            out.append(row)
        return out

    def _judge_blind(self, verifier: Engine, prompts: list[str], cands: list[list[str]],
                     right: list[list[bool]], n: int, chat: bool = False) -> list[list[Sequence]]:
        """Two turns: the verifier answers the problem n times (``37+45=`` -> ``82|``), then
        each own answer is shown one candidate (``73?``, not trained) -> ``n``."""
        p_ids = [encode_prompt(verifier, prompt) for prompt in prompts]
        owns = verifier.generate(p_ids, sampling_params(self.judge_sampling, verifier, n,
                                                  stop=(OWN_END,)))
        builders, asked, ask_ids = [], [], []
        for k, gens in enumerate(owns):
            row = []
            for j, g in enumerate(gens):
                b = SequenceBuilder(self.verifier_policy, p_ids[k], j)
                b.add_generated(g)
                own = own_answer(verifier.decode(g.token_ids))
                if own is not None:
                    b.add_external(encode_prompt(verifier, f"{cands[k][j]}?"))
                    asked.append((k, j))
                    ask_ids.append(list(b.token_ids))
                row.append((b, own))
            builders.append(row)
        # the verdict is the turn's first token: nothing after it is read or worth a step
        answers = (verifier.generate(ask_ids, sampling_params(self.judge_sampling, verifier, 1,
                                                         max_new_tokens=1))
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
                                            own_matches=flag(own == cands[k][j])))
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
            "verify/verifier_accuracy": mean([float(s.meta.get("verdict") == (
                APPROVE if s.meta.get("truth") == "1" else REJECT)) for s in verdicts]),
            "verify/solver_first_accuracy": mean(
                [float(s.meta.get("correct") == "1") for s in firsts.values()]),
            "verify/solver_final_accuracy": mean([float(x) for x in final]),
            "verify/unparseable_rate": sum(s.meta.get("verdict") == "?" for s in verdicts) / n_v,
        }


__all__ = ["ROLE_RETRY", "ROLE_SOLVER", "ROLE_VERIFIER", "SolveVerify"]
