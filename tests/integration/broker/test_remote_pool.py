"""A pool that reaches the broker another way, on a real broker: clients behind a TCP forward
produce and consume through the embedded broker's REMOTE listener (the test starts its own
broker; the settings without a broker: tests/unit/broker/test_remote_listener.py,
tests/unit/launch/test_remote_pool.py)."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from confluent_kafka import Consumer, KafkaError, Producer
from confluent_kafka.admin import AdminClient, NewTopic

from astraflow.broker.embedded import EmbeddedBroker, free_port
from astraflow.kafka.config import KafkaConfig


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
