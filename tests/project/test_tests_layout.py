"""The tests are laid out by what they need and mirror the packages.

- ``tests/`` holds only the kinds of test: ``unit/`` (no broker), ``integration/`` (a real
  broker), ``e2e/`` (``astraflow up`` end to end), ``bench/`` (the bench scripts run small),
  ``project/`` (the repository's shape); none is named after a package.
- ``tests/unit/<x>/`` and ``tests/integration/<x>/`` test the package ``astraflow/<x>``
  (a top-level ``tests/unit/test_<m>.py`` the module ``astraflow/<m>.py``).
- No test under ``tests/unit/`` needs a broker: none requests ``kafka_bootstrap``,
  ``secure_broker`` or ``embedded_cluster``, directly or through other fixtures (those of
  ``tests/conftest.py``, of the conftest files on its path, of its own module and those it
  imports from other test modules), and none is marked ``kafka``.

Read with ``ast``: nothing is imported or collected (tests/project/test_markers.py checks the
``kafka`` marker on the collected suite).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path

from tests.conftest import BROKER_FIXTURE, CLUSTER_FIXTURE, SECURE_FIXTURE

REPO = Path(__file__).resolve().parents[2]
KINDS = {"unit", "integration", "e2e", "bench", "project"}
BROKER_FIXTURES = {BROKER_FIXTURE, SECURE_FIXTURE, CLUSTER_FIXTURE}


@dataclass
class Fixtures:
    """The fixtures a test module sees: name -> the fixtures it requests; and the autouse
    ones."""

    requests: dict[str, list[str]] = field(default_factory=dict)
    autouse: set[str] = field(default_factory=set)

    def update(self, other: Fixtures) -> None:
        self.requests.update(other.requests)
        self.autouse |= other.autouse

    def closure(self, names: list[str]) -> set[str]:
        """``names`` and every fixture they request, transitively."""
        seen: set[str] = set()
        todo = list(names)
        while todo:
            name = todo.pop()
            if name not in seen:
                seen.add(name)
                todo.extend(self.requests.get(name, ()))
        return seen


def _args(fn: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    a = fn.args
    return [x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs) if x.arg not in {"self", "cls"}]


def _is_fixture(fn: ast.AST) -> ast.expr | None:
    for d in getattr(fn, "decorator_list", ()):
        target = d.func if isinstance(d, ast.Call) else d
        if ast.unparse(target) in {"pytest.fixture", "fixture"}:
            return d
    return None


def _usefixtures(decorators: list[ast.expr]) -> list[str]:
    """The names in ``@pytest.mark.usefixtures("a", "b")`` decorators (or pytestmark)."""
    names = []
    for d in decorators:
        for call in ast.walk(d):
            if isinstance(call, ast.Call) and ast.unparse(call.func).endswith("usefixtures"):
                names += [a.value for a in call.args if isinstance(a, ast.Constant)]
    return names


def _marked_kafka(decorators: list[ast.expr]) -> bool:
    return any(ast.unparse(n) == "pytest.mark.kafka" for d in decorators for n in ast.walk(d))


def _module_path(module: str, root: Path) -> Path:
    return root / (module.replace(".", "/") + ".py")


def fixtures_defined(path: Path, root: Path, _seen: frozenset[Path] = frozenset()) -> Fixtures:
    """The fixtures ``path`` defines, and those it imports from other test modules
    (``from tests.x import fixture``, following re-exports)."""
    out = Fixtures()
    if path in _seen or not path.exists():
        return out
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.startswith("tests."):
            there = fixtures_defined(_module_path(node.module, root), root, _seen | {path})
            for alias in node.names:
                if alias.name in there.requests:
                    out.requests[alias.asname or alias.name] = there.requests[alias.name]
                    if alias.name in there.autouse:
                        out.autouse.add(alias.asname or alias.name)
    for node in tree.body:
        decorator = _is_fixture(node)
        if decorator is not None:
            out.requests[node.name] = _args(node) + _usefixtures(node.decorator_list)
            if isinstance(decorator, ast.Call) and any(
                    k.arg == "autouse" and ast.unparse(k.value) == "True"
                    for k in decorator.keywords):
                out.autouse.add(node.name)
    return out


def broker_tests(path: Path, root: Path = REPO) -> list[str]:
    """The tests of ``path`` that need a broker: ``name: why``."""
    seen = Fixtures()
    conftests = [d / "conftest.py" for d in reversed(path.parents) if root in (d, *d.parents)]
    for conftest in conftests:
        seen.update(fixtures_defined(conftest, root))
    seen.update(fixtures_defined(path, root))
    tree = ast.parse(path.read_text())
    module_marks: list[ast.expr] = [
        n.value for n in tree.body if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in n.targets)]
    tests: list[tuple[str, ast.FunctionDef | ast.AsyncFunctionDef, list[ast.expr]]] = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
                and node.name.startswith("test"):
            tests.append((node.name, node, []))
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            tests += [(f"{node.name}::{m.name}", m, node.decorator_list) for m in node.body
                      if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                      and m.name.startswith("test")]
    found = []
    for name, fn, outer in tests:
        decorators = [*module_marks, *outer, *fn.decorator_list]
        requested = [*_args(fn), *_usefixtures(decorators), *seen.autouse]
        broker = sorted(seen.closure(requested) & BROKER_FIXTURES)
        if broker:
            found.append(f"{name}: reaches {', '.join(broker)}")
        elif _marked_kafka(decorators):
            found.append(f"{name}: marked kafka")
    return found


def test_the_top_level_test_folders_are_kinds_of_test_not_packages():
    folders = {p.name for p in (REPO / "tests").iterdir()
               if p.is_dir() and not p.name.startswith((".", "__"))}
    assert sorted(folders - KINDS) == [], (
        "tests/ holds unit/ (no broker), integration/ (a broker), e2e/, bench/ and project/ "
        "only: move the other folders' files into tests/integration/<package>/ or "
        "tests/unit/<package>/")


def test_unit_and_integration_tests_are_laid_out_by_package():
    wrong = []
    for kind in ("unit", "integration"):
        base = REPO / "tests" / kind
        if not base.is_dir():
            continue
        for p in sorted(base.iterdir()):
            if p.name.startswith((".", "__")) or p.name == "conftest.py":
                continue
            if p.is_dir() and not (REPO / "astraflow" / p.name / "__init__.py").is_file():
                wrong.append(f"tests/{kind}/{p.name}/: no package astraflow/{p.name}")
            if p.is_dir() and not (p / "__init__.py").is_file():
                wrong.append(f"tests/{kind}/{p.name}/ has no __init__.py (module names clash)")
            if p.is_file() and p.suffix == ".py" and not (
                    p.name.startswith("test_")
                    and (REPO / "astraflow" / f"{p.name[5:]}").is_file()):
                wrong.append(f"tests/{kind}/{p.name}: no module astraflow/{p.name[5:]}")
    assert wrong == []


def test_no_unit_test_needs_a_broker():
    found = [f"{p.relative_to(REPO)}::{t}"
             for p in sorted((REPO / "tests" / "unit").rglob("test_*.py"))
             for t in broker_tests(p)]
    assert found == [], ("tests/unit is broker-free; these belong in "
                         "tests/integration/<package>/:\n" + "\n".join(found))


def test_the_broker_check_follows_fixtures_through_conftest_and_imports(tmp_path):
    """The check can fail: a broker reached through a conftest fixture, a fixture imported
    from another test module, ``usefixtures``, an autouse fixture, or the ``kafka`` mark;
    a fixture that only shares a name's prefix does not count."""
    root = tmp_path / "tests"
    (root / "unit" / "x").mkdir(parents=True)
    (root / "conftest.py").write_text(
        "import pytest\n"
        "@pytest.fixture\ndef kafka_bootstrap(): ...\n"
        "@pytest.fixture\ndef kafka_config(kafka_bootstrap): ...\n"
        "@pytest.fixture\ndef make_topology(kafka_config, tmp_path): ...\n")
    (root / "helpers.py").write_text(
        "import pytest\n@pytest.fixture\ndef engine(make_topology): ...\n")
    (root / "unit" / "x" / "conftest.py").write_text(
        "import pytest\n@pytest.fixture\ndef local(engine): ...\n"
        "from tests.helpers import engine\n")
    test = root / "unit" / "x" / "test_y.py"
    test.write_text(
        "import pytest\n"
        "from tests.helpers import engine\n"
        "def test_direct(kafka_bootstrap): ...\n"
        "def test_through_conftest(make_topology): ...\n"
        "def test_through_an_import(engine): ...\n"
        "def test_through_the_local_conftest(local): ...\n"
        "@pytest.mark.usefixtures('kafka_config')\ndef test_used(): ...\n"
        "@pytest.mark.kafka\ndef test_marked(tmp_path): ...\n"
        "class TestGroup:\n    def test_method(self, new_topic): ...\n"
        "@pytest.fixture\ndef new_topic(kafka_config): ...\n"
        "def test_free(tmp_path, kafka_bootstrap_free): ...\n")
    found = broker_tests(test, root=tmp_path)
    assert [f.split(":")[0] for f in found] == [
        "test_direct", "test_through_conftest", "test_through_an_import",
        "test_through_the_local_conftest", "test_used", "test_marked", "TestGroup"]
    (root / "unit" / "x" / "conftest.py").write_text(
        "import pytest\n@pytest.fixture(autouse=True)\ndef everywhere(kafka_config): ...\n")
    test.write_text("def test_free(tmp_path): ...\n")
    assert broker_tests(test, root=tmp_path) == ["test_free: reaches kafka_bootstrap"]
