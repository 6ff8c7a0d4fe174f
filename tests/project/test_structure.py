"""The shape of the code: no import cycles, the layering contract, no long functions.

No broker, no model: the checks read the source with ``ast`` (and one subprocess imports
the light modules to see that torch stays out of them).
"""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGE = REPO / "astraflow"
MAX_FUNCTION_LINES = 60


@dataclass
class Module:
    """One module of the package and what it imports."""

    name: str
    path: Path
    # imports run when the module is imported (not inside functions)
    load_time: set[str] = field(default_factory=set)
    # every import, wherever it is (functions included): what the module depends on
    anywhere: set[str] = field(default_factory=set)


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imported(node: ast.Import | ast.ImportFrom, package: str, known: set[str]) -> set[str]:
    """The modules an import statement names: ``from a import b`` names ``a.b`` when that
    is a module of the package, else ``a``."""
    if isinstance(node, ast.Import):
        return {a.name for a in node.names}
    if node.level:
        parts = package.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1] + [node.module or ""]).rstrip(".")
    else:
        base = node.module or ""
    subs = {f"{base}.{a.name}" for a in node.names} & known
    return subs | ({base} if len(subs) < len(node.names) else set())


def _imports(node: ast.AST, package: str, known: set[str], *,
             into_functions: bool) -> Iterator[str]:
    """The modules imported under ``node``; function bodies only with ``into_functions``,
    ``if TYPE_CHECKING:`` blocks never."""
    for child in ast.iter_child_nodes(node):
        if _is_type_checking(child):
            continue
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            yield from _imported(child, package, known)
        elif into_functions or not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield from _imports(child, package, known, into_functions=into_functions)


def _load_modules() -> dict[str, Module]:
    paths = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    known = set(paths)
    out = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text())
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        out[name] = Module(
            name, path,
            load_time=set(_imports(tree, package, known, into_functions=False)),
            anywhere=set(_imports(tree, package, known, into_functions=True)),
        )
    return out


MODULES = _load_modules()


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    graph = {m.name: {x for x in m.load_time if x in MODULES and x != m.name}
             for m in MODULES.values()}
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# (modules, what they must not import anywhere, why). Lower layers first.
LAYERS: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("astraflow.wire.records", "astraflow.wire.schemas", "astraflow.errors", "astraflow.wire.codec"),
     ("torch", "transformers", "astraflow.kafka", "astraflow.dataflow", "astraflow.raas",
      "astraflow.trainer", "astraflow.weights", "astraflow.models", "astraflow.roles",
      "astraflow.config.topology"),
     "the wire format is the bottom layer: records and their codec, nothing else"),
    (("astraflow.kafka",),
     ("torch", "astraflow.raas", "astraflow.trainer", "astraflow.weights", "astraflow.models",
      "astraflow.roles", "astraflow.tasks", "astraflow.sandbox.runner", "astraflow.launch.up",
      "astraflow.eval.evaluator", "astraflow.dataflow.feeder"),
     "Kafka plumbing knows records and processors, not the RL components"),
    (("astraflow.dataflow",),
     ("torch", "astraflow.raas", "astraflow.trainer", "astraflow.weights", "astraflow.models",
      "astraflow.roles", "astraflow.launch.up", "astraflow.eval.evaluator"),
     "processors move records; they run where no GPU stack is installed"),
    (("astraflow.sandbox.runner",), ("astraflow",), "the sandbox stands alone"),
    (("astraflow.tasks",),
     ("torch", "astraflow.kafka", "astraflow.dataflow", "astraflow.raas", "astraflow.trainer",
      "astraflow.weights", "astraflow.models", "astraflow.roles"),
     "tasks and rewards are plain Python"),
    (("astraflow.models", "astraflow.roles"),
     ("astraflow.kafka", "astraflow.dataflow", "astraflow.raas", "astraflow.trainer",
      "astraflow.config.topology", "astraflow.launch.up"),
     "models and role formats are local: no Kafka, no rollout or training service"),
    (("astraflow.raas.workflows",),
     ("astraflow.kafka", "astraflow.dataflow", "astraflow.trainer", "astraflow.weights",
      "astraflow.raas.node", "astraflow.cli.raas"),
     "a workflow turns a task into trajectories with engines; it knows no transport"),
    (("astraflow.trainer.loss", "astraflow.trainer.trainer"),
     ("astraflow.kafka", "astraflow.dataflow", "astraflow.raas", "astraflow.weights",
      "astraflow.config.topology"),
     "the training step is pure torch; the service around it talks to Kafka"),
    (("astraflow.metrics",),
     ("torch", "astraflow.kafka", "astraflow.raas", "astraflow.trainer"),
     "a metric sink is written to by every layer"),
]


@pytest.mark.parametrize("modules,forbidden,why", LAYERS,
                         ids=[",".join(m) for m, _, _ in LAYERS])
def test_layering(modules, forbidden, why):
    broken = sorted(
        f"{m.name} imports {x}"
        for m in MODULES.values() if _within(m.name, modules)
        for x in m.anywhere if _within(x, forbidden)
    )
    assert not broken, f"{why}:\n" + "\n".join(broken)


def test_the_light_modules_import_without_torch():
    """What the command line, the processors and the wire format load at import time does
    not pull in torch (or transformers): they start fast and run without a GPU stack."""
    code = (
        "import sys\n"
        "import astraflow.wire.codec, astraflow.dataflow, astraflow.kafka.loop, astraflow.tasks\n"
        "import astraflow.config.topology, astraflow.metrics, astraflow.cli.model, astraflow.cli.model_role\n"
        "from astraflow.cli.main import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"


def long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """``path:line name (N lines)`` of every function of the package over ``limit`` lines,
    counted from ``def`` to its last line (decorators not counted)."""
    out = []
    for module in MODULES.values():
        for node in ast.walk(ast.parse(module.path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = node.end_lineno - node.lineno + 1
                if n > limit:
                    rel = module.path.relative_to(REPO)
                    out.append(f"{rel}:{node.lineno} {node.name} ({n} lines)")
    return sorted(out)


def test_no_function_is_over_60_lines():
    assert long_functions() == []
