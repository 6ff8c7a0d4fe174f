"""The `astraflow` command against a real broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from astraflow.kafka.clients import RecordProducer
from astraflow.wire.records import Task

REPO = Path(__file__).resolve().parents[3]


def run_cli(*args: str, env: dict | None = None, timeout: float = 120):
    return subprocess.run([sys.executable, "-m", "astraflow.cli.main", *args], capture_output=True,
                          text=True, env=env, cwd=REPO, timeout=timeout)


def test_topics_apply_list_describe_and_lag(kafka_bootstrap, kafka_config, make_topology,
                                            tmp_path):
    topo, path = make_topology(topics={"tasks.source": {"partitions": 2}, "tasks": {}},
                               processors={"fwd": {"kind": "passthrough",
                                                   "inputs": ["tasks.source"],
                                                   "outputs": ["tasks"]}})
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap}
    applied = run_cli("topics", "apply", "--topology", str(path), env=env)
    assert applied.returncode == 0, applied.stderr
    assert f"unchanged  {topo.run}.tasks" in applied.stdout  # make_topology applied it already
    # --run: the same file as a second run, its topics under another prefix
    other = f"{topo.run}-b"
    applied = run_cli("topics", "apply", "-t", str(path), "--run", other, env=env)
    assert applied.returncode == 0, applied.stderr
    assert f"created    {other}.tasks.source" in applied.stdout, applied.stdout
    listed = run_cli("topics", "list", "--run", other, env=env)
    assert f"{other}.tasks.source  (2 partitions)" in listed.stdout, listed.stdout
    assert f"{topo.run}.tasks " not in listed.stdout

    listed = run_cli("topics", "list", "--topology", str(path), env=env)
    assert listed.returncode == 0, listed.stderr
    assert f"{topo.run}.tasks.source  (2 partitions)" in listed.stdout
    assert f"{topo.run}.dlq" in listed.stdout

    described = run_cli("topics", "describe", "tasks", "--topology", str(path), env=env)
    assert described.returncode == 0, described.stderr
    assert '"max.message.bytes": "8388608"' in described.stdout

    producer = RecordProducer(kafka_config)
    for i in range(7):
        producer.produce(topo.full_name("tasks.source"),
                         Task(task_id=f"t{i}", prompt_id="p", workflow="w", payload="{}",
                              source="s"), partition=i % 2)
    producer.flush()
    shown = run_cli("groups", "lag", "--topology", str(path), env=env)
    assert shown.returncode == 0, shown.stderr
    lines = shown.stdout.strip().splitlines()
    assert lines[0].split() == ["GROUP", "TOPIC", "PARTITION", "END", "OFFSET", "COMMITTED",
                                "LAG"]
    rows = [line.split() for line in lines[1:]]
    assert [(r[2], r[3], r[4], r[5]) for r in rows] == [("0", "4", "-", "4"), ("1", "3", "-", "3")]
    old = run_cli("lag", "-t", str(path), env=env)  # the older spelling still works
    assert old.returncode == 0 and old.stdout == shown.stdout, old.stderr


def test_bad_topology_fails_at_start_with_key(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: x\ntopics: {tasks: {partitions: zero}}\n")
    for spelling in (["topics", "apply", str(bad)], ["topics", "apply", "-t", str(bad)]):
        res = run_cli(*spelling)
        assert res.returncode == 2
        assert f"{bad}: topics.tasks.partitions" in res.stderr



def test_a_component_works_on_the_run_of_its_run_flag(kafka_bootstrap, kafka_config,
                                                     make_topology):
    """`feeder run --run NAME` feeds NAME.tasks.source, not the file's run."""
    from astraflow.kafka.clients import read_all

    topo, path = make_topology(topics={"tasks.source": {}, "tasks": {}})
    other = f"{topo.run}-b"
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap}
    assert run_cli("topics", "apply", "-t", str(path), "--run", other, env=env).returncode == 0
    fed = run_cli("feeder", "run", "-t", str(path), "--run", other, "--count", "3", env=env)
    assert fed.returncode == 0, fed.stderr
    assert f'"topic": "{other}.tasks.source"' in fed.stdout, fed.stdout
    tasks = read_all(kafka_config, f"{other}.tasks.source", idle_s=1.0, expect=Task)
    assert len(tasks) == 3
    assert not read_all(kafka_config, topo.full_name("tasks.source"), idle_s=1.0, expect=Task)

@pytest.mark.kafka  # starts its own embedded broker (not the session's)
@pytest.mark.slow
def test_broker_start_status_logs_stop(tmp_path):
    from astraflow.broker.embedded import free_port

    env = {k: v for k, v in os.environ.items() if k != "ASTRAFLOW_BOOTSTRAP"}
    env["ASTRAFLOW_STATE"] = str(tmp_path / "state")
    res = run_cli("broker", "status", env=env)
    assert res.returncode == 3 and "stopped" in res.stdout
    port = str(free_port())
    try:
        res = run_cli("broker", "start", "--port", port, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        assert f"bootstrap 127.0.0.1:{port}" in res.stdout
        res = run_cli("broker", "start", env=env)
        assert "already running" in res.stdout
        res = run_cli("broker", "status", env=env)
        assert res.returncode == 0 and "running" in res.stdout
        assert "Kafka Server started" in run_cli("broker", "logs", env=env).stdout
        # commands without ASTRAFLOW_BOOTSTRAP find the embedded broker by themselves
        res = run_cli("topics", "list", env=env)
        assert res.returncode == 0, res.stderr
    finally:
        res = run_cli("broker", "stop", "--purge", env=env)
    assert res.returncode == 0 and "stopped" in res.stdout
    assert run_cli("broker", "status", env=env).returncode == 3


def test_unknown_processor_missing_topics_and_model_are_one_line_errors(
        kafka_bootstrap, make_topology, tmp_path):
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap}

    def one_line(res, text: str) -> None:
        assert res.returncode == 2, res.stderr
        assert text in res.stderr and "Traceback" not in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1, res.stderr

    one_line(run_cli("processor", "run", "nope", "--topology", "topology/default.yaml", env=env),
             "no processor named 'nope'")
    trainer = ["trainer", "run", "--policy", "actor", "--state-dir", str(tmp_path / "state")]
    missing = tmp_path / "no-model"
    model = tmp_path / "model"  # looks like a model: the topics are checked next
    model.mkdir()
    (model / "config.json").write_text("{}")
    one_line(run_cli(*trainer, "-t", "topology/default.yaml", "--model", str(model), env=env),
             "topics missing on")
    _, path = make_topology(topics={"batches.actor": {}, "weights.actor": {}, "status": {},
                                    "dlq": {}})
    res = run_cli(*trainer, "-t", str(path), "--model", str(missing), env=env)
    one_line(res, f"{missing}: no such model directory")
    assert "Repo id" not in res.stderr
    # --debug shows the traceback
    res = run_cli("--debug", "processor", "run", "nope", "--topology", "topology/default.yaml",
                  env=env)
    assert res.returncode != 0 and "Traceback" in res.stderr


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
