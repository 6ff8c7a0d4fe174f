"""Runs on a cluster: which there are, what each holds, deleting one, a fresh start that
keeps the older run's topics."""

from __future__ import annotations

import json

import pytest

from astraflow.cli.main import main
from astraflow.config.topology import parse_topology
from astraflow.kafka.clients import RecordProducer
from astraflow.launch.plan import metrics_ports
from astraflow.launch.runs import (
    RunNotFound,
    Runs,
    RunSummary,
    TopicSummary,
    format_runs,
    human_bytes,
    next_run_id,
    run_names,
    topics_of,
)
from astraflow.launch.up import fresh_run
from astraflow.wire.records import Task, WeightManifest


# --- plain logic ----------------------------------------------------------------------------
def test_runs_are_the_prefixes_with_a_status_and_a_dlq_topic():
    topics = ["a.status", "a.dlq", "a.tasks", "b.status", "c.dlq", "c.tasks", "x-2.status",
              "x-2.dlq", "__consumer_offsets"]
    assert run_names(topics) == ["a", "x-2"]  # b lacks dlq, c lacks status


def test_a_runs_topics_leave_out_those_of_a_longer_run_name():
    topics = ["a.status", "a.dlq", "a.tasks", "a.b.status", "a.b.dlq", "a.b.tasks", "ab.tasks"]
    runs = run_names(topics)
    assert topics_of("a", topics, runs) == ["a.dlq", "a.status", "a.tasks"]
    assert topics_of("a.b", topics, runs) == ["a.b.dlq", "a.b.status", "a.b.tasks"]


def test_a_fresh_run_takes_the_first_free_name():
    assert next_run_id("default", []) == "default"
    assert next_run_id("default", ["default"]) == "default-2"
    assert next_run_id("default", ["default", "default-2", "default-3"]) == "default-4"


def test_run_summary_totals_and_table():
    s = RunSummary("r", [TopicSummary("r.tasks", 3, 10, 2048, 1000, 5000),
                         TopicSummary("r.dlq", 1, 0, None, None, None)], {"actor": 7})
    assert s.records == 10 and s.bytes is None  # one size unknown: the total is too
    assert (s.first_ms, s.last_ms) == (1000, 5000)
    table = format_runs([s])
    assert "actor v7" in table and "r " in table.splitlines()[1]
    assert human_bytes(None) == "?" and human_bytes(3 * 1024 * 1024) == "3.0 MiB"


def test_up_serves_each_process_metrics_on_the_next_port():
    base = {"run": "m", "topics": {"tasks.source": {}, "tasks": {}},
            "processors": {"a": {"kind": "passthrough", "inputs": ["tasks.source"],
                                 "outputs": ["tasks"]},
                           "b": {"kind": "passthrough", "inputs": ["tasks"], "outputs": []}}}
    assert metrics_ports(parse_topology(base)) == {}
    ports = metrics_ports(parse_topology({**base, "metrics_port": 9400}))
    assert ports == {"processor-a": 9400, "processor-b": 9401}


# --- on the broker ----------------------------------------------------------------------------
def manifest(version: int) -> WeightManifest:
    return WeightManifest(policy="actor", version=version, base_version=None, kind="full",
                          dtype="float32", tensors=[], blobs=[], num_params=0, num_changed=0,
                          sparsity=0.0, encoded_bytes=0, trainer_step=version)


def test_run_list_shows_records_time_span_and_versions_and_delete_removes_the_run(
        kafka_config, make_topology, capsys):
    topo, _ = make_topology(topics={"tasks": {}, "weights.actor": {"partitions": 1}})
    producer = RecordProducer(kafka_config)
    for i in range(5):
        producer.produce(topo.full_name("tasks"), Task(task_id=f"t{i}", prompt_id="p",
                                                       workflow="w", payload="{}", source="s"),
                         key=f"{i}")
    for v in (1, 2, 3):
        producer.produce(topo.full_name("weights.actor"), manifest(v), key="actor")
    producer.flush()

    summary = Runs(kafka_config).summary(topo.run)
    by_name = {t.name: t for t in summary.topics}
    assert set(by_name) == {t.full_name for t in topo.resolved_topics()}
    assert by_name[topo.full_name("tasks")].records == 5
    assert summary.versions == {"actor": 3}
    assert summary.first_ms is not None and summary.last_ms >= summary.first_ms

    assert main(["run", "list", "--json", "--bootstrap", kafka_config.bootstrap_servers]) == 0
    listed = {r["run"]: r for r in json.loads(capsys.readouterr().out)["runs"]}
    assert listed[topo.run]["versions"] == {"actor": 3}
    assert listed[topo.run]["records"] >= 8

    assert main(["run", "delete", topo.run, "--yes",
                 "--bootstrap", kafka_config.bootstrap_servers]) == 0
    assert topo.run not in Runs(kafka_config).names()
    with pytest.raises(RunNotFound, match=topo.run):
        Runs(kafka_config).summary(topo.run)
    # one clear line, exit 2, for a run that is not there
    assert main(["run", "delete", topo.run, "--yes",
                 "--bootstrap", kafka_config.bootstrap_servers]) == 2
    assert f"no run {topo.run!r}" in capsys.readouterr().err


def test_a_fresh_start_of_a_run_with_topics_is_a_new_run_and_the_old_topics_stay(
        kafka_config, make_topology, tmp_path):
    topo, _ = make_topology(topics={"tasks": {}})
    fresh = fresh_run(topo, kafka_config, tmp_path)
    assert fresh.run == f"{topo.run}-2"
    assert fresh.full_name("tasks") == f"{topo.run}-2.tasks"
    assert (tmp_path / topo.run / "latest-run").read_text().strip() == fresh.run
    assert topo.run in Runs(kafka_config).names()  # nothing was deleted
    unused = topo.model_copy(update={"run": topo.run + "-unused"})
    assert fresh_run(unused, kafka_config, tmp_path).run == unused.run  # no topics: same name
