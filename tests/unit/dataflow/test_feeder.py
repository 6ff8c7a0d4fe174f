"""The task feeder without a broker: task order and ids per epoch, count, rate and pause, the
resume that skips the tasks already fed (on the broker:
tests/integration/dataflow/test_feeder.py)."""

from __future__ import annotations

import threading

from astraflow.dataflow.feeder import TaskFeeder, iter_tasks, load_payloads
from astraflow.wire.records import Task


def test_iter_tasks_epochs_and_ids():
    payloads = load_payloads(levels="1,2", size=20)
    items = list(iter_tasks(payloads, epochs=2, seed=5, run="r"))
    assert len(items) == 40
    assert [e for e, _ in items] == [0] * 20 + [1] * 20
    first = [t.prompt_id for _, t in items[:20]]
    second = [t.prompt_id for _, t in items[20:]]
    assert sorted(first) == sorted(second) and first != second  # reshuffled per epoch
    assert len({t.task_id for _, t in items}) == 40
    assert all(t.task_id.startswith("r.") for _, t in items)


class _ListProducer:
    def __init__(self):
        self.sent: list[tuple[str, Task, str]] = []
        self.flushes = 0

    def produce(self, topic, record, key=None):
        self.sent.append((topic, record, key))

    def flush(self, timeout=60.0):
        self.flushes += 1


def test_feeder_count_rate_and_pause_without_kafka():
    payloads = load_payloads(levels="1", size=10)
    prod = _ListProducer()
    paused = {"n": 0}

    def should_pause():
        paused["n"] += 1
        return paused["n"] <= 2  # pause twice before the first task, then never

    feeder = TaskFeeder(
        prod,
        "t",
        iter_tasks(payloads, epochs=None),
        count=25,
        rate=500.0,
        should_pause=should_pause,
        pause_poll_s=0.01,
    )
    st = feeder.run()
    assert st.produced == 25 and len(prod.sent) == 25 and prod.flushes >= 1
    assert st.paused_s > 0 and st.epochs_done == 2
    assert all(key == rec.prompt_id for _, rec, key in prod.sent)

    stop = threading.Event()
    stop.set()
    assert TaskFeeder(prod, "t", iter_tasks(payloads)).run(stop).produced == 0


def test_resume_tasks_skips_fed_ids_and_counts_them():
    from astraflow.dataflow.feeder import resume_tasks

    items = list(iter_tasks([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(6)],
                            shuffle=False))
    fed = {items[0][1].task_id, items[2][1].task_id}
    assert [t.task_id for _, t in resume_tasks(iter(items), fed, 4)] == \
        [items[1][1].task_id, items[3][1].task_id]
    assert len(list(resume_tasks(iter(items), set(), None))) == 6

