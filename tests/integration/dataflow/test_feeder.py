"""The task feeder on the test broker: what it writes reads back, `feeder run`, and a restart that
resumes where the topic ends."""

from __future__ import annotations

import json

import pytest

from astraflow.dataflow.feeder import TaskFeeder, iter_tasks, load_payloads
from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.wire.records import Task
from tests.conftest import wait_for


def _read_until(config, topic: str, n: int, timeout: float = 30.0) -> list:
    """Read the topic until it holds ``n`` records (a fresh broker can be slow to serve)."""

    def enough() -> list | None:
        got = read_all(config, topic, expect=Task, idle_s=2.0, timeout_s=timeout)
        return got if len(got) >= n else None

    return wait_for(enough, timeout, f"{n} tasks on {topic}", step=0.5)


@pytest.mark.kafka
def test_feeder_writes_tasks_that_read_back(kafka_config, make_topology):
    topo, _path = make_topology(topics={"tasks.source": {"partitions": 2}})
    topic = topo.full_name("tasks.source")
    payloads = load_payloads(levels="1,2", size=15)
    producer = RecordProducer(kafka_config)
    feeder = TaskFeeder(producer, topic, iter_tasks(payloads, epochs=2, run=topo.run), count=24)
    st = feeder.run()
    assert st.produced == 24
    got = _read_until(kafka_config, topic, 24)
    assert len(got) == 24
    assert all(r.key.decode() == r.record.prompt_id for r in got)
    assert len({r.record.task_id for r in got}) == 24
    by_prompt = {p["prompt_id"]: p for p in payloads}
    for r in got:
        payload = json.loads(r.record.payload)
        assert by_prompt[r.record.prompt_id]["answer"] == payload["answer"]


@pytest.mark.kafka
def test_feeder_cli_run(kafka_config, make_topology, capsys):
    from astraflow.cli.main import main

    topo, path = make_topology(topics={"tasks.source": {}})
    rc = main(["feeder", "run", "--topology", str(path), "--count", "7", "--levels", "2"])
    assert rc == 0
    assert '"produced": 7' in capsys.readouterr().out
    got = _read_until(kafka_config, topo.full_name("tasks.source"), 7)
    assert len(got) == 7 and {r.record.source for r in got} == {"arith-L2"}
    assert main(["feeder", "run", "--topology", str(path), "--dataset", "/nope.jsonl"]) == 2


@pytest.mark.kafka
def test_feeder_restart_resumes_without_feeding_a_task_twice(kafka_config, make_topology,
                                                             capsys):
    from astraflow.cli.main import main

    topo, path = make_topology(topics={"tasks.source": {}})
    args = ["feeder", "run", "--topology", str(path), "--levels", "2"]
    assert main([*args, "--count", "5"]) == 0
    assert main([*args, "--count", "8"]) == 0  # the same command, run on: 3 more
    out = capsys.readouterr().out
    assert "resuming: 5 tasks already on" in out and '"produced": 3' in out
    got = _read_until(kafka_config, topo.full_name("tasks.source"), 8)
    ids = [r.record.task_id for r in got]
    assert len(ids) == 8 and len(set(ids)) == 8
    assert main([*args, "--count", "2", "--from-start"]) == 0
    got = _read_until(kafka_config, topo.full_name("tasks.source"), 10)
    assert len(got) == 10 and {r.record.task_id for r in got} == set(ids)

