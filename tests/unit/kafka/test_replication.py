"""A topic's replication from the cluster's size: the decision alone, no broker (what
`topics apply` does with it on the test broker: tests/integration/kafka/test_replication.py)."""

from __future__ import annotations

import pytest

from astraflow.config.topology import parse_topology
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.replication import ReplicationError, replication


@pytest.mark.parametrize("brokers,replicas,min_isr", [(1, 1, "1"), (2, 2, "1"), (3, 3, "2"),
                                                      (5, 3, "2")])
def test_the_default_is_min_three_brokers_with_min_isr_two_from_three(brokers, replicas,
                                                                       min_isr):
    assert replication(brokers) == (replicas, {"min.insync.replicas": min_isr})


def test_an_explicit_factor_is_kept_and_its_min_isr_follows_it():
    assert replication(5, 4) == (4, {"min.insync.replicas": "2"})
    assert replication(3, 1) == (1, {"min.insync.replicas": "1"})
    assert replication(3, None, configs={"min.insync.replicas": "3", "a": "b"}) == (
        3, {"min.insync.replicas": "3", "a": "b"})


def test_a_factor_above_the_brokers_names_its_key():
    with pytest.raises(ReplicationError, match=r"^topics\.tasks\.replication_factor: "
                       r"replication factor 3 needs 3 brokers, the cluster has 1"):
        replication(1, 3, "topics.tasks.replication_factor")
    with pytest.raises(ReplicationError, match=r"^k\.min: 3 is more than the topic's 2"):
        replication(2, None, configs={"min.insync.replicas": "3"}, min_isr_key="k.min")
    with pytest.raises(ReplicationError, match="no broker"):
        replication(0)


def _topology(**extra) -> object:
    return parse_topology({"run": "r", "topics": {"tasks": {}, "batches.actor": {}},
                           "processors": {}, **extra})


def test_a_topologys_topics_take_the_clusters_default_unless_it_sets_one():
    topo = _topology()
    tasks = topo.topic("tasks")
    assert tasks.replication_factor is None
    assert "min.insync.replicas" not in tasks.configs
    on3, on1 = tasks.for_cluster(3), tasks.for_cluster(1)
    assert (on3.replication_factor, on3.configs["min.insync.replicas"]) == (3, "2")
    assert (on1.replication_factor, on1.configs["min.insync.replicas"]) == (1, "1")
    assert on3.configs["retention.ms"] == tasks.configs["retention.ms"]

    topo = _topology(topic_defaults={"replication_factor": 2},
                     topics={"tasks": {"replication_factor": 3}, "dlq": {}})
    assert topo.topic("dlq").for_cluster(3).replication_factor == 2
    with pytest.raises(ReplicationError, match=r"^topic_defaults\.replication_factor: "):
        topo.topic("dlq").for_cluster(1)
    with pytest.raises(ReplicationError, match=r"^topics\.tasks\.replication_factor: "):
        topo.topic("tasks").for_cluster(2)
    # an existing topic keeps its replicas, whatever answers now
    assert topo.topic("tasks").for_cluster(2, replicas=3).replication_factor == 3


def test_the_shipped_topologies_leave_the_replication_to_the_cluster():
    from pathlib import Path

    from astraflow.config.topology import load_topology

    root = Path(__file__).resolve().parents[3]
    for path in sorted((root / "topology").glob("*.yaml")):
        topo = load_topology(path)
        assert topo.topic_defaults.replication_factor is None, path
        assert all(t.replication_factor is None for t in topo.resolved_topics()), path


def test_a_producer_setting_other_than_acks_all_fails_at_load_naming_the_key():
    from astraflow.config.topology import TopologyError

    assert KafkaConfig().producer_conf()["acks"] == "all"
    with pytest.raises(TopologyError, match=r"kafka\.producer_options\.acks"):
        parse_topology({"run": "r", "topics": {}, "processors": {},
                        "kafka": {"producer_options": {"acks": 1}}})
    with pytest.raises(ValueError, match=r"\.options\.acks"):
        KafkaConfig(options={"acks": "0"})
