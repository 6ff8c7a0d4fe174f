"""The embedded Apache Kafka cluster: several KRaft nodes on loopback.

Each node is broker and controller at once, and the controllers form a static quorum of
all nodes (``controller.quorum.voters``), so a cluster of three keeps serving with one
node down. Every node's storage is formatted with the cluster's one id. The state
directory (``$ASTRAFLOW_CLUSTER_STATE``, default the embedded broker's state directory
with ``-cluster`` appended) holds ``cluster.json`` (size, cluster id, racks and each node's
ports, kept across restarts: clients and the voter set remember them) and one folder a
node (``node-<id>``: config, data, log, pid). The jars and the JVM set-up are the
embedded broker's (``astraflow.broker.embedded``); each node's heap is smaller, three JVMs share
the machine.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from astraflow.broker.embedded import (
    BrokerError,
    _format_storage,
    await_serving,
    free_port,
    jvm_command,
    kept_port,
    launch_server,
    read_json,
    server_runtime,
    serving_brokers,
    tail_file,
    terminate,
)
from astraflow.broker.properties import cluster_id as _cluster_id
from astraflow.broker.properties import listeners as _listeners
from astraflow.broker.properties import node_properties
from astraflow.kafka.embedded import cluster_state_dir, node_pid, running_cluster_bootstrap

NODE_HEAP_MB = 512  # per node: three JVMs on a small machine
DEFAULT_CLUSTER_PORT = 19192  # node i listens on DEFAULT_CLUSTER_PORT + i - 1 when free


@dataclass
class NodeStatus:
    """One node: its KRaft id, client port, JVM pid (None when not running), rack."""

    id: int
    port: int
    pid: int | None
    alive: bool
    rack: str | None = None


@dataclass
class ClusterStatus:
    """The nodes, the leader of every partition and the under-replicated partitions (those
    two empty when no node answers)."""

    nodes: list[NodeStatus]
    leaders: dict[tuple[str, int], int] = field(default_factory=dict)
    under_replicated: list[tuple[str, int]] = field(default_factory=list)
    state_dir: str = ""

    @property
    def running(self) -> bool:
        """Whether any node runs."""
        return any(n.alive for n in self.nodes)

    @property
    def bootstrap(self) -> str | None:
        """Every node's address (clients find the live ones), None when none runs."""
        if not self.running:
            return None
        return ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)

    def describe(self) -> str:
        """What ``astraflow broker status`` prints for the cluster."""
        if not self.nodes:
            return f"embedded cluster: none (state {self.state_dir})"
        up = sum(n.alive for n in self.nodes)
        lines = [f"embedded cluster: {up} of {len(self.nodes)} nodes running, bootstrap "
                 f"{self.bootstrap or '-'} (state {self.state_dir})"]
        for n in self.nodes:
            rack = f", rack {n.rack}" if n.rack else ""
            state = f"pid {n.pid}" if n.alive else "stopped"
            lines.append(f"  node {n.id}: 127.0.0.1:{n.port}, {state}{rack}")
        lines += leader_lines(self.leaders)
        if self.under_replicated:
            by_topic: dict[str, list[int]] = {}
            for t, p in sorted(self.under_replicated):
                by_topic.setdefault(t, []).append(p)
            parts = ", ".join(f"{t}[{','.join(map(str, ps))}]" for t, ps in by_topic.items())
            lines.append(f"  under-replicated partitions ({len(self.under_replicated)}): "
                         f"{parts}")
        elif self.running:
            lines.append("  under-replicated partitions: none")
        return "\n".join(lines)


def leader_lines(leaders: dict[tuple[str, int], int]) -> list[str]:
    """One line a topic (internal ones left out): how many of its partitions each node
    leads, and how many have no leader (``-1``)."""
    by_topic: dict[str, dict[int, int]] = {}
    for (topic, _p), leader in leaders.items():
        if not topic.startswith("__"):
            counts = by_topic.setdefault(topic, {})
            counts[leader] = counts.get(leader, 0) + 1
    lines = []
    for topic in sorted(by_topic):
        counts = by_topic[topic]
        led = ", ".join(f"node {n} leads {k}" if n >= 0 else f"{k} without a leader"
                        for n, k in sorted(counts.items(), key=lambda x: (x[0] < 0, x[0])))
        n = sum(counts.values())
        lines.append(f"  {topic} ({n} partition{'s' if n > 1 else ''}): {led}")
    return lines


def partition_health(bootstrap: str, timeout: float = 5.0,
                     ) -> tuple[dict[tuple[str, int], int], list[tuple[str, int]]]:
    """Each partition's leader, and the partitions whose in-sync replicas are fewer than
    their replicas, as the cluster at ``bootstrap`` reports them."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    try:
        topics = admin.list_topics(timeout=timeout).topics
    except Exception:  # noqa: BLE001 - no node answers: nothing to report
        return {}, []
    leaders: dict[tuple[str, int], int] = {}
    under: list[tuple[str, int]] = []
    for name, md in topics.items():
        for p in md.partitions.values():
            leaders[(name, p.id)] = p.leader
            if len(p.isrs) < len(p.replicas):
                under.append((name, p.id))
    return leaders, under


def cluster_config(node_id: int, ports: dict[int, tuple[int, int]], data: Path | str,
                   rack: str | None = None) -> str:
    """Node ``node_id``'s config: ``ports`` maps every node id to its (client,
    controller) ports; the quorum is every node's controller."""
    voters = ",".join(f"{i}@127.0.0.1:{c}" for i, (_p, c) in sorted(ports.items()))
    port, controller = ports[node_id]
    return node_properties(node_id, f"controller.quorum.voters={voters}",
                           _listeners(port, controller, None), data, size=len(ports),
                           rack=rack)


