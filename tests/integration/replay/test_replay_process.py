"""``replay process`` on a real broker: a chain run again over a run's recorded trajectories, in
event time, into a new run (the chain and event-time logic without a broker:
tests/unit/replay/test_process.py, tests/unit/dataflow/test_event_time.py)."""

from __future__ import annotations

import time

from astraflow.cli.main import main
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.table import TopicReader
from astraflow.wire.records import Batch, ComponentStatus, TrajectoryGroup
from tests.integration.dataflow.test_data_algorithms import group, manifest

# (timestamp ms, version) of the source run's manifests, and of its recorded groups the
# time and the version of their oldest token; max_staleness 1, judged at each group's own
# time, keeps g0, g1, g4 and g5 (staleness 0, 1, 0, 1) and drops g2 and g3 (2 and 2).
# Judged against the last version (3), it would keep g4 and g5 only.
T0 = int(time.time() * 1000) - 600_000  # recent: within the topics' retention
PUBLISHED = [(T0 + 1000, 0), (T0 + 2000, 1), (T0 + 3000, 2), (T0 + 4000, 3)]
RECORDED = [(T0 + 1500, 0), (T0 + 2500, 0), (T0 + 3500, 0), (T0 + 4500, 1), (T0 + 4600, 3),
            (T0 + 4700, 2)]


def _record_source(kafka_config, topo) -> None:
    producer = RecordProducer(kafka_config)

    def send(topic, record, key, ts, partition=None):
        full = topo.full_name(topic)
        producer.produce_raw(full, producer.codec.encode(record, full), key, partition, ts)

    for ts, v in PUBLISHED:
        send("weights.actor", manifest(v), "actor", ts)
    for i, (ts, v) in enumerate(RECORDED):
        send("trajectories.raw", group(f"g{i}", [1.0, 0.0], versions=[-1, v]), f"g{i}", ts,
             partition=i % 3)
    send("status", ComponentStatus(component_id="staleness/up", kind="processor", host="h",
                                   consumed=6, produced=6,
                                   metrics={"staleness/passed": 6.0, "staleness/dropped": 0.0}),
         "staleness/up", T0 + 5000)
    producer.flush()


def _rows_of(out: str, processor: str) -> dict[str, list[str]]:
    """The report's rows of one processor: figure -> [replay, original run]."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(processor + " "))
    rows = {}
    for i, line in enumerate(lines[start:]):
        if i and not line.startswith(" "):
            break
        words = line.split()[1:] if i == 0 else line.split()
        rows[" ".join(words[:-2])] = words[-2:]
    return rows


def _read(kafka_config, topic, kind):
    reader = TopicReader(kafka_config, topic, kind)
    try:
        return reader.catch_up(30.0)
    finally:
        reader.close()


def test_replay_process_reruns_the_chain_in_event_time_into_a_new_run(
        kafka_config, kafka_bootstrap, make_topology, capsys):
    topo, path = make_topology(
        topics={"trajectories.raw": {}, "trajectories": {}, "samples.actor": {},
                "batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}},
        processors={
            "staleness": {"kind": "staleness_filter", "inputs": ["trajectories.raw"],
                          "outputs": ["trajectories"], "options": {"policies": ["actor"]}},
            "router": {"kind": "router", "inputs": ["trajectories"],
                       "outputs": ["samples.actor"]},
            "batcher": {"kind": "batcher", "inputs": ["samples.actor"],
                        "outputs": ["batches.actor"],
                        "options": {"policy": "actor", "batch_size": 1}}},
        policies={"actor": {"model": "unused", "max_staleness": 4}})
    _record_source(kafka_config, topo)
    into = f"{topo.run}-s1"
    argv = ["replay", "process", "-t", str(path), "--bootstrap", kafka_bootstrap,
            "--set", "policies.actor.max_staleness=1", "--into", into]
    assert main(argv) == 0
    out = capsys.readouterr().out
    rows = _rows_of(out, "staleness")
    assert rows["records in"] == ["6", "6"], out
    assert rows["records out"] == ["4", "6"], out
    assert rows["staleness/dropped"] == ["2", "0"], out
    assert _rows_of(out, "router")["records in"] == ["4", "-"], out

    kept = _read(kafka_config, f"{into}.trajectories", TrajectoryGroup)
    assert sorted(e.value.group_id for e in kept) == ["g0", "g1", "g4", "g5"]
    stamps = dict(RECORDED[i] for i in (0, 1, 4, 5))
    assert {e.timestamp_ms for e in kept} == set(stamps)  # outputs keep the recorded time
    # batch_size 1: each kept group is batched as it arrives, judged at its own time
    batches = _read(kafka_config, f"{into}.batches.actor", Batch)
    assert sorted(g.group_id for b in batches for g in b.value.groups) == [
        "g0/actor", "g1/actor", "g4/actor", "g5/actor"]  # the router's ids

    # again: the copy and every processor continue from where they are, nothing twice
    assert main(argv) == 0
    capsys.readouterr()
    assert len(_read(kafka_config, f"{into}.trajectories", TrajectoryGroup)) == 4
    assert len(_read(kafka_config, f"{into}.batches.actor", Batch)) == len(batches)

    # up to version 1: only what was recorded before version 2 was published (g0, g1)
    assert main([*argv[:-1], f"{topo.run}-v1", "--to-version", "1"]) == 0
    capsys.readouterr()
    kept = _read(kafka_config, f"{topo.run}-v1.trajectories", TrajectoryGroup)
    assert sorted(e.value.group_id for e in kept) == ["g0", "g1"]

    assert main([*argv[:-1], topo.run]) == 2
    assert "that is the run replayed" in capsys.readouterr().err
