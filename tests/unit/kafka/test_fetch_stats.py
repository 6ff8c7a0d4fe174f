"""librdkafka's statistics read without a broker: which node each partition was fetched from, the
leader, the bytes per node (on the embedded cluster:
tests/integration/kafka/test_rack_aware.py)."""

from __future__ import annotations

import json

from astraflow.kafka.fetch_stats import partition_fetch


def test_partition_fetch_reads_the_leader_the_broker_and_the_bytes_per_node():
    report = {
        "brokers": {
            "h:1/1": {"nodeid": 1, "rxbytes": 900, "toppars": {}},
            "h:3/3": {"nodeid": 3, "rxbytes": 50_000,
                      "toppars": {"t-0": {"topic": "t", "partition": 0}}},
            "h:1/bootstrap": {"nodeid": -1, "rxbytes": 700, "toppars": {}}},
        "topics": {"t": {"partitions": {"0": {"leader": 1, "broker": 3, "rxmsgs": 40},
                                        "-1": {"leader": -1, "broker": -1}}}}}
    f = partition_fetch(json.dumps(report), "t", 0)
    assert (f.leader, f.fetched_from, f.toppar_nodes, f.messages) == (1, 3, [3], 40)
    assert f.rx_bytes == {1: 900, 3: 50_000} and f.from_follower
    report["topics"]["t"]["partitions"]["0"]["broker"] = 1
    assert not partition_fetch(report, "t", 0).from_follower
    assert partition_fetch(report, "t", 1) is None and partition_fetch(report, "u", 0) is None

