"""Runs without a broker: which topic prefixes are runs, a run's topics, the first free run name,
the summary table, each process's metrics port (on a real broker:
tests/integration/launch/test_runs.py)."""

from __future__ import annotations

from astraflow.config.topology import parse_topology
from astraflow.launch.plan import metrics_ports
from astraflow.launch.runs import (
    RunSummary,
    TopicSummary,
    format_runs,
    human_bytes,
    next_run_id,
    run_names,
    topics_of,
)


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

