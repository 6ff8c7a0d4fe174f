"""The embedded cluster of three KRaft nodes, running: it loses a node and keeps serving with
acks=all and min.insync.replicas 2, and keeps its ports and data across a restart (its configs
and commands without a broker: tests/unit/broker/test_cluster.py)."""

from __future__ import annotations

import time

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from astraflow.broker.cluster import EmbeddedCluster
from astraflow.broker.embedded import serving_brokers
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from tests.conftest import random_name, wait_for


def _produce_all(config: KafkaConfig, topic: str, values: list[bytes]) -> None:
    """Produce ``values`` with the producer settings of every AstraFlow producer
    (acks=all, idempotent); fail unless every one is acknowledged."""
    errors: list = []
    conf = config.producer_conf()
    assert conf["acks"] == "all"
    p = Producer(conf)
    for v in values:
        p.produce(topic, v, partition=0, on_delivery=lambda err, _m: errors.append(err))
    assert p.flush(60) == 0
    assert errors == [None] * len(values), errors


def _read(config: KafkaConfig, topic: str, expect: int) -> list[bytes]:
    c = Consumer(config.consumer_conf(random_name("g"), **{"enable.partition.eof": True}))
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[bytes] = []
    deadline = time.monotonic() + 60
    try:
        while len(out) < expect and time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is not None and not m.error():
                out.append(m.value())
            elif m is not None and m.error().code() != KafkaError._PARTITION_EOF:
                raise AssertionError(m.error())
    finally:
        c.close()
    return out


@pytest.mark.slow
def test_a_killed_node_leaves_the_topic_under_replicated_but_writable_and_rejoins(
        embedded_cluster, monkeypatch, tmp_path, capsys):
    c = embedded_cluster
    st = c.status()
    assert c.node_ids == [1, 2, 3]
    assert [(n.id, n.alive) for n in st.nodes] == [(1, True), (2, True), (3, True)]
    assert serving_brokers(c.bootstrap) == {1, 2, 3}
    config = KafkaConfig(bootstrap_servers=c.bootstrap, client_id="cluster-test")
    topic = random_name("rf3")
    admin = make_admin(config)
    admin.create_topics([NewTopic(topic, 3, 3, config={"min.insync.replicas": "2"})]
                        )[topic].result(60)
    wait_for(lambda: all((topic, p) in c.status().leaders for p in range(3)), 60,
             "a leader for each partition")
    replicas = admin.list_topics(topic, timeout=10).topics[topic].partitions
    assert all(sorted(p.replicas) == [1, 2, 3] for p in replicas.values())
    _produce_all(config, topic, [b"before"])

    victim = c.status().leaders[(topic, 0)]  # the leader: a new one must be elected
    c.kill_node(victim)
    wait_for(lambda: not c.status().nodes[victim - 1].alive, 30, "the node gone")
    under = wait_for(lambda: {p for t, p in c.status().under_replicated if t == topic}
                     == {0, 1, 2}, 90, "every partition under-replicated")
    assert under
    assert serving_brokers(c.bootstrap) == {1, 2, 3} - {victim}
    _produce_all(config, topic, [b"during-1", b"during-2"])  # 2 in sync >= min ISR 2
    assert _read(config, topic, 3) == [b"before", b"during-1", b"during-2"]
    assert c.status().leaders[(topic, 0)] != victim

    c.start_node(victim, timeout=120)
    wait_for(lambda: not [t for t, _p in c.status().under_replicated if t == topic], 120,
             "the status to show no under-replicated partition of the topic")

    def isrs() -> dict[int, list[int]]:
        """Each partition's in-sync replicas, as a fresh admin's metadata has them (which
        may trail the status read just before)."""
        parts = make_admin(config).list_topics(topic, timeout=10).topics[topic].partitions
        return {p: sorted(m.isrs) for p, m in parts.items()}

    wait_for(lambda: isrs() == {0: [1, 2, 3], 1: [1, 2, 3], 2: [1, 2, 3]}, 120,
             "a fresh admin's metadata to show the in-sync replicas back to 3", step=1.0)
    assert all(n.alive for n in c.status().nodes)

    # what `astraflow broker status` and `broker logs --node` show of it
    from astraflow.cli.main import main

    monkeypatch.setenv("ASTRAFLOW_STATE", str(tmp_path / "no-broker"))
    monkeypatch.setenv("ASTRAFLOW_CLUSTER_STATE", str(c.state))
    capsys.readouterr()
    assert main(["broker", "status"]) == 0
    out = capsys.readouterr().out
    assert "embedded broker: stopped" in out and "3 of 3 nodes running" in out, out
    assert f"node {victim}: 127.0.0.1:{c.port(victim)}, pid {c.pid(victim)}" in out, out
    assert f"  {topic} (3 partitions): node " in out, out
    assert main(["broker", "logs", "--node", str(victim), "-n", "5"]) == 0
    assert f"--- node {victim} ({c.log_file(victim)})" in capsys.readouterr().out


@pytest.mark.slow
def test_the_cluster_keeps_its_ports_and_data_across_a_restart(embedded_cluster):
    c = embedded_cluster
    bootstrap = c.bootstrap
    config = KafkaConfig(bootstrap_servers=bootstrap, client_id="cluster-test")
    topic = random_name("kept")
    admin = make_admin(config)
    admin.create_topics([NewTopic(topic, 1, 3)])[topic].result(60)
    _produce_all(config, topic, [b"kept"])
    assert c.stop(timeout=60)
    assert not c.status().running
    again = EmbeddedCluster(c.state, size=3)  # as a new process would see it
    st = again.start(timeout=240, log=lambda _m: None)
    assert again.bootstrap == bootstrap and st.bootstrap == bootstrap
    assert _read(config, topic, 1) == [b"kept"]
