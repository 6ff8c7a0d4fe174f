"""The command line is the top of the stack: no module of the package outside
``astraflow/cli`` and no bench imports ``astraflow.cli`` (counting imports inside
functions and ``importlib.import_module`` of a literal name). Start-up, engines and model
recipes live in their packages; a bench that wants a command runs it as a user would
(``python -m astraflow.cli.main ...`` as a subprocess)."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CLI = "astraflow.cli"


def _is_cli(name: str) -> bool:
    return name == CLI or name.startswith(CLI + ".")


def _package_of(path: Path) -> str:
    """The dotted package a file's relative imports start from ("" outside the package)."""
    rel = path.relative_to(REPO)
    if rel.parts[0] != "astraflow":
        return ""
    parts = list(rel.with_suffix("").parts)
    return ".".join(parts[:-1])


def cli_imports(source: str, package: str = "") -> Iterator[str]:
    """Each import of ``astraflow.cli`` (or a module under it) in ``source``, wherever it
    is: ``import``, ``from ... import`` (relative ones resolved from ``package``),
    ``from astraflow import cli`` and ``importlib.import_module("astraflow.cli...")`` /
    ``__import__`` of a literal name."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from (a.name for a in node.names if _is_cli(a.name))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".") if package else []
                parts = parts[: len(parts) - node.level + 1]
                base = ".".join([*parts, *([node.module] if node.module else [])])
            for a in node.names:
                name = f"{base}.{a.name}" if base else a.name
                if _is_cli(base) or _is_cli(name):
                    yield name
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            arg = node.args[0]
            if (called in ("import_module", "__import__") and isinstance(arg, ast.Constant)
                    and isinstance(arg.value, str) and _is_cli(arg.value)):
                yield arg.value


def _files() -> list[Path]:
    package = [p for p in (REPO / "astraflow").rglob("*.py")
               if not p.relative_to(REPO / "astraflow").parts[0] == "cli"]
    return sorted([*package, *(REPO / "bench").rglob("*.py")])


def test_nothing_outside_the_cli_imports_the_cli():
    found = sorted(f"{path.relative_to(REPO)} imports {name}"
                   for path in _files()
                   for name in cli_imports(path.read_text(), _package_of(path)))
    assert not found, "only astraflow/cli may import astraflow.cli:\n" + "\n".join(found)


def test_the_check_finds_every_form_of_import_and_spares_a_subprocess():
    source = '''
import astraflow.cli.main
from astraflow.cli.components import configuration
from astraflow import cli
from astraflow import config

def bench():
    from astraflow.cli import raas
    from ..cli.up import up_options
    importlib.import_module("astraflow.cli.model")
    subprocess.run([sys.executable, "-m", "astraflow.cli.main", "up"])
'''
    assert list(cli_imports(source, "astraflow.launch")) == [
        "astraflow.cli.main", "astraflow.cli.components.configuration", "astraflow.cli",
        "astraflow.cli.raas", "astraflow.cli.up.up_options", "astraflow.cli.model"]
    assert list(cli_imports("import astraflow.client\nfrom astraflow.clients import x\n")) == []
    assert len(_files()) > 100 and not any("astraflow/cli/" in str(p) for p in _files())
