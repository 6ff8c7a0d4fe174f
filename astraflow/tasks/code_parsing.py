"""Reading the ``code_tests`` roles' completions: the solver's program and the generator's
test cases, in the tiny model's compact format and in a chat model's replies.

* compact: the solver writes one expression (``x+3``, its first line), the generator
  ``f(1)==4;f(0)==3``;
* chat: the solver writes a whole function, perhaps in a Markdown code block among prose
  (``extract_program`` keeps ``def f(...):`` and its indented body); the generator writes
  ``assert f(1) == 4`` lines among anything else (``parse_assert_tests``).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from astraflow.sandbox import normalise
from astraflow.tasks.check import cut_at_stop

Test = tuple[list[Any], Any]
MAX_ITEM_CHARS = 200
_FENCE = re.compile(r"```[a-zA-Z0-9]*\n?(.*?)(?:```|$)", re.S)


def solver_expression(text: str) -> str:
    """The solver's expression: its completion up to the first newline, stripped."""
    return text.split("\n", 1)[0].strip()


def parse_item(item: str, func: str, arity: int) -> Test | None:
    """``(args, expected)`` of one ``func(ARGS)==EXPECTED`` item with ``arity`` literal
    arguments and a literal result (JSON-able), else None."""
    if len(item) > MAX_ITEM_CHARS:
        return None
    try:
        node = ast.parse(item, mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None
    if not (
        isinstance(node, ast.Compare)
        and len(node.ops) == 1
        and isinstance(node.ops[0], ast.Eq)
        and isinstance(node.left, ast.Call)
        and isinstance(node.left.func, ast.Name)
        and node.left.func.id == func
        and not node.left.keywords
        and len(node.left.args) == arity
    ):
        return None
    try:
        args = normalise([ast.literal_eval(a) for a in node.left.args])
        expected = normalise(ast.literal_eval(node.comparators[0]))
    except (ValueError, TypeError, SyntaxError, RecursionError, MemoryError):
        return None
    return args, expected


def _dedup(tests: list[Test]) -> list[Test]:
    seen: set[str] = set()
    out = []
    for args, expected in tests:
        key = json.dumps([args, expected])
        if key not in seen:
            seen.add(key)
            out.append((args, expected))
    return out


def parse_tests(text: str, func: str, arity: int, max_tests: int = 8) -> list[Test] | None:
    """Test cases from a compact generator completion, or None if it is unparseable.

    Items are separated by ``;`` or newlines; each must be ``func(ARGS)==EXPECTED``
    (``parse_item``). Blank items are skipped, items after the first ``max_tests`` are
    ignored, duplicates are dropped. No item at all, or one bad item among the first
    ``max_tests``, makes the whole completion unparseable.
    """
    items = [t.strip() for t in re.split(r"[;\n]", text)]
    items = [t for t in items if t][:max_tests]
    if not items:
        return None
    tests = []
    for item in items:
        test = parse_item(item, func, arity)
        if test is None:
            return None
        tests.append(test)
    return _dedup(tests)


def parse_assert_tests(text: str, func: str, arity: int,
                       max_tests: int = 8) -> tuple[list[Test], int] | None:
    """``(test cases, assert lines read)`` from a chat generator's reply, or None when it
    has no ``assert`` line. Lines that do not start with ``assert`` (prose, code fences)
    are skipped; of the first ``max_tests`` assert lines, those that are not ``assert
    func(ARGS) == EXPECTED`` (a message, a trailing ``.``/``;`` or comment is forgiven)
    count as read but give no test, so a reply's share of usable tests is ``len(tests) /
    read``."""
    lines = [ln.strip() for ln in cut_at_stop(text).split("\n")]
    asserts = [ln[len("assert"):].strip() for ln in lines
               if ln.startswith("assert ") or ln.startswith("assert(")][:max_tests]
    if not asserts:
        return None
    tests = []
    for item in asserts:
        test = parse_item(_assert_test(item), func, arity)
        if test is not None:
            tests.append(test)
    return _dedup(tests), len(asserts)


def _assert_test(item: str) -> str:
    """The condition of ``assert <item>``, its message dropped (``f(1) == 2, "why"``), a
    trailing ``.``/``;`` or comment forgiven; "" when it is not an assert statement."""
    item = item.rstrip().rstrip(".;").rstrip()
    if len(item) > 4 * MAX_ITEM_CHARS:
        return ""
    try:
        node = ast.parse("assert " + item).body[0]
    except (SyntaxError, ValueError, RecursionError, MemoryError, IndexError):
        return ""
    return ast.unparse(node.test) if isinstance(node, ast.Assert) else ""


def extract_program(text: str, func: str) -> str:
    """The function ``func`` a chat solver wrote: from ``def func(`` through its indented
    body (inside the first Markdown code block when there is one), "" when there is no
    such definition."""
    text = cut_at_stop(text)
    fenced = _FENCE.search(text)
    code = fenced.group(1) if fenced else text
    lines = code.split("\n")
    start = next((i for i, ln in enumerate(lines) if ln.startswith(f"def {func}(")), None)
    if start is None:
        return ""
    out = [lines[start]]
    for ln in lines[start + 1:]:
        if ln.strip() and not ln[:1].isspace():
            break  # the first unindented line after the body
        out.append(ln)
    return "\n".join(out).rstrip() + "\n"


__all__ = ["MAX_ITEM_CHARS", "Test", "extract_program", "parse_assert_tests", "parse_item",
           "parse_tests", "solver_expression"]
