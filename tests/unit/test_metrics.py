"""Metric sinks: each step's slash-named figures, to a file or to the status topic."""

from __future__ import annotations

import json

from astraflow.metrics import JsonlSink, MetricSink, StatusSink
from astraflow.wire.records import ComponentStatus


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


def scrape(port: int) -> str:
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def test_prometheus_exporter_serves_counters_versions_lag_staleness_and_metrics():
    from astraflow.kafka.loop import RuntimeCounters
    from astraflow.metrics import PrometheusExporter, observe_staleness

    counters = RuntimeCounters(consumed=12, produced=10, dead_lettered=2, busy_s=1.5)
    exporter = PrometheusExporter("stale/a", "component", counters, port=0, addr="127.0.0.1")
    try:
        exporter.update(ComponentStatus(component_id="stale/a", kind="processor", host="h",
                                        weight_versions={"actor": 5},
                                        metrics={"staleness/dropped": 3.0}),
                        {("run.trajectories", 0): 4, ("run.trajectories", 1): 0})
        for v in (0, 1, 1, 7):
            observe_staleness(v)
        text = scrape(exporter.port)
    finally:
        exporter.close()
    me = 'component="stale/a",kind="processor"'
    assert f"astraflow_records_in_total{{{me}}} 12.0" in text
    assert f"astraflow_dead_lettered_total{{{me}}} 2.0" in text
    assert f'astraflow_weight_version{{{me},policy="actor"}} 5.0' in text
    assert f'astraflow_consumer_lag{{{me},partition="0",topic="run.trajectories"}} 4.0' in text
    assert f'astraflow_staleness_bucket{{{me},le="1"}} 3.0' in text  # 0, 1, 1
    assert f'astraflow_staleness_bucket{{{me},le="+Inf"}} 4.0' in text
    assert f"astraflow_staleness_dropped{{{me}}} 3.0" in text
    assert f'astraflow_stale_dropped_groups_total{{{me},stage="filter"}} 3.0' in text
    observe_staleness(2)  # a closed exporter is no longer fed (nor failing)


def test_metrics_port_comes_from_the_environment_and_a_bad_one_is_named():
    import pytest

    from astraflow.errors import AstraflowError
    from astraflow.metrics import METRICS_PORT_ENV, exporter_from_env

    assert exporter_from_env("c", "k", None, env={}.get) is None
    with pytest.raises(AstraflowError, match=f"{METRICS_PORT_ENV}='nine'"):
        exporter_from_env("c", "k", None, env={METRICS_PORT_ENV: "nine"}.get)


def test_tensorboard_sink_writes_event_files_tensorboard_reads():
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from astraflow.metrics import TensorBoardSink, crc32c

    assert crc32c(b"123456789") == 0xE3069283  # the CRC-32C check value
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        sink = TensorBoardSink(d)
        sink.emit(1, {"trainer/loss": 0.5, "trainer/reward_mean": 0.25})
        sink.emit(2, {"trainer/loss": 0.25, "eval/accuracy": float("nan")})
        acc = EventAccumulator(d)
        acc.Reload()
        assert sorted(acc.Tags()["scalars"]) == ["trainer/loss", "trainer/reward_mean"]
        loss = [(e.step, e.value) for e in acc.Scalars("trainer/loss")]
        assert loss == [(1, 0.5), (2, 0.25)]


def test_up_writes_each_components_status_as_a_tensorboard_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from astraflow.launch.progress import StatusSeries

    series = StatusSeries(tmp_path, "r", started=0.0)
    for v in (3, 4):
        series.add(ComponentStatus(component_id="trainer.actor/0", kind="trainer", host="h",
                                   policy="actor", weight_versions={"actor": v}, consumed=v,
                                   metrics={"trainer/loss": 1.0 / v}))
    acc = EventAccumulator(str(tmp_path / "trainer.actor_0"))
    acc.Reload()
    assert [(e.step, e.value) for e in acc.Scalars("records/in")] == [(3, 3.0), (4, 4.0)]
    assert [e.step for e in acc.Scalars("trainer/loss")] == [3, 4]
