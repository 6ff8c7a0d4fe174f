"""The `astraflow` command without a broker: parsing, help, one-line errors (against a broker:
tests/integration/cli/test_cli.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)


def test_bad_topology_fails_at_start_with_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: x\ntopics: {tasks: {partitions: zero}}\n")
    for spelling in (["topics", "apply", str(bad)], ["topics", "apply", "-t", str(bad)]):
        res = run_cli(*spelling)
        assert res.returncode == 2
        assert f"{bad}: topics.tasks.partitions" in res.stderr


# --- the command tree (no broker) ---------------------------------------------------------
def _tree():
    from astraflow.cli.args import walk
    from astraflow.cli.main import build_parser

    return walk(build_parser())


def _options(parser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def test_every_command_has_a_description_and_an_example():
    """Each noun and verb's --help says what it does and shows how: an `examples:` block
    with a command line of that very command."""
    from astraflow.cli.args import EXAMPLES_HEADING

    lacking = []
    tree = _tree()
    assert len(tree) > 30
    for path, parser, hidden in tree:
        name = " ".join(["astraflow", *path])
        parser.format_help()  # a stray % in a help text fails here, not at a user's --help
        epilog = parser.epilog or ""
        examples = [line.strip() for line in epilog.splitlines()[1:]]
        if not (parser.description or "").strip():
            lacking.append(f"{name}: no description")
        if not epilog.startswith(EXAMPLES_HEADING) or not examples:
            lacking.append(f"{name}: no examples")
        elif not hidden and not any(e == name or e.startswith(f"{name} ") for e in examples):
            lacking.append(f"{name}: no example of `{name}`")
    assert not lacking, "\n".join(lacking)


def test_commands_on_a_run_take_the_same_flags():
    """Whatever takes a topology takes it as --topology/-t, with --run beside it; the
    components take --bootstrap too."""
    leaves = {" ".join(path): p for path, p, _ in _tree() if p.get_default("func")}
    on_run = [name for name, p in leaves.items() if "--topology" in _options(p)]
    for name in ("topics apply", "groups lag", "processor run", "trainer run", "raas run",
                 "feeder run", "eval run", "run up", "run down", "up"):
        assert name in on_run, name
    for name in on_run:
        assert {"-t", "--run"} <= _options(leaves[name]), name
    for name in ("trainer run", "raas run", "feeder run", "eval run", "processor run",
                 "topics apply", "topics list", "groups lag", "run up"):
        assert "--bootstrap" in _options(leaves[name]), name


def test_old_spellings_parse_as_the_new_ones():
    from astraflow.cli.main import build_parser

    parser = build_parser()
    same = [
        (["topics", "apply", "x.yaml"], ["topics", "apply", "--topology", "x.yaml"]),
        (["up", "x.yaml", "--duration", "5"], ["run", "up", "-t", "x.yaml", "--duration", "5"]),
        (["down", "x.yaml"], ["run", "down", "-t", "x.yaml"]),
        (["lag", "-t", "x.yaml"], ["groups", "lag", "-t", "x.yaml"]),
    ]
    for old, new in same:
        a, b = parser.parse_args(old), parser.parse_args(new)
        assert (a.func, a.topology) == (b.func, b.topology) == (b.func, "x.yaml"), old
    assert parser.parse_args(["up", "-t", "x.yaml"]).topology == "x.yaml"


def test_run_overrides_the_topology_run_name(monkeypatch):
    from astraflow.cli.context import load_run_topology
    from astraflow.cli.main import build_parser
    from astraflow.config.topology import TopologyError, load_topology, with_overrides

    topo = load_topology(REPO / "topology" / "default.yaml")
    other = with_overrides(topo, run="trial2", bootstrap="h:9092")
    assert other.full_name("tasks") == "trial2.tasks"
    assert other.group_of("batcher") == "trial2.batcher"
    assert other.kafka.bootstrap_servers == "h:9092"
    assert (topo.run, topo.kafka.bootstrap_servers) == ("default", None)  # not changed
    assert other.resolved_topics()[0].full_name.startswith("trial2.")
    with pytest.raises(TopologyError, match="--run 'a.b'"):
        with_overrides(topo, run="a.b")

    parser = build_parser()
    args = parser.parse_args(["processor", "run", "batcher", "-t", "topology/default.yaml"])
    assert load_run_topology(args).run == "default"
    monkeypatch.setenv("ASTRAFLOW_RUN", "from-env")
    assert load_run_topology(args).run == "from-env"
    args = parser.parse_args(["processor", "run", "batcher", "-t", "topology/default.yaml",
                              "--run", "flag"])
    assert load_run_topology(args).run == "flag"  # the flag wins over the environment


def test_run_is_exported_to_the_processes_a_command_starts(monkeypatch):
    """`up --run NAME` starts its components with ASTRAFLOW_RUN=NAME (they take the same
    topology file), and leaves the environment as it was."""
    import os

    from astraflow.cli import main as cli

    seen = {}

    def fake(args):
        seen["run"], seen["env"] = args.loaded_topology.run, os.environ.get("ASTRAFLOW_RUN")
        return 0

    monkeypatch.delenv("ASTRAFLOW_RUN", raising=False)
    monkeypatch.setattr("astraflow.cli.up.cmd_down", fake)
    assert cli.main(["run", "down", "-t", "topology/default.yaml", "--run", "trial2"]) == 0
    assert seen == {"run": "trial2", "env": "trial2"}
    assert "ASTRAFLOW_RUN" not in os.environ


def test_usage_mistakes_are_one_line_errors():
    """No broker involved: these fail before any Kafka client starts."""
    for argv, text in [
        (["topics", "apply"], "astraflow: topics apply: give the topology: --topology FILE"),
        (["run", "up"], "astraflow: run up: give the topology: --topology FILE"),
        (["groups", "lag"], "astraflow: groups lag: give --topology FILE, or --group G"),
        (["topics", "apply", "-t", "topology/default.yaml", "--run", "a/b"], "--run 'a/b'"),
        (["topics", "apply", "-t", "no-such.yaml"], "no-such.yaml: cannot read topology file"),
    ]:
        res = run_cli(*argv, timeout=60)
        assert res.returncode == 2, (argv, res.stderr)
        assert text in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
