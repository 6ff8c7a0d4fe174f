"""verifiers environments on local data: single-turn, multi-turn and with a tool.

Each ``load_*`` function is what a verifiers environment module exports
(``load_environment(**args) -> vf.Environment``), built from verifiers' own classes:

- ``load_single_turn``: ``vf.SingleTurnEnv``, one answer per problem;
- ``load_multi_turn``: a ``vf.MultiTurnEnv`` that says "try again" after a wrong answer,
  for up to ``max_turns`` answers;
- ``load_tool``: ``vf.ToolEnv`` with a ``calculate(expression)`` tool (AstraFlow's safe
  arithmetic parser, ``astraflow.raas.calc``).

Their problems are reasoning-gym's ``basic_arithmetic`` (``astraflow.tasks.reasoning_gym``:
drawn from a seed, nothing downloaded; the eval dataset is the held-out split) and the
rubric is ``correct``: reasoning-gym's own ``score_answer`` of the answer inside the last
``<answer>...</answer>`` of the final assistant message (else of that whole message).
``max_terms`` and ``max_digits`` set the problems' size. ``demo`` puts one worked exchange
before each problem (``DEMO``: a fixed problem, dropped from the data, solved with the tool
in the tool environment and answered outright in the others), the way a small model is
shown the format it is to write; it never holds the problem's answer.
"""

from __future__ import annotations

import json
from typing import Any

import verifiers as vf
from datasets import Dataset

from astraflow.raas.calc import CalcError
from astraflow.raas.calc import calculate as _calculate
from astraflow.tasks import reasoning_gym as rg

TASK = "basic_arithmetic"
SYSTEM = ("Solve the arithmetic problem. Give your final answer alone inside "
          "<answer></answer> tags.")
TOOL_SYSTEM = ("Solve the arithmetic problem. You may call the calculate tool with an "
               "expression. Give your final answer alone inside <answer></answer> tags.")


DEMO_QUESTION, DEMO_EXPRESSION, DEMO_ANSWER = "Calculate 214 - 37 + 5.", "214 - 37 + 5", "182"


def demo(tool: bool) -> list[dict[str, Any]]:
    """The worked exchange: the tool called and its result read, or the answer outright."""
    if not tool:
        return [{"role": "user", "content": DEMO_QUESTION},
                {"role": "assistant", "content": f"<answer>{DEMO_ANSWER}</answer>"}]
    call = {"id": "call_demo", "type": "function",
            "function": {"name": "calculate",
                         "arguments": json.dumps({"expression": DEMO_EXPRESSION})}}
    return [{"role": "user", "content": DEMO_QUESTION},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_demo", "content": DEMO_ANSWER},
            {"role": "assistant", "content": f"<answer>{DEMO_ANSWER}</answer>"}]


def _rows(split: str, size: int, seed: int, config: dict[str, Any]) -> Dataset:
    query = "&".join(f"{k}={v}" for k, v in sorted(config.items()))
    path = f"reasoning_gym:{TASK}:{split}" + (f"?{query}" if query else "")
    payloads = rg.reasoning_gym_payloads(path, size=size, seed=seed)
    return Dataset.from_list([{"question": p["question"], "answer": p["answer"],
                               "info": {"reasoning_gym": p["reasoning_gym"]}}
                              for p in payloads if p["question"] != DEMO_QUESTION])


def final_text(completion: Any) -> str:
    """The text of the last assistant message of a chat completion (or the text itself)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(list(completion or [])):
        role = message.get("role") if isinstance(message, dict) else getattr(message, "role", None)
        if role == "assistant":
            content = (message.get("content") if isinstance(message, dict)
                       else getattr(message, "content", None))
            return content if isinstance(content, str) else ""
    return ""


def correct(completion: Any, info: dict[str, Any], **kwargs: Any) -> float:
    """The rubric: reasoning-gym's ``score_answer`` of the final message's answer."""
    return rg.score(final_text(completion), info)


def _field(message: Any, name: str) -> Any:
    return message.get(name) if isinstance(message, dict) else getattr(message, name, None)


def used_tool(completion: Any, **kwargs: Any) -> float:
    """1.0 when the episode called the calculator and it gave a number (a call of an unknown
    tool or of a malformed expression gets an error text instead), else 0.0. Says nothing
    of the problem's answer: a call of any valid expression counts."""
    if isinstance(completion, str):
        return 0.0
    return float(any(_field(m, "role") == "tool" and _is_number(_field(m, "content"))
                     for m in completion))


