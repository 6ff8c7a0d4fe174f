"""``astraflow.launch.audit`` finds what breaks exactly-once: a stage's output twice, an input its
group committed past that reached no output, a missing version; balanced books pass.

The run's topics are written by hand on the session broker (no ``up``): a few tasks on
``tasks.source`` and ``tasks``, the admission group's offsets committed past them.
"""

from __future__ import annotations

from confluent_kafka import Consumer, TopicPartition

from astraflow.kafka.clients import RecordProducer
from astraflow.launch.audit import audit_run
from astraflow.wire.records import Task

TOPICS = ["tasks.source", "tasks", "trajectories.raw", "trajectories", "samples.actor",
          "batches.actor", "weights.actor", "status", "dlq"]


def _task(task_id: str) -> Task:
    return Task(task_id=task_id, prompt_id=task_id, workflow="math", payload="1+1",
                source="test")


def _write(kafka_config, run: str, logical: str, ids: list[str]) -> None:
    p = RecordProducer(kafka_config)
    for i in ids:
        p.produce(f"{run}.{logical}", _task(i), partition=0)
    p.flush(30)


def _commit(kafka_config, group: str, topic: str, offset: int) -> None:
    c = Consumer(kafka_config.consumer_conf(group))
    try:
        c.commit(offsets=[TopicPartition(topic, 0, offset)], asynchronous=False)
    finally:
        c.close()


def test_the_books_balance_then_break_on_a_duplicate_and_a_lost_input(
        make_topology, kafka_config, tmp_path):
    topo, _ = make_topology({t: {"partitions": 1} for t in TOPICS})
    run = topo.run
    _write(kafka_config, run, "tasks.source", ["t1", "t2"])
    _write(kafka_config, run, "tasks", ["t1", "t2"])
    _commit(kafka_config, f"{run}.admission", f"{run}.tasks.source", 2)
    ok = audit_run(kafka_config, run, tmp_path)
    assert ok.ok, ok.problems
    assert ok.verdict() == "exactly once"
    assert ok.books["tasks"] == 2 and ok.books["versions"] == -1

    _write(kafka_config, run, "tasks.source", ["t3"])
    _write(kafka_config, run, "tasks", ["t2"])  # t2 admitted twice, t3 never
    _commit(kafka_config, f"{run}.admission", f"{run}.tasks.source", 3)
    broken = audit_run(kafka_config, run, tmp_path)
    assert not broken.ok
    assert any(p.startswith("admission: 1 outputs twice, e.g. ['t2']")
               for p in broken.problems), broken.problems
    assert "admission: 1 inputs lost, e.g. ['t3']" in broken.problems, broken.problems
    assert broken.verdict().startswith("BROKEN: admission: ")
    assert broken.verdict().endswith("(+1 more)"), broken.verdict()
