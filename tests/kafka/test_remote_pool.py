"""A pool that reaches the broker another way (issue 18, point 4): the embedded broker's
REMOTE listener, a pool's own ``kafka:`` settings, and ``up`` handing its nodes their
bootstrap address. Only the last test starts a broker (its own)."""

from __future__ import annotations

import contextlib
import socket
import sys
import threading
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from astraflow.broker.embedded import (
    EmbeddedBroker,
    _server_properties,
    free_port,
    parse_remote_listener,
)
from astraflow.cli.context import kafka_config
from astraflow.cli.main import build_parser
from astraflow.config.topology import TopologyError, parse_topology
from astraflow.kafka.config import KafkaConfig
from astraflow.launch.plan import pool_bootstrap
from astraflow.launch.up import _spawner


def _props(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines()
                if line and not line.startswith("#"))


def test_without_a_remote_listener_the_broker_config_is_as_before(tmp_path):
    props = _props(_server_properties(19092, 19093, tmp_path))
    assert props["listeners"] == "PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093"
    assert props["advertised.listeners"] == "PLAINTEXT://127.0.0.1:19092"
    assert props["listener.security.protocol.map"] == "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT"
    assert props["inter.broker.listener.name"] == "PLAINTEXT"


def test_a_remote_listener_binds_here_and_advertises_the_proxy(tmp_path):
    props = _props(_server_properties(19092, 19093, tmp_path, (29093, "proxy.example:29094")))
    assert props["listeners"] == ("PLAINTEXT://127.0.0.1:19092,CONTROLLER://127.0.0.1:19093,"
                                  "REMOTE://127.0.0.1:29093")
    assert props["advertised.listeners"] == ("PLAINTEXT://127.0.0.1:19092,"
                                             "REMOTE://proxy.example:29094")
    assert props["listener.security.protocol.map"].endswith(",REMOTE:PLAINTEXT")
    assert props["inter.broker.listener.name"] == "PLAINTEXT"  # the broker's own traffic


@pytest.mark.parametrize("text", ["29093", "29093=proxy", "x=proxy:1", "29093=:1",
                                  "29093=proxy:port"])
def test_a_bad_remote_listener_says_the_expected_form(text):
    with pytest.raises(ValueError, match="PORT=HOST:PORT"):
        parse_remote_listener(text)


def test_broker_start_takes_a_remote_listener_flag():
    args = build_parser().parse_args(["broker", "start", "--remote-listener",
                                      "29093=10.0.0.5:9094"])
    assert args.remote_listener == (29093, "10.0.0.5:9094")
    assert build_parser().parse_args(["broker", "start"]).remote_listener is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["broker", "start", "--remote-listener", "nope"])


def _topology(remote_kafka=None, **kafka):
    pools = {"local": {}, "remote": {}}
    if remote_kafka is not None:
        pools["remote"]["kafka"] = remote_kafka
    return parse_topology({"run": "r", "kafka": kafka, "pools": pools}, source="t.yaml")


def test_a_pools_kafka_settings_merge_over_the_topologys():
    topo = _topology({"bootstrap_servers": "proxy:9094", "options": {"socket.timeout.ms": 90000},
                      "outage_limit_s": 900},
                     bootstrap_servers="broker:9092", client_id="c",
                     options={"security.protocol": "PLAINTEXT"})
    remote = topo.pool_kafka("remote")
    assert remote.bootstrap_servers == "proxy:9094"
    assert remote.options == {"security.protocol": "PLAINTEXT", "socket.timeout.ms": 90000}
    assert remote.client_id == "c" and remote.outage_limit_s == 900
    assert topo.pool_kafka("local") == topo.kafka  # the other pool: the topology's
    assert topo.pool_kafka("unknown") == topo.kafka
    assert topo.kafka.bootstrap_servers == "broker:9092"  # the topology's stays as it was


@pytest.mark.parametrize("kafka, key", [
    ({"bootstrap": "proxy:9094"}, "pools.remote.kafka.bootstrap: unknown Kafka setting"),
    ({"outage_limit_s": 0}, "pools.remote.kafka.outage_limit_s"),
    ({"options": "x"}, "pools.remote.kafka.options"),
])
def test_a_bad_pool_kafka_setting_names_its_key(kafka, key):
    with pytest.raises(TopologyError, match=f"t.yaml: {key}"):
        _topology(kafka)


