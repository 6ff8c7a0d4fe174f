"""Runs on a real broker: what each holds (records, time span, versions), deleting one, a fresh
start that keeps the older run's topics (the run logic without a broker:
tests/unit/launch/test_run_names.py)."""

from __future__ import annotations

import json

import pytest

from astraflow.cli.main import main
from astraflow.kafka.clients import RecordProducer
from astraflow.launch.runs import RunNotFound, Runs
from astraflow.launch.up import fresh_run
from astraflow.wire.records import Task, WeightManifest


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
