"""Mutants of a code task's reference expression: small wrong programs that a good test
suite tells apart from the reference (mutation testing).

A mutant changes one thing of the expression: an integer constant by one (``x+3`` ->
``x+4``, ``x+2``), an arithmetic operator (``+`` <-> ``-``, ``*`` -> ``+``, ``//`` <->
``%``) or a builtin (``max`` <-> ``min``, ``sum`` <-> ``len``). The ``code_tests``
workflow's mutation reward scores a generated test suite by the mutants its valid tests
catch. Mutants are built from the task's reference (ours, never model output) and run in
the sandbox like any other code.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Iterator

MAX_MUTANTS = 6
_OPERATORS: dict[type, tuple[type, ...]] = {
    ast.Add: (ast.Sub,),
    ast.Sub: (ast.Add,),
    ast.Mult: (ast.Add,),
    ast.FloorDiv: (ast.Mod,),
    ast.Mod: (ast.FloorDiv,),
}
_NAMES = {"max": "min", "min": "max", "sum": "len", "len": "sum"}


def _variants(tree: ast.Expression) -> Iterator[str]:
    """Every one-change variant of ``tree``, in the order of its nodes."""
    nodes = list(ast.walk(tree))
    for i, node in enumerate(nodes):
        if isinstance(node, ast.Constant) and type(node.value) is int:
            for value in (node.value + 1, node.value - 1):
                yield _changed(tree, i, lambda n, v=value: setattr(n, "value", v))
        elif isinstance(node, ast.BinOp):
            for op in _OPERATORS.get(type(node.op), ()):
                yield _changed(tree, i, lambda n, op=op: setattr(n, "op", op()))
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in _NAMES:
            yield _changed(tree, i, lambda n: setattr(n.func, "id", _NAMES[n.func.id]))


def _changed(tree: ast.Expression, index: int, change) -> str:
    """The source of a copy of ``tree`` whose ``index``-th node (``ast.walk`` order) had
    ``change`` applied."""
    import copy

    clone = copy.deepcopy(tree)
    change(list(ast.walk(clone))[index])
    return ast.unparse(clone)


def mutants(expr: str, limit: int = MAX_MUTANTS) -> list[str]:
    """Up to ``limit`` distinct one-change mutants of the Python expression ``expr`` (none
    when it does not parse)."""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError):
        return []
    same = ast.unparse(tree)
    out: list[str] = []
    for m in _variants(tree):
        if m != same and m not in out:
            out.append(m)
        if len(out) >= limit:
            break
    return out


def mutants_source(params: Iterable[str], exprs: list[str], func: str = "f") -> str:
    """Python source of ``func(params)`` returning, for each of ``exprs``, ``[True, its
    value]`` or ``[False, None]`` when it raises: every mutant in one sandboxed call."""
    args = ", ".join(params)
    lines = [f"def _m{i}({args}): return {e}" for i, e in enumerate(exprs)]
    lines += [
        f"def {func}({args}):",
        "    out = []",
        f"    for m in ({', '.join(f'_m{i}' for i in range(len(exprs)))},):",
        "        try:",
        f"            out.append([True, m({args})])",
        "        except Exception:",
        "            out.append([False, None])",
        "    return out",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["MAX_MUTANTS", "mutants", "mutants_source"]