def _is_number(text: Any) -> bool:
    try:
        float(str(text).strip())
    except ValueError:
        return False
    return True


def calculate(expression: str) -> str:
    """Evaluate an arithmetic expression (numbers, + - * / and parentheses).

    Args:
        expression: the expression, e.g. "(12 + 5) * 3".
    """
    try:
        return str(_calculate(expression))
    except CalcError as e:
        return f"error: {e}"


def _datasets(size: int, eval_size: int, seed: int, max_terms: int,
              max_digits: int) -> dict[str, Dataset]:
    config = {"max_terms": max_terms, "max_digits": max_digits}
    return {"dataset": _rows("train", size, seed, config),
            "eval_dataset": _rows("eval", eval_size, seed, config)}


def _demo(wanted: bool, tool: bool) -> list[dict[str, Any]] | None:
    return demo(tool) if wanted else None


def load_single_turn(size: int = 64, eval_size: int = 32, seed: int = 0, max_terms: int = 2,
                     max_digits: int = 2, demo: bool = False,
                     call_bonus: float = 0.0) -> vf.Environment:
    """A ``vf.SingleTurnEnv``: one answer per problem, scored by ``correct``.
    ``call_bonus`` is ``load_tool``'s, taken so that a tool environment and this control
    share their arguments: with no tool there is no call to reward."""
    return vf.SingleTurnEnv(system_prompt=SYSTEM, rubric=vf.Rubric(funcs=[correct]),
                            few_shot=_demo(demo, tool=False),
                            **_datasets(size, eval_size, seed, max_terms, max_digits))


class RetryEnv(vf.MultiTurnEnv):
    """A ``vf.MultiTurnEnv``: after a wrong answer the environment says so and the model
    answers again, up to ``max_turns`` answers; the rubric scores the last one."""

    async def env_response(self, messages: Any, state: Any, **kwargs: Any) -> Any:
        if correct(messages, state["info"]) == 1.0:
            state["final_env_response"] = []
            return []
        return [{"role": "user", "content": "That is not right. Try again."}]


def load_multi_turn(size: int = 64, eval_size: int = 32, seed: int = 0, max_terms: int = 2,
                    max_digits: int = 2, max_turns: int = 2,
                    demo: bool = False) -> vf.Environment:
    """``RetryEnv``: a multi-turn environment of the same problems."""
    return RetryEnv(system_prompt=SYSTEM, rubric=vf.Rubric(funcs=[correct]),
                    few_shot=_demo(demo, tool=False),
                    max_turns=max_turns,
                    **_datasets(size, eval_size, seed, max_terms, max_digits))


def _tool_error(e: Exception) -> str:
    """What the model reads when its call fails: verifiers' default is the bare exception
    text (``'apply'`` for an unknown tool), which says nothing of what went wrong."""
    if isinstance(e, KeyError):
        return f"error: no tool {e}; the tool is calculate(expression)"
    return f"error: {type(e).__name__}: {e}"


def tool_reward(call_bonus: float = 0.0) -> tuple[list[Any], list[float]]:
    """The tool environment's reward functions and their weights: ``correct``, and
    ``used_tool`` at ``call_bonus`` when it is not 0 (another trainer given this
    environment's rows, TRL's, sums them the same way)."""
    if call_bonus:
        return [correct, used_tool], [1.0, float(call_bonus)]
    return [correct], [1.0]


def load_tool(size: int = 64, eval_size: int = 32, seed: int = 0, max_terms: int = 2,
              max_digits: int = 2, max_turns: int = 3, demo: bool = False,
              call_bonus: float = 0.0) -> vf.Environment:
    """A ``vf.ToolEnv`` with the ``calculate`` tool, scored by ``correct``; ``call_bonus``
    > 0 adds ``used_tool`` with that weight to the reward (a denser signal for a model that
    seldom writes a valid call; success is still ``correct`` alone)."""
    funcs, weights = tool_reward(call_bonus)
    return vf.ToolEnv(tools=[calculate], max_turns=max_turns, system_prompt=TOOL_SYSTEM,
                      few_shot=_demo(demo, tool=True), error_formatter=_tool_error,
                      rubric=vf.Rubric(funcs=funcs, weights=weights),
                      **_datasets(size, eval_size, seed, max_terms, max_digits))


__all__ = ["RetryEnv", "calculate", "demo", "correct", "final_text", "load_multi_turn",
           "load_single_turn", "load_tool", "tool_reward", "used_tool"]
