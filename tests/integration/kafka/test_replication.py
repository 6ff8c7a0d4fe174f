"""What `topics apply` does with a topic's replication on the test broker (one node); the
decision alone is tests/unit/kafka/test_replication.py."""

from __future__ import annotations

import yaml

from astraflow.cli.main import main
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import describe_topic
from tests.conftest import random_name


def test_topics_apply_on_one_broker_refuses_a_factor_of_three_naming_the_key(
        kafka_bootstrap, tmp_path, capsys):
    run = random_name("rf")
    path = tmp_path / "t.yaml"
    path.write_text(yaml.safe_dump({"run": run, "topics": {"tasks": {}, "dlq": {
        "replication_factor": 3}}, "processors": {}}))
    assert main(["topics", "apply", "-t", str(path), "--bootstrap", kafka_bootstrap]) == 2
    assert capsys.readouterr().err.strip() == (
        "astraflow: topics.dlq.replication_factor: replication factor 3 needs 3 brokers, the "
        "cluster has 1 (leave it unset: the default is min(3, brokers))")
    data = yaml.safe_load(path.read_text())
    del data["topics"]["dlq"]
    path.write_text(yaml.safe_dump(data))
    assert main(["topics", "apply", "-t", str(path), "--bootstrap", kafka_bootstrap]) == 0
    desc = describe_topic(make_admin(KafkaConfig(bootstrap_servers=kafka_bootstrap)),
                          f"{run}.tasks")
    assert all(len(p["replicas"]) == 1 for p in desc["partitions"].values())

