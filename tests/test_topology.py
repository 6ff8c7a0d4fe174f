"""Topology validation and client configuration, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.broker import BrokerError, EmbeddedBroker, ensure_jars
from astraflow.kafka.config import KafkaConfig
from astraflow.records import Batch, Task, TrajectoryGroup, WeightManifest
from astraflow.topology import TopologyError, load_topology, parse_topology, schema_for_topic

REPO = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("path", sorted((REPO / "topology").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_topologies_are_valid(path):
    topo = load_topology(path)
    assert topo.topic("dlq").full_name == f"{topo.run}.dlq"
    for name in topo.processors:
        assert topo.group_of(name).startswith(topo.run)


def test_topic_schemas_follow_the_design():
    assert schema_for_topic("tasks.source") is Task
    assert schema_for_topic("trajectories.raw") is TrajectoryGroup
    assert schema_for_topic("samples.solver") is TrajectoryGroup
    assert schema_for_topic("batches.verifier") is Batch
    assert schema_for_topic("weights.solver") is WeightManifest
    assert schema_for_topic("weights.blobs").__name__ == "BlobChunk"
    assert schema_for_topic("whatever") is None


def base(**extra):
    data = {"run": "r1", "topics": {"tasks.source": {}, "tasks": {}},
            "processors": {"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                                   "outputs": ["tasks"]}}}
    data.update(extra)
    return data


@pytest.mark.parametrize(
    "mutate, key",
    [
        (lambda d: d.update(bogus=1), "bogus"),
        (lambda d: d["processors"]["fwd"].update(kind="nope"), "processors.fwd.kind"),
        (lambda d: d["processors"]["fwd"].update(outputs=["missing"]),
         "processors.fwd.outputs[0]"),
        (lambda d: d["processors"]["fwd"].update(max_batch="lots"), "processors.fwd.max_batch"),
        (lambda d: d["processors"]["fwd"].update(options={"x": 1}),
         "processors.fwd.options.x"),
        (lambda d: d["topics"].update(mystery={}), "topics.mystery"),
        (lambda d: d["topics"]["tasks"].update(partitions=0), "topics.tasks.partitions"),
        (lambda d: d["topics"]["tasks"].update(compression="brotli"), "topics.tasks.compression"),
        (lambda d: d.update(kafka={"bootstrap": "x"}), "kafka.bootstrap"),
        (lambda d: d.update(kafka={"outage_limit_s": 0}), "kafka.outage_limit_s"),
        (lambda d: d.update(kafka={"transaction_timeout_ms": 10}),
         "kafka.transaction_timeout_ms"),
        (lambda d: d.update(run="has space"), "run"),
    ],
)
def test_bad_config_names_file_and_key(tmp_path, mutate, key):
    import yaml

    data = base()
    mutate(data)
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(TopologyError) as e:
        load_topology(path)
    msg = str(e.value)
    assert msg.startswith(f"{path}:"), msg
    assert key in msg, msg


def test_unreadable_and_non_yaml_files(tmp_path):
    with pytest.raises(TopologyError, match="cannot read"):
        load_topology(tmp_path / "absent.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("run: [unclosed")
    with pytest.raises(TopologyError, match="not valid YAML"):
        load_topology(bad)


def test_topic_defaults_and_overrides():
    topo = parse_topology(base(topic_defaults={"partitions": 5, "retention_ms": 1000},
                               topics={"tasks.source": {}, "tasks": {"partitions": 2},
                                       "odd": {"schema": "Task", "configs": {"a.b": "c"}}}))
    assert topo.topic("tasks.source").partitions == 5
    assert topo.topic("tasks").partitions == 2
    assert topo.topic("tasks").configs["retention.ms"] == "1000"
    assert topo.topic("odd").schema_type is Task
    assert topo.topic("odd").configs["a.b"] == "c"
    assert topo.topic("status").partitions == 1  # implicit topic with its own defaults


def test_librdkafka_options_pass_through_untouched(monkeypatch):
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    cfg = KafkaConfig(
        bootstrap_servers="b1:9093,b2:9093",
        options={"security.protocol": "SASL_SSL", "sasl.mechanism": "SCRAM-SHA-512",
                 "sasl.username": "u", "sasl.password": "p", "ssl.ca.location": "/ca.pem"},
        producer_options={"linger.ms": 50},
        consumer_options={"fetch.min.bytes": 1024},
    )
    for conf in (cfg.admin_conf(), cfg.producer_conf(), cfg.consumer_conf("g")):
        assert conf["security.protocol"] == "SASL_SSL"
        assert conf["sasl.mechanism"] == "SCRAM-SHA-512"
        assert conf["ssl.ca.location"] == "/ca.pem"
        assert conf["bootstrap.servers"] == "b1:9093,b2:9093"
    assert cfg.producer_conf()["linger.ms"] == 50
    assert cfg.consumer_conf("g")["fetch.min.bytes"] == 1024
    assert cfg.consumer_conf("g")["isolation.level"] == "read_committed"
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "elsewhere:9092")
    assert cfg.effective().bootstrap_servers == "elsewhere:9092"


def test_missing_java_or_maven_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    monkeypatch.setenv("ASTRAFLOW_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("KAFKA_HOME", raising=False)
    with pytest.raises(BrokerError, match="`java` not found.*install"):
        EmbeddedBroker(tmp_path / "state").start()
    with pytest.raises(BrokerError, match="`mvn` not found.*apt-get install maven"):
        ensure_jars()
    monkeypatch.setenv("KAFKA_HOME", str(tmp_path / "nokafka"))
    with pytest.raises(BrokerError, match="no libs/ folder"):
        ensure_jars()