def test_a_remote_node_under_up_gets_its_pools_bootstrap(tmp_path):
    topo = _topology({"bootstrap_servers": "proxy:9094"}, bootstrap_servers="broker:9092")
    assert pool_bootstrap(topo, "raas-remote-0") == "proxy:9094"
    assert pool_bootstrap(topo, "raas-remote-12") == "proxy:9094"
    assert pool_bootstrap(topo, "raas-local-0") is None
    assert pool_bootstrap(topo, "trainer-actor") is None
    (tmp_path / "logs").mkdir()
    spawn = _spawner(topo, topo.kafka, tmp_path)
    show = [sys.executable, "-c", "import os; print(os.environ['ASTRAFLOW_BOOTSTRAP'])"]
    for name in ("raas-remote-0", "raas-local-0"):
        assert spawn(name, show).wait(60) == 0
    assert (tmp_path / "logs" / "raas-remote-0.log").read_text().strip() == "proxy:9094"
    assert (tmp_path / "logs" / "raas-local-0.log").read_text().strip() == "broker:9092"


def test_a_raas_node_run_by_hand_takes_its_pools_settings(monkeypatch):
    monkeypatch.delenv("ASTRAFLOW_BOOTSTRAP", raising=False)
    topo = _topology({"bootstrap_servers": "proxy:9094"}, bootstrap_servers="broker:9092")
    args = build_parser().parse_args(["raas", "run", "-t", "t.yaml", "--pool", "remote",
                                      "--policy-model", "actor=m"])
    args.loaded_topology = topo
    assert kafka_config(args, topo.pool_kafka("remote")).bootstrap_servers == "proxy:9094"
    assert kafka_config(args).bootstrap_servers == "broker:9092"
    monkeypatch.setenv("ASTRAFLOW_BOOTSTRAP", "env:9092")  # as everywhere, the env wins
    assert kafka_config(args, topo.pool_kafka("remote")).bootstrap_servers == "env:9092"


@contextlib.contextmanager
def tcp_forward(port: int, upstream: int) -> Iterator[list[int]]:
    """A plain TCP forward from 127.0.0.1:``port`` to 127.0.0.1:``upstream`` (a thread per
    direction per connection); yields the list of connections it accepted so far."""
    server = socket.create_server(("127.0.0.1", port))
    server.settimeout(0.2)
    accepted: list[int] = []
    stop = threading.Event()

    def pipe(src: socket.socket, dst: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        with contextlib.suppress(OSError):
            dst.shutdown(socket.SHUT_WR)

    def serve() -> None:
        while not stop.is_set():
            try:
                client, _ = server.accept()
            except TimeoutError:
                continue
            accepted.append(1)
            up = socket.create_connection(("127.0.0.1", upstream))
            for a, b in ((client, up), (up, client)):
                threading.Thread(target=pipe, args=(a, b), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        server.close()


def _consume_one(bootstrap: str, topic: str) -> bytes:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{topic}",
                  "auto.offset.reset": "earliest", "enable.partition.eof": True})
    c.subscribe([topic])
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            m = c.poll(1.0)
            if m is not None and not m.error():
                return m.value()
            if m is not None and m.error().code() != KafkaError._PARTITION_EOF:
                raise AssertionError(m.error())
        raise AssertionError(f"nothing consumed from {topic} through {bootstrap}")
    finally:
        c.close()


@pytest.mark.kafka  # starts its own embedded broker (not the session's)
@pytest.mark.slow
def test_clients_behind_a_forward_produce_and_consume_through_the_remote_listener(tmp_path):
    forward_port, remote_port = free_port(), free_port()
    broker = EmbeddedBroker(tmp_path / "state")
    try:
        st = broker.start(port=free_port(), log=lambda *_: None,  # not 19092 (test_broker_restart)
                          remote_listener=(remote_port, f"127.0.0.1:{forward_port}"))
        assert st.remote == (remote_port, f"127.0.0.1:{forward_port}")
        assert "remote listener" in st.describe()
        with tcp_forward(forward_port, remote_port) as accepted:
            via = f"127.0.0.1:{forward_port}"
            admin = AdminClient(KafkaConfig(bootstrap_servers=via).admin_conf())
            md = admin.list_topics(timeout=30)
            assert [(b.host, b.port) for b in md.brokers.values()] == [("127.0.0.1",
                                                                        forward_port)]
            for f in admin.create_topics([NewTopic("far", 1, 1)]).values():
                f.result(30)
            p = Producer({"bootstrap.servers": via})
            p.produce("far", b"over the link")
            assert p.flush(30) == 0
            assert _consume_one(via, "far") == b"over the link"
            assert accepted  # every connection went through the forward
        local = AdminClient({"bootstrap.servers": st.bootstrap}).list_topics(timeout=30)
        assert [b.port for b in local.brokers.values()] == [int(st.bootstrap.split(":")[1])]
        broker.stop()  # a restart without the flag keeps the listener: its clients know it
        again = broker.start(log=lambda *_: None)
        assert (again.bootstrap, again.remote) == (st.bootstrap, st.remote)
    finally:
        broker.destroy()
