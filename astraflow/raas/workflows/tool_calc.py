"""``tool_calc``: multi-turn tool use with a calculator."""

from __future__ import annotations

import re
import time

from astraflow.config.options import ToolCalcOptions
from astraflow.raas.calc import CalcError, calculate
from astraflow.raas.engine import Engine
from astraflow.raas.workflows.base import Checker
from astraflow.raas.workflows.inputs import prompt_task, sampling_params
from astraflow.raas.workflows.latency import Latency
from astraflow.raas.workflows.registry import register_workflow
from astraflow.raas.workflows.scoring import Scorer
from astraflow.raas.workflows.sequences import SequenceBuilder
from astraflow.wire.records import Sequence, Task

_CALL = re.compile(r"<calc>(.*?)</calc>", re.S)


@register_workflow("tool_calc")
class ToolCalc:
    """Multi-turn tool use with a calculator.

    The model may write ``<calc>EXPR</calc>``; generation stops there, the workflow
    evaluates EXPR with the safe parser (``astraflow.raas.calc``) and appends
    ``<result>VALUE</result>`` (or ``<result>error: ...</result>``) as tokens the policy did
    not generate (loss_mask 0, versions -1, logprobs 0), then lets the model continue, for
    at most ``max_turns`` model turns. The reward is checker(text of the last model turn,
    answer). The ``n`` samples run as one batch per turn; a turn's tool calls run
    concurrently, so the turn waits for the slowest ``tool_latency`` draw.

    Options (``ToolCalcOptions``): as ``single_turn`` plus ``max_turns`` and
    ``tool_latency`` (seconds or a ``Latency`` mapping, e.g. ``{"dist": "pareto",
    "scale_s": 0.05, "alpha": 1.2, "seed": 0}``).
    """

    name = "tool_calc"
    open_tag, close_tag = "<calc>", "</calc>"
    Options = ToolCalcOptions

    def __init__(self, options: ToolCalcOptions | None = None,
                 checker: Checker | None = None):
        self.options = options = options or ToolCalcOptions()
        self.score = Scorer(options.reward, checker)
        self.max_turns = options.max_turns
        self.tool_latency = Latency.from_option(options.tool_latency)
        self.env_latency = Latency.from_option(options.env_latency)
        self.sampling = options

    def run(self, task: Task, engines: dict[str, Engine], n: int) -> list[Sequence]:
        payload, engine, prompt_ids = prompt_task(task, engines)
        params = sampling_params(self.sampling, engine, 1, stop=(self.close_tag,))
        seqs = [SequenceBuilder(engine.policy, prompt_ids, j) for j in range(n)]
        last_text = [""] * n
        calls = [0] * n
        active = list(range(n))
        for turn in range(self.max_turns):
            gens = engine.generate([seqs[j].token_ids for j in active], params)
            still: list[int] = []
            delays: list[float] = []
            for j, (g,) in zip(active, gens):
                seqs[j].add_generated(g)
                text = engine.decode(g.token_ids)
                last_text[j] = text
                call = _last_call(text) if g.finish_reason == "stop" else None
                if call is None or turn == self.max_turns - 1:
                    continue
                calls[j] += 1
                try:
                    result = calculate(call)
                except CalcError as e:
                    result = f"error: {e}"
                seqs[j].add_external(engine.encode(f"<result>{result}</result>"))
                if self.tool_latency is not None:
                    delays.append(self.tool_latency.draw())
                still.append(j)
            if delays:
                time.sleep(max(delays))
            active = still
            if not active:
                break
        if self.env_latency is not None:
            time.sleep(self.env_latency.draw())
        out = []
        for j, b in enumerate(seqs):
            b.meta["tool_calls"] = str(calls[j])
            out.append(b.build(self.score(last_text[j], payload)))
        return out


def _last_call(text: str) -> str | None:
    found = _CALL.findall(text)
    return found[-1] if found else None


__all__ = ["ToolCalc"]
