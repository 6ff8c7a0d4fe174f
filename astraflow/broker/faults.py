"""Broker faults on the embedded cluster, and what they cost a run.

Which node to kill so that a run loses the most (``pick_victim``: the leader of the
policy's ``weights`` topic, preferring one that also coordinates the run's transactions),
whether a restarted node has caught up (``out_of_isr``), and how long training stalled
(``stalls``: gaps between consecutive published versions, and the time from each fault
until the next version). Used by the cluster chaos test and ``bench/cluster_faults.py``.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

TXN_STATE = "__transaction_state"
_TXN_LINE = re.compile(r"transactional id (\S+)")


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` (a signed 32-bit int over UTF-16 code units)."""
    data = text.encode("utf-16-be")
    h = 0
    for i in range(0, len(data), 2):
        h = (31 * h + int.from_bytes(data[i:i + 2], "big")) & 0xFFFFFFFF
    return h - (1 << 32) if h >= 1 << 31 else h


def transaction_partition(transactional_id: str, partitions: int) -> int:
    """The partition of ``__transaction_state`` that holds ``transactional_id``'s state,
    whose leader coordinates its transactions: Kafka's ``Utils.abs(id.hashCode()) %
    partitions`` (``abs`` of the smallest int is 0 there)."""
    h = java_hash(transactional_id)
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def transactional_ids(logs_dir: Path | str) -> set[str]:
    """The transactional ids a run's components logged when they started consuming
    (``<runs>/<run>/logs/*.log``)."""
    found: set[str] = set()
    for log in Path(logs_dir).glob("*.log"):
        found.update(_TXN_LINE.findall(log.read_text(errors="replace")))
    return found


@dataclass
class Victim:
    """The node to fault: it leads ``weights`` (the topic's partitions it leads) and the
    ``__transaction_state`` partitions of ``coordinates`` (transactional id -> partition);
    ``coordinators`` says which node coordinates each of the run's transactional ids."""

    node: int
    weights: list[int]
    coordinates: dict[str, int] = field(default_factory=dict)
    coordinators: dict[str, int] = field(default_factory=dict)

    def describe(self) -> str:
        """One line: what the node leads."""
        led = ", ".join(sorted(self.coordinates)) or "none of the run's transactional ids"
        return (f"node {self.node}: leader of weights partition(s) {self.weights}; "
                f"coordinator of {led}")


def _topics(bootstrap: str, timeout: float = 10.0) -> dict:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    return admin.list_topics(timeout=timeout).topics


def pick_victim(bootstrap: str, weights_topic: str, txn_ids: set[str],
                prefer: str | None = None) -> Victim:
    """The node that leads a partition of ``weights_topic``; among several, the one that
    coordinates ``prefer`` (e.g. the trainer's transactional id), then the one that
    coordinates most of ``txn_ids``."""
    topics = _topics(bootstrap)
    weights = topics[weights_topic].partitions
    state = topics[TXN_STATE].partitions
    coordinators = {t: state[transaction_partition(t, len(state))].leader for t in txn_ids}
    led: dict[int, list[int]] = {}
    for p in weights.values():
        led.setdefault(p.leader, []).append(p.id)
    candidates = [n for n in led if n >= 0]
    if not candidates:
        raise RuntimeError(f"{weights_topic} has no leader")
    node = max(candidates, key=lambda n: (prefer is not None and coordinators.get(prefer) == n,
                                          sum(c == n for c in coordinators.values())))
    mine = {t: transaction_partition(t, len(state)) for t, c in coordinators.items() if c == node}
    return Victim(node, sorted(led[node]), mine, coordinators)


def out_of_isr(bootstrap: str, node: int) -> list[tuple[str, int]]:
    """The partitions that have ``node`` as a replica but not in sync (all of them when
    the cluster does not answer)."""
    try:
        topics = _topics(bootstrap, timeout=5.0)
    except Exception:  # noqa: BLE001 - nothing answers: not caught up
        return [("?", -1)]
    return [(name, p.id) for name, md in topics.items() for p in md.partitions.values()
            if node in p.replicas and node not in p.isrs]


def stalls(times: dict[int, int], start_ms: int, end_ms: int,
           faults_ms: list[int]) -> dict[str, object]:
    """How long training stalled between ``start_ms`` and ``end_ms``, from ``times``
    (version -> when first published, ms): the longest gap between consecutive versions
    (the window's edges count as versions), the time from each fault (``faults_ms``) until
    the next version and the longest of those (None when none followed), and the versions
    in the window."""
    inside = sorted(t for t in times.values() if start_ms <= t <= end_ms)
    edges = [start_ms, *inside, end_ms]
    gap = max((b - a for a, b in zip(edges, edges[1:], strict=False)), default=0) / 1000
    each: list[float | None] = []
    for f in faults_ms:
        after = [t for t in times.values() if t >= f]
        each.append((min(after) - f) / 1000 if after else None)
    known = [e for e in each if e is not None]
    resume = max(known) if known and len(known) == len(each) else None
    return {"longest_gap_s": gap, "resume_s": resume, "resume_each_s": each,
            "versions_in_window": len(inside)}


def kill_up(up: subprocess.Popen, run_dir: Path | str) -> None:
    """SIGKILL an ``astraflow up`` and every component it started (its ``pids.json`` in
    ``run_dir``): the teardown of a chaos test or bench whose run went wrong."""
    pids = Path(run_dir) / "pids.json"
    children = json.loads(pids.read_text()).values() if pids.exists() else []
    if up.poll() is None:
        up.kill()
        up.wait(30)
    for pid in children:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