def _unused_port(taken: set[int], preferred: int | None = None) -> int:
    """A free port none of the cluster's others is (``free_port``), added to ``taken``."""
    port = free_port(preferred)
    while port in taken:
        port = free_port()
    taken.add(port)
    return port


def parse_racks(text: str | None) -> list[str] | None:
    """``--racks r1,r2,r3`` as a list (None when not given)."""
    return [r.strip() for r in text.split(",")] if text else None


def check_racks(racks: list[str] | None, size: int) -> None:
    """A ``BrokerError`` unless ``racks`` names one rack a node."""
    if racks is not None and (len(racks) != size or not all(r.strip() for r in racks)):
        raise BrokerError(f"--racks: {size} rack names, one a node, separated by commas "
                          f"(got {','.join(racks)!r})")


class EmbeddedCluster:
    """Start, stop and inspect a cluster of ``size`` KRaft nodes kept under ``state``."""

    def __init__(self, state: Path | str | None = None, size: int = 3,
                 racks: list[str] | None = None):
        if size < 1:
            raise BrokerError(f"a cluster needs at least one node, not {size}")
        check_racks(racks, size)
        self.state = Path(state) if state else cluster_state_dir()
        self.size = size
        self.racks = racks
        self._procs: dict[int, subprocess.Popen] = {}  # the nodes this object started

    # --------------------------------------------------------------- recorded state
    @property
    def info_file(self) -> Path:
        return self.state / "cluster.json"

    def _info(self) -> dict:
        return read_json(self.info_file)

    def node_dir(self, node_id: int) -> Path:
        return self.state / f"node-{node_id}"

    def log_file(self, node_id: int) -> Path:
        return self.node_dir(node_id) / "server.log"

    @property
    def node_ids(self) -> list[int]:
        return list(range(1, self.size + 1))

    def _ports(self) -> dict[int, tuple[int, int]]:
        nodes = self._info().get("nodes", {})
        return {int(i): (int(v["port"]), int(v["controller_port"])) for i, v in nodes.items()}

    def port(self, node_id: int) -> int:
        """Node ``node_id``'s client port (once the cluster has been started)."""
        ports = self._ports()
        if node_id not in ports:
            raise BrokerError(f"the cluster in {self.state} has no node {node_id}")
        return ports[node_id][0]

    @property
    def bootstrap(self) -> str:
        """Every node's client address, comma-separated."""
        return ",".join(f"127.0.0.1:{self.port(i)}" for i in self.node_ids)

    def pid(self, node_id: int) -> int | None:
        """Node ``node_id``'s JVM pid while it runs, else None."""
        self._reap()
        return node_pid(self.state, node_id)

    def running_bootstrap(self) -> str | None:
        """``bootstrap`` while any node runs, else None (no client call: cheap)."""
        self._reap()
        return running_cluster_bootstrap(self.state)

    def _reap(self) -> None:
        for proc in self._procs.values():
            proc.poll()  # a killed child of this process is no zombie for long

    def _rack(self, node_id: int) -> str | None:
        racks = self._info().get("racks")
        return racks[node_id - 1] if racks else None

    def status(self) -> ClusterStatus:
        """Each node, and (from the live nodes) partition leaders and under-replication."""
        if not self._ports():
            return ClusterStatus([], state_dir=str(self.state))
        nodes = []
        for i in self.node_ids:
            pid = self.pid(i)
            nodes.append(NodeStatus(i, self.port(i), pid, pid is not None, self._rack(i)))
        st = ClusterStatus(nodes, state_dir=str(self.state))
        if st.bootstrap:
            st.leaders, st.under_replicated = partition_health(st.bootstrap)
        return st

    def tail(self, lines: int = 50, node_id: int | None = None) -> str:
        """The last ``lines`` lines of one node's log, or of every node's."""
        ids = [node_id] if node_id else self.node_ids
        return "\n".join(f"--- node {i} ({self.log_file(i)})\n{tail_file(self.log_file(i), lines)}"
                         for i in ids)

    # --------------------------------------------------------------- start and stop
    @classmethod
    def recorded(cls, state: Path | str | None = None) -> EmbeddedCluster:
        """The cluster whose state is in ``state`` (default ``cluster_state_dir()``), of
        the size it was made with (3 when there is none)."""
        path = Path(state) if state else cluster_state_dir()
        return cls(path, size=int(read_json(path / "cluster.json").get("size", 3)))

    def _check_size(self) -> None:
        recorded = self._info().get("size")
        if recorded and int(recorded) != self.size:
            raise BrokerError(
                f"the cluster state {self.state} holds {recorded} nodes, not "
                f"{self.size}: `astraflow broker stop --purge` first to start afresh")

    def _prepare(self, base_port: int | None, down: list[int]) -> None:
        """Record the cluster's size, id, racks and ports: those kept from the previous
        start (waiting for the ports of the nodes in ``down`` to be free), else free ones,
        ``base_port`` + i - 1 for node i when that can be bound."""
        info = self._info()
        kept = self._ports()
        nodes = {}
        taken = {p for pair in kept.values() for p in pair}
        for i in self.node_ids:
            if i in kept:
                port, controller = kept[i]
                if i in down:
                    kept_port(port, f"node {i} client")
                    kept_port(controller, f"node {i} controller")
            else:
                port = _unused_port(taken, base_port + i - 1 if base_port else None)
                controller = _unused_port(taken)
            nodes[str(i)] = {"port": port, "controller_port": controller}
        racks = self.racks if self.racks is not None else info.get("racks")
        check_racks(racks, self.size)
        self.state.mkdir(parents=True, exist_ok=True)
        self.info_file.write_text(json.dumps({
            "size": self.size, "cluster_id": info.get("cluster_id") or _cluster_id(),
            "racks": racks, "nodes": nodes}))

    def _launch(self, node_id: int, log) -> subprocess.Popen:
        """Write node ``node_id``'s config, format its storage when new, start its JVM."""
        java, classpath, _version = server_runtime(log)
        home = self.node_dir(node_id)
        home.mkdir(parents=True, exist_ok=True)
        props = home / "server.properties"
        props.write_text(cluster_config(node_id, self._ports(), home / "data",
                                        self._rack(node_id)))
        jvm = jvm_command(java, self.state, heap_mb=NODE_HEAP_MB)
        if not (home / "data" / "meta.properties").exists():
            _format_storage(jvm, classpath, props, home / "data",
                            cluster_id=self._info()["cluster_id"], quorum=())
        proc = launch_server(jvm, classpath, props, self.log_file(node_id))
        self._procs[node_id] = proc
        (home / "pid.json").write_text(json.dumps({"pid": proc.pid,
                                                   "started_at": time.time()}))
        return proc

    def start(self, timeout: float = 120.0, log=print, base_port: int | None = None,
              ) -> ClusterStatus:
        """Start every node that does not run (all of them at once: a quorum needs a
        majority); returns once the cluster lists all ``size`` brokers. Idempotent.
        ``base_port``: node i's client port is ``base_port + i - 1`` on a first start
        when free (later starts keep the ports of the first)."""
        t0 = time.time()
        self._check_size()
        down = [i for i in self.node_ids if self.pid(i) is None]
        if not down:
            return self.status()
        self._prepare(base_port, down)
        procs = [self._launch(i, log) for i in down]
        try:
            await_serving(procs, self.bootstrap, timeout, lambda n: self.tail(n // 3),
                          brokers=self.size)
        except BrokerError:
            self.stop()
            raise
        log(f"embedded Kafka cluster of {self.size} nodes up on {self.bootstrap} in "
            f"{time.time() - t0:.1f}s")
        return self.status()

    def start_node(self, node_id: int, timeout: float = 90.0, log=print) -> None:
        """Restart node ``node_id`` (stopped or killed) from its state, on its ports;
        returns once the cluster lists it as a broker again."""
        if self.pid(node_id) is not None:
            return
        if node_id not in self._ports():
            raise BrokerError(f"the cluster in {self.state} has no node {node_id}: start it")
        for port, what in zip(self._ports()[node_id], ("client", "controller"), strict=True):
            kept_port(port, f"node {node_id} {what}")
        proc = self._launch(node_id, log)
        deadline = time.time() + timeout
        while node_id not in serving_brokers(self.bootstrap):
            if proc.poll() is not None or time.time() > deadline:
                terminate(proc.pid, 10.0)
                raise BrokerError(f"node {node_id} did not rejoin within {timeout:.0f}s; "
                                  f"last log lines:\n{self.tail(40, node_id)}")
            time.sleep(0.5)

    def kill_node(self, node_id: int) -> None:
        """SIGKILL node ``node_id`` (a crash); returns at once."""
        pid = self.pid(node_id)
        if pid is not None:
            os.kill(pid, signal.SIGKILL)

    def stop_node(self, node_id: int, timeout: float = 30.0) -> bool:
        """Shut node ``node_id`` down cleanly (SIGKILL after ``timeout``); True if it ran."""
        pid = self.pid(node_id)
        if pid is None:
            return False
        terminate(pid, timeout)
        self._reap()
        return True

    def stop(self, timeout: float = 30.0) -> bool:
        """Stop every node (all at once); True if any ran."""
        pids = [p for p in (self.pid(i) for i in self.node_ids) if p is not None]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        for pid in pids:
            terminate(pid, timeout)
        self._reap()
        return bool(pids)

    def destroy(self) -> None:
        """Stop the cluster and delete its state (data and logs)."""
        self.stop()
        shutil.rmtree(self.state, ignore_errors=True)
