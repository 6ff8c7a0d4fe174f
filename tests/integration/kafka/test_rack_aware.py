"""Rack-aware pools on the embedded cluster (node i in rack r<i>, the rack-aware replica
selector): a consumer in a follower's rack fetches from that follower, not from the leader
(KIP-392), shown by librdkafka's statistics; a racked pool's node reads its tasks and weights
from its rack's replica (the settings without a broker: tests/unit/launch/test_racks.py)."""

from __future__ import annotations

import json
import os
import threading
import time

import confluent_kafka
import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import NewTopic

from astraflow.config.topology import parse_topology
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import TABLE_GROUP, KafkaConfig
from astraflow.kafka.fetch_stats import partition_fetch
from tests.conftest import CLUSTER_RACKS, random_name, wait_for

LEADER, FOLLOWER = 1, 3  # node ids: the tests' topics are led by node 1, node 3 follows


def _led_by_node_1(cluster, config: KafkaConfig, *topics: str) -> None:
    """Create ``topics`` (1 partition, replicas on nodes 1, 2, 3, node 1 preferred) and
    wait until node 1 leads each and all three replicas are in sync."""
    admin = make_admin(config)
    futures = admin.create_topics([NewTopic(t, 1, replica_assignment=[[1, 2, 3]],
                                            config={"min.insync.replicas": "2"})
                                   for t in topics])
    for f in futures.values():
        f.result(60)

    def ready() -> bool:
        md = admin.list_topics(timeout=10).topics
        return all(t in md and md[t].partitions[0].leader == LEADER
                   and sorted(md[t].partitions[0].isrs) == [1, 2, 3] for t in topics)

    wait_for(ready, 60, f"node {LEADER} leading {', '.join(topics)} with 3 in sync")


def _fetch_report(config: KafkaConfig, topic: str, expect: int) -> dict:
    """Read ``expect`` records of ``topic``'s partition 0 with ``config``'s consumer
    settings and statistics every 100 ms; the first report that counts them all."""
    reports: list[str] = []
    consumer = Consumer(config.consumer_conf(random_name("g"), **{
        "statistics.interval.ms": 100, "stats_cb": reports.append,
        "enable.partition.eof": True}))
    consumer.assign([TopicPartition(topic, 0, 0)])
    got = 0

    def counted() -> dict | None:
        nonlocal got
        m = consumer.poll(0.2)
        if m is not None and not m.error():
            got += 1
        elif m is not None and m.error().code() != KafkaError._PARTITION_EOF:
            raise AssertionError(m.error())
        for r in reversed(reports):
            f = partition_fetch(r, topic, 0)
            if got >= expect and f is not None and f.messages >= expect:
                return json.loads(r)
        return None

    try:
        return wait_for(counted, 60, f"{expect} records of {topic} and a report of them",
                        step=0)
    finally:
        consumer.close()


def test_a_consumer_in_a_followers_rack_fetches_from_that_follower(embedded_cluster):
    """Records of a topic led by node 1 (rack r1): a consumer with client.rack r3 gets
    them all from node 3, its rack's replica, and next to nothing from node 1; one
    without a rack gets them from the leader. Bytes per node from librdkafka's
    statistics (``rxbytes``, and which node's connection holds the partition)."""
    assert CLUSTER_RACKS[FOLLOWER - 1] == "r3" and CLUSTER_RACKS[LEADER - 1] == "r1"
    config = KafkaConfig(bootstrap_servers=embedded_cluster.bootstrap, client_id="rack-test")
    topic = random_name("rack")
    _led_by_node_1(embedded_cluster, config, topic)
    n, size = 64, 16 << 10  # random bytes: lz4 leaves them as large as they are
    producer = Producer(config.producer_conf())
    for _ in range(n):
        producer.produce(topic, os.urandom(size), partition=0)
    assert producer.flush(60) == 0
    payload = n * size

    near = partition_fetch(_fetch_report(config.with_rack("r3"), topic, n), topic, 0)
    assert (near.leader, near.fetched_from, near.toppar_nodes) == (LEADER, FOLLOWER, [FOLLOWER])
    assert near.rx_bytes[FOLLOWER] >= payload, near
    assert near.rx_bytes.get(LEADER, 0) < payload // 20, near  # metadata, the first fetch
    assert near.from_follower

    plain = partition_fetch(_fetch_report(config, topic, n), topic, 0)
    assert (plain.leader, plain.fetched_from, plain.toppar_nodes) == (LEADER, LEADER, [LEADER])
    assert plain.rx_bytes[LEADER] >= payload, plain
    assert plain.rx_bytes.get(FOLLOWER, 0) < payload // 20, plain


