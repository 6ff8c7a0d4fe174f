"""A ReAct calculator agent, written against the `openai` client alone (no AstraFlow import).

Run by AstraFlow's `agent` workflow (topology/agent-react.yaml), it reads its task from
ASTRAFLOW_TASK and its endpoint from OPENAI_BASE_URL, as any OpenAI program would; run by
hand against any OpenAI-compatible server, it does the same:

    OPENAI_BASE_URL=http://127.0.0.1:8000/v1 OPENAI_API_KEY=x \
        ASTRAFLOW_TASK='{"prompt": "What is 37+45?", "answer": "82"}' python react_calc.py

It offers the model a `calculate` tool, runs the calls the model makes and hands back
their results, until the model answers without a call (or after MAX_TURNS), then prints
{"answer": ...}: the workflow's reward function scores it. With AGENT_DEMO=1 the
conversation opens with one worked exchange (a question, a call, its result, the answer),
which a small chat model such as SmolLM2-135M needs before it writes calls at all.
"""

from __future__ import annotations

import ast
import json
import operator
import os

from openai import OpenAI

MAX_TURNS = 4
MODEL = os.environ.get("AGENT_MODEL", "actor")
DEMO = [  # one worked exchange, in the OpenAI format
    {"role": "user", "content": "What is 12+30?"},
    {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_demo", "type": "function",
        "function": {"name": "calculate", "arguments": '{"expression": "12+30"}'}}]},
    {"role": "tool", "tool_call_id": "call_demo", "content": "42"},
    {"role": "assistant", "content": "42"},
]
TOOLS = [{
    "type": "function",
    "function": {
        "name": "calculate",
        "description": "Evaluate an arithmetic expression of numbers, + - * / and brackets.",
        "parameters": {"type": "object",
                       "properties": {"expression": {"type": "string"}},
                       "required": ["expression"]},
    },
}]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
        ast.Div: operator.truediv, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The value of an arithmetic expression, or the error, as text for the model."""
    def value(node: ast.AST) -> float:
        if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError("only numbers, + - * / and brackets")

    try:
        result = value(ast.parse(expression, mode="eval").body)
    except (SyntaxError, ValueError, ZeroDivisionError) as e:
        return f"error: {e}"
    return str(int(result)) if float(result).is_integer() else str(result)


def main() -> None:
    task = json.loads(os.environ["ASTRAFLOW_TASK"])
    client = OpenAI()  # OPENAI_BASE_URL and OPENAI_API_KEY come from the environment
    demo = DEMO if os.environ.get("AGENT_DEMO") == "1" else []
    messages = [*demo, {"role": "user", "content": str(task["prompt"])}]
    answer = ""
    for _ in range(MAX_TURNS):
        # no max_tokens: the workflow's max_new_tokens applies (any request may set one)
        reply = client.chat.completions.create(model=MODEL, messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        answer = message.content or ""
        if not message.tool_calls:
            break
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                expression = json.loads(call.function.arguments).get("expression", "")
            except json.JSONDecodeError:
                expression = ""
            messages.append({"role": "tool", "tool_call_id": call.id,
                             "content": calculate(str(expression))})
    print(json.dumps({"answer": answer}))


if __name__ == "__main__":
    main()
