"""Watching a run: a component's Prometheus endpoint scraped over HTTP, and
``astraflow status --once --json`` against a running topology."""

from __future__ import annotations

import json
import re
import urllib.request

from astraflow.cli.main import main
from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.clients import RecordProducer
from astraflow.metrics import METRICS_PORT_ENV
from tests.conftest import running, wait_for
from tests.integration.dataflow.test_data_algorithms import group, manifest


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        return r.read().decode()


def scrape_until(port: int, needle: str, what: str) -> str:
    def has() -> str | None:
        text = scrape(port)
        return text if needle in text else None
    return wait_for(has, 60, what)


def stale_filter_topology(make_topology):
    return make_topology(
        topics={"trajectories.raw": {"partitions": 2}, "trajectories": {},
                "weights.actor": {"partitions": 1}},
        processors={"stale": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
                              "outputs": ["trajectories"], "poll_timeout_s": 0.2,
                              "options": {"max_staleness": 1}}})


def publish(kafka_config, topo, groups) -> None:
    producer = RecordProducer(kafka_config)
    producer.produce(topo.full_name("weights.actor"), manifest(5), key="actor")
    for g in groups:
        producer.produce(topo.full_name("trajectories.raw"), g, key=g.prompt_id)
    producer.flush()


def test_a_running_processor_serves_lag_versions_and_staleness_over_http(
        kafka_config, make_topology, monkeypatch):
    topo, _ = stale_filter_topology(make_topology)
    publish(kafka_config, topo, [group(f"g{i}", [1.0, 0.0]) for i in range(6)]
            + [group(f"old{i}", [1.0, 0.0], versions=[-1, 2]) for i in range(3)])
    monkeypatch.setenv(METRICS_PORT_ENV, "0")  # any free port; the exporter says which
    runtime = ProcessorRuntime(topo, "stale", instance="m")
    me = 'component="stale/m",kind="processor"'

    def lags(text: str) -> list[tuple[str, str, str]]:
        return re.findall(
            rf'astraflow_consumer_lag{{{me},partition="(\d)",topic="([^"]+)"}} (\S+)', text)

    with running(runtime):
        wait_for(lambda: runtime.loop.exporter is not None, 30, "the metrics endpoint")
        port = runtime.loop.exporter.port
        scrape_until(port, 'policy="actor"', "a weight version on /metrics")
        scrape_until(port, 'le="+Inf"} 9.0', "every group in the staleness histogram")
        # a partition's lag is shown once the consumer has a fetch of it to measure from
        # (CI scraped once with partition 1's alone): wait for both
        def both() -> str | None:
            text = scrape(port)
            return text if len(lags(text)) == 2 else None

        text = wait_for(both, 60, "the lag of both input partitions")
    assert f'astraflow_weight_version{{{me},policy="actor"}} 5.0' in text
    assert {(p, t) for p, t, _ in lags(text)} == {("0", topo.full_name("trajectories.raw")),
                                                  ("1", topo.full_name("trajectories.raw"))}
    assert f'astraflow_staleness_bucket{{{me},le="1"}} 6.0' in text  # the fresh ones
    assert re.search(rf"astraflow_records_in_total{{{me}}} 9\.0", text)


def test_status_once_json_lists_every_group_with_its_lag(kafka_config, make_topology, capsys):
    topo, path = stale_filter_topology(make_topology)
    publish(kafka_config, topo, [group(f"g{i}", [1.0, 0.0]) for i in range(4)])
    runtime = ProcessorRuntime(topo, "stale", instance="s")
    with running(runtime):
        wait_for(lambda: runtime.counters.produced == 4 and runtime.counters.transactions >= 2,
                 60, "the groups through the filter, and a status after them")
        argv = ["status", "-t", str(path), "--once", "--json",
                "--bootstrap", kafka_config.bootstrap_servers]

        def snapshot():
            assert main(argv) == 0
            snap = json.loads(capsys.readouterr().out)
            comps = {c["component"]: c for c in snap["components"]}
            return snap if comps.get("stale/s", {}).get("consumed") == 4 else None

        snap = wait_for(snapshot, 60, "the filter's status with its four groups")
    groups = {g["group"]: g for g in snap["groups"]}
    assert set(groups) == {g for _, g, _ in topo.consumer_groups()}
    assert groups[topo.group_of("stale")]["lag"] == 0
    assert groups[topo.group_of("stale")]["topics"] == [topo.full_name("trajectories.raw")]
    comp = next(c for c in snap["components"] if c["component"] == "stale/s")
    assert comp["versions"] == {"actor": 5} and comp["kind"] == "processor"
    assert snap["dlq"]["records"] == 0
