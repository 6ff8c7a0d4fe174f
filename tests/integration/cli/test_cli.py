"""The `astraflow` command against a real broker: the session's, or one it starts itself."""

from __future__ import annotations

import os

import pytest

from astraflow.kafka.clients import RecordProducer
from astraflow.wire.records import Task
from tests.unit.cli.test_cli import run_cli


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

