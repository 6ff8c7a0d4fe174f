"""``replay process``: the chain and event-time logic, and a chain run again over a run's
recorded trajectories on a real broker."""

from __future__ import annotations

import time

import pytest

from astraflow.cli.main import main
from astraflow.config.topology import TopologyError, load_topology
from astraflow.dataflow.event_time import StreamClock, VersionsAtTime
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.table import TopicReader
from astraflow.replay.process import (
    apply_sets,
    caught_up,
    chain_of,
    load_chain_topology,
    report,
    upstream_of,
)
from astraflow.replay.ranges import ReplayError
from astraflow.wire.records import Batch, ComponentStatus, TrajectoryGroup
from tests.conftest import REPO
from tests.kafka.test_data_algorithms import group, manifest


# --- plain logic ----------------------------------------------------------------------------
def test_versions_are_answered_as_of_the_clock():
    clock = StreamClock()
    versions = VersionsAtTime(clock, {"actor": [(2000, 1), (1000, 0), (3000, 2)]})
    seen = []
    for ts in (500, 1000, 1999, 2500, 9000):
        clock.at_record(ts)
        seen.append(versions.latest("actor"))
    assert seen == [None, 0, 0, 1, 2]
    assert versions.latest("critic") is None
    clock.at_record(1500)  # a record from another partition, earlier in time
    assert versions.latest("actor") == 0 and clock.stream_ms == 9000
    assert clock.at_stream() == 9000 and versions.latest("actor") == 2


def test_a_version_published_out_of_order_never_lowers_the_answer():
    clock = StreamClock()
    versions = VersionsAtTime(clock, {"actor": [(1000, 3), (2000, 2)]})
    clock.at_record(2500)
    assert versions.latest("actor") == 3


def test_the_chain_is_what_lies_downstream_of_the_raw_trajectories_in_flow_order():
    topo = load_topology(REPO / "topology" / "data-algorithms.yaml")
    chain = chain_of(topo)
    assert chain == ["dynamic-sampling", "staleness", "router", "batcher"]  # not greso
    up = upstream_of(topo, chain)
    assert up["dynamic-sampling"] == set() and up["batcher"] == {"router"}
    bare = topo.model_copy(update={"processors": {
        k: v for k, v in topo.processors.items() if k == "greso"}})
    with pytest.raises(ReplayError, match="no processor reads trajectories.raw"):
        chain_of(bare)


def test_set_overrides_keys_and_refuses_what_it_cannot_set(tmp_path):
    doc = {"policies": {"actor": {"max_staleness": 4}}}
    apply_sets(doc, ["policies.actor.max_staleness=1", "processors.x.options.k=[1, 2]"])
    assert doc["policies"]["actor"]["max_staleness"] == 1
    assert doc["processors"]["x"]["options"]["k"] == [1, 2]
    with pytest.raises(ReplayError, match="KEY.PATH=VALUE"):
        apply_sets(doc, ["policies.actor.max_staleness"])
    with pytest.raises(ReplayError, match="max_staleness is not a mapping"):
        apply_sets(doc, ["policies.actor.max_staleness.x=1"])
    topo = load_chain_topology(REPO / "topology" / "default.yaml",
                               ["policies.actor.max_staleness=1"], "other")
    assert topo.run == "other" and topo.processors["staleness"].options["max_staleness"] == 1
    with pytest.raises(TopologyError, match="max_staleness"):
        load_chain_topology(REPO / "topology" / "default.yaml",
                            ["policies.actor.max_staleness=-3"], "other")


def test_a_consumer_has_caught_up_when_every_non_empty_partition_is_read_to_its_end():
    marks = {"t": {0: (0, 8), 1: (0, 0), 2: (5, 5)}}
    assert caught_up({("t", 0): 8}, marks)  # 1 and 2 hold nothing
    assert not caught_up({("t", 0): 7}, marks)
    assert not caught_up({}, marks)
    assert caught_up({}, {"t": {0: (3, 3)}})


def test_the_report_sets_the_replay_beside_the_original_run():
    from astraflow.replay.process import Figures

    text = report(["staleness"], {"staleness": Figures(6, 4, 0, {"staleness/dropped": 2.0})},
                  {"staleness": Figures(6, 6, 0, {"staleness/dropped": 0.0})})
    lines = text.splitlines()
    assert lines[0].split() == ["processor", "figure", "replay", "original", "run"]
    assert lines[2].split() == ["records", "out", "4", "6"]
    assert lines[-1].split() == ["staleness/dropped", "2", "0"]
    assert "-" in report(["x"], {"x": Figures(1, 1, 0)}, {})


# --- on the broker ----------------------------------------------------------------------------
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