class _ConsumerSpy:
    """Every ``Consumer`` the node makes (in its own thread, through the modules that make
    them): its config (``confs``) and its statistics reports (``reports``, by group id). A
    consumer's last reports are served as it closes. The test's own readers, in the main
    thread, are left as they are."""

    def __init__(self) -> None:
        self.confs: list[dict] = []
        self.reports: dict[str, list[str]] = {}
        spy = self

        class Spied(confluent_kafka.Consumer):
            def __init__(self, conf: dict) -> None:
                if threading.current_thread() is threading.main_thread():
                    super().__init__(conf)
                    return
                spy.confs.append(dict(conf))
                into = spy.reports.setdefault(conf["group.id"], [])
                super().__init__({**conf, "statistics.interval.ms": 100,
                                  "stats_cb": into.append})

            def close(self) -> None:
                deadline = time.monotonic() + 0.3
                while time.monotonic() < deadline:
                    self.poll(0.1)
                super().close()

        self.cls = Spied

    def fetches(self, topic: str) -> list:
        """Every report of any consumer that lists ``topic``'s partition 0."""
        return [f for rs in self.reports.values() for r in rs
                if (f := partition_fetch(r, topic, 0)) is not None and f.messages > 0]


@pytest.mark.slow
def test_a_racked_pools_node_reads_tasks_and_weights_from_its_racks_replica(
        embedded_cluster, monkeypatch, tmp_path):
    """A RaaS node of pool ``remote`` (rack r3), built as ``raas run`` builds it, rolls out
    a task after following two weight versions over the Kafka blob store; tasks, manifests
    and blobs are led by node 1. Every consumer the node made carries client.rack r3; the
    tasks, the manifests and the blobs came from node 3 (the statistics of the node's own
    consumers: the partition's broker, the connection that holds it, bytes per node)."""
    import torch

    from astraflow.kafka import membership, table
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.engine import TorchEngine
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import WeightPublisher
    from astraflow.weights.stores import kafka as kafka_store
    from astraflow.weights.stores.kafka import KafkaBlobStore
    from astraflow.wire.records import TrajectoryGroup
    from tests.conftest import running
    from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
    from tests.unit.raas.test_workflows import task_of

    run = random_name("rack")
    config = KafkaConfig(bootstrap_servers=embedded_cluster.bootstrap, client_id="rack-test")
    names = ["tasks", "weights.actor", "weights.blobs"]
    _led_by_node_1(embedded_cluster, config, *(f"{run}.{t}" for t in names))
    topo = parse_topology({
        "run": run, "kafka": {"bootstrap_servers": embedded_cluster.bootstrap},
        "topics": {"tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1},
                   "weights.actor": {"partitions": 1},
                   "weights.blobs": {"partitions": 1, "max_message_bytes": 16 << 20}},
        "pools": {"remote": {"rack": "r3"}}}, source="rack.yaml")
    from astraflow.kafka.topics import apply_topics

    apply_topics(make_admin(config), topo.resolved_topics())  # trajectories.raw
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    pub = WeightPublisher(KafkaBlobStore(config, topo.full_name("weights.blobs")), "actor")
    v0 = {k: v.clone() for k, v in eng.model.state_dict().items()}
    v1 = {k: v + 0.01 * torch.randn_like(v) for k, v in v0.items()}
    producer = RecordProducer(config)
    for state in (v0, v1):
        for m in pub.publish(state):
            producer.produce(topo.full_name("weights.actor"), m, key="actor")
    producer.produce(topo.full_name("tasks"), task_of({"prompt": "1+2=", "answer": "3"}),
                     key="p-t0")
    producer.flush()

    spy = _ConsumerSpy()
    for module in (membership, table, kafka_store):  # where each makes its consumers
        monkeypatch.setattr(module, "Consumer", spy.cls)
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        pool="remote", instance="r3-0", n_samples=2, poll_timeout_s=0.2,
        workflow_options={"single_turn": {"max_new_tokens": 4}}))
    out = topo.full_name("trajectories.raw")
    with running(node):
        wait_for(lambda: read_all(config, out, idle_s=0.3), 90, "a trajectory group")
        wait_for(lambda: spy.fetches(topo.full_name("tasks")), 30, "a report of the tasks")
    assert eng.version == 1
    assert [r.record.task_id for r in read_all(config, out, idle_s=0.3,
                                                expect=TrajectoryGroup)] == ["t0"]

    groups = {c["group.id"] for c in spy.confs}
    assert topo.raas_group("remote") in groups and TABLE_GROUP in groups, groups
    assert any(g.startswith("astraflow-blob-reader-") for g in groups), groups
    assert {c.get("client.rack") for c in spy.confs} == {"r3"}, spy.confs
    for name in ("tasks", "weights.actor"):
        fetches = spy.fetches(topo.full_name(name))
        assert fetches, name
        assert all((f.leader, f.fetched_from) == (LEADER, FOLLOWER) for f in fetches), (
            name, fetches)
        assert all(f.toppar_nodes == [FOLLOWER] for f in fetches), (name, fetches)
    blobs = spy.fetches(topo.full_name("weights.blobs"))
    assert blobs and all((f.leader, f.fetched_from) == (LEADER, FOLLOWER) for f in blobs), blobs
    # the two versions' blobs (near a MiB) from node 3; from node 1 metadata only
    last = blobs[-1]
    assert last.rx_bytes.get(LEADER, 0) < 64 << 10 < last.rx_bytes[FOLLOWER], last
