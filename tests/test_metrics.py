"""Metric sinks: each step's slash-named figures, to a file or to the status topic."""

from __future__ import annotations

import json

from astraflow.metrics import JsonlSink, MetricSink, StatusSink
from astraflow.records import ComponentStatus


class _Producer:
    def __init__(self):
        self.sent: list[tuple[str, object, str]] = []
        self.flushed = 0

    def produce(self, topic, value, key=None):
        self.sent.append((topic, value, key))

    def flush(self):
        self.flushed += 1


def test_jsonl_sink_appends_one_line_per_step(tmp_path):
    sink: MetricSink = JsonlSink(tmp_path / "m.jsonl")
    sink.emit(1, {"rollout/reward_mean": 0.5})
    sink.emit(2, {"rollout/reward_mean": 1})
    lines = [json.loads(x) for x in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [1, 2]
    assert lines[1]["metrics"] == {"rollout/reward_mean": 1.0}


def test_status_sink_publishes_a_component_status():
    producer = _Producer()
    sink: MetricSink = StatusSink(producer, "run.status", "eval-actor/h", "evaluator", "actor")
    sink.emit(7, {"eval/accuracy": 0.25})
    ((topic, status, key),) = producer.sent
    assert topic == "run.status" and key == "eval-actor/h" and producer.flushed == 1
    assert isinstance(status, ComponentStatus) and status.kind == "evaluator"
    assert status.weight_versions == {"actor": 7} and status.metrics == {"eval/accuracy": 0.25}
