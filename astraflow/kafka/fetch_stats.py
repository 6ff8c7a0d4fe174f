"""Which broker a consumer fetches a partition from, read from librdkafka's statistics.

A consumer made with ``statistics.interval.ms`` hands its ``stats_cb`` a JSON report
every interval (librdkafka's STATISTICS.md). ``partition_fetch`` reads three things from
one report: the partition's leader and the broker it is fetched from now (``topics``; the
two differ when a rack-aware broker named a preferred read replica, KIP-392), the brokers
whose ``toppars`` list the partition (those a fetch for it goes to), and the bytes the
consumer received from each broker (``rxbytes``, every request of that connection).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any


@dataclass
class PartitionFetch:
    """One partition of one statistics report: ``leader`` and ``fetched_from`` are node
    ids (-1 when unknown), ``toppar_nodes`` the nodes whose connection holds the partition,
    ``rx_bytes`` the bytes received per node, ``messages`` those fetched of it."""

    leader: int
    fetched_from: int
    toppar_nodes: list[int] = field(default_factory=list)
    rx_bytes: dict[int, int] = field(default_factory=dict)
    messages: int = 0

    @property
    def from_follower(self) -> bool:
        """Fetched from a replica other than the leader."""
        return self.fetched_from >= 0 and self.fetched_from != self.leader


def partition_fetch(stats: dict[str, Any] | str, topic: str, partition: int
                    ) -> PartitionFetch | None:
    """What report ``stats`` (the dict or its JSON) says of ``topic``'s ``partition``;
    None when it does not list the partition."""
    report = json.loads(stats) if isinstance(stats, str) else stats
    part = report.get("topics", {}).get(topic, {}).get("partitions", {}).get(str(partition))
    if part is None:
        return None
    toppars, rx = [], {}
    for broker in report.get("brokers", {}).values():
        node = int(broker.get("nodeid", -1))
        if node < 0:  # a bootstrap connection: metadata only
            continue
        rx[node] = rx.get(node, 0) + int(broker.get("rxbytes", 0))
        if any(tp.get("topic") == topic and int(tp.get("partition", -2)) == partition
               for tp in broker.get("toppars", {}).values()):
            toppars.append(node)
    return PartitionFetch(leader=int(part.get("leader", -1)),
                          fetched_from=int(part.get("broker", -1)),
                          toppar_nodes=sorted(toppars), rx_bytes=rx,
                          messages=int(part.get("rxmsgs", 0)))


__all__ = ["PartitionFetch", "partition_fetch"]
