"""The shape of the code: no import cycles, the layer order, argparse only in the CLI.

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


def _package(module: str) -> str:
    """The top-level package of ``module`` (``astraflow.kafka.loop`` -> ``kafka``); a
    top-level module is its own (``astraflow.errors`` -> ``errors``)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _internal(module: Module) -> set[str]:
    """The package modules ``module`` imports anywhere (functions included)."""
    return {x for x in module.anywhere if x in MODULES and x != module.name}


def test_no_module_import_cycles_counting_imports_inside_functions():
    assert _cycles({m.name: _internal(m) for m in MODULES.values()}) == []


def test_no_package_import_cycles():
    graph: dict[str, set[str]] = {}
    for m in MODULES.values():
        graph.setdefault(_package(m.name), set()).update(
            _package(x) for x in _internal(m) if _package(x) != _package(m.name))
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


# The layers, lowest first: a package imports only from packages of lower layers (and
# itself), counting imports inside functions. Packages of one layer do not import each
# other. docs/architecture.md draws the same order.
LAYER_ORDER: list[tuple[str, ...]] = [
    ("errors",),  # the base of errors a user can act on
    ("wire",),  # records, schemas, the Avro codec, semantic checks of records
    ("metrics",),  # where every layer writes its figures
    ("kafka",),  # client wrappers, config, the transactional loop, topics, tables
    ("sandbox",),  # untrusted code in a limited child process
    ("tasks",),  # task sources and rewards: plain Python
    ("config",),  # the typed topology: one declaration per setting, torch-free
    ("dataflow", "weights"),  # processors and their runtime; weight deltas and stores
    ("security", "models"),  # ACLs and TLS; local models, GGUF import, sharing
    ("broker", "roles"),  # the embedded broker and cluster; multi-policy role formats
    ("raas", "trainer"),  # rollout nodes and the trainer
    # the evaluator; `up`, its plan and its supervision; example environments written
    # against other ecosystems' APIs (they use raas's calculator)
    ("eval", "launch", "envs"),
    ("replay",),  # offline replay of a run's retained topics (trains as `up` would)
    ("cli",),  # the `astraflow` command: the only package that imports argparse
]
RANK = {package: i for i, layer in enumerate(LAYER_ORDER) for package in layer}


def test_every_package_has_a_layer():
    assert sorted({_package(m) for m in MODULES} - set(RANK) - {""}) == []


def test_imports_follow_the_layers():
    broken = sorted(
        f"{m.name} imports {x}"
        for m in MODULES.values() if _package(m.name) in RANK
        for x in _internal(m)
        if _package(x) != _package(m.name) and RANK[_package(x)] >= RANK[_package(m.name)]
    )
    assert not broken, "an import against the layer order:\n" + "\n".join(broken)


def test_only_the_cli_imports_argparse():
    users = sorted(m.name for m in MODULES.values()
                   if "argparse" in m.anywhere and _package(m.name) != "cli")
    assert users == []


def _within(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# Beyond the layer order: (modules, what they must not import anywhere, why).
FORBIDDEN: list[tuple[tuple[str, ...], tuple[str, ...], str]] = [
    (("astraflow.wire", "astraflow.errors", "astraflow.metrics", "astraflow.kafka",
      "astraflow.config", "astraflow.dataflow", "astraflow.tasks", "astraflow.sandbox"),
     ("torch", "transformers"),
     "the wire format, Kafka plumbing, the topology and the processors run where no GPU "
     "stack is installed"),
    (("astraflow.sandbox",),
     tuple(f"astraflow.{p}" for p in RANK if p != "sandbox"),
     "the sandbox stands alone"),
    (("astraflow.models", "astraflow.roles"),
     ("astraflow.dataflow", "astraflow.raas", "astraflow.trainer", "astraflow.config",
      "astraflow.launch"),
     "models and role formats are local: no rollout or training service"),
    (("astraflow.raas.workflows",),
     ("astraflow.kafka", "astraflow.dataflow", "astraflow.trainer", "astraflow.weights",
      "astraflow.raas.node"),
     "a workflow turns a task into trajectories with engines; it knows no transport"),
    (("astraflow.trainer.loss", "astraflow.trainer.trainer"),
     ("astraflow.kafka", "astraflow.dataflow", "astraflow.raas", "astraflow.weights",
      "astraflow.config"),
     "the training step is pure torch; the service around it talks to Kafka"),
]


# What a package of FORBIDDEN may still import from a package forbidden to it:
# (its modules, the one module, why)
EXCEPTIONS: list[tuple[tuple[str, ...], str, str]] = [
    (("astraflow.models",), "astraflow.config.lora",
     "a LoRA adapter's settings are declared once (torch-free, no topology): models rebuild "
     "them from a manifest's meta"),
]


def _excepted(importer: str, imported: str) -> bool:
    return any(_within(importer, modules) and imported == module
               for modules, module, _ in EXCEPTIONS)


@pytest.mark.parametrize("modules,forbidden,why", FORBIDDEN,
                         ids=[",".join(m) for m, _, _ in FORBIDDEN])
def test_forbidden_imports(modules, forbidden, why):
    broken = sorted(
        f"{m.name} imports {x}"
        for m in MODULES.values() if _within(m.name, modules)
        for x in m.anywhere if _within(x, forbidden) and not _excepted(m.name, x)
    )
    assert not broken, f"{why}:\n" + "\n".join(broken)


def test_the_light_modules_import_without_torch():
    """What the command line, the processors and the wire format load at import time does
    not pull in torch (or transformers): they start fast and run without a GPU stack."""
    code = (
        "import sys\n"
        "import astraflow.wire.codec, astraflow.dataflow, astraflow.kafka.loop\n"
        "import astraflow.tasks, astraflow.config.topology, astraflow.metrics\n"
        "import astraflow.cli.model, astraflow.cli.model_role\n"
        "from astraflow.cli.main import build_parser\n"
        "build_parser()\n"
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, check=True)
    assert out.stdout.strip() == "[]"
