"""The embedded broker keeps its ports and its data across stop/start and a crash."""

from __future__ import annotations

import json
import os
import signal
import socket
import time

import pytest
from confluent_kafka import Consumer, KafkaError, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from astraflow.broker.embedded import (
    BrokerError,
    EmbeddedBroker,
    _pid_alive,
    free_port,
    kept_port,
)
from tests.conftest import wait_for


def _produce(bootstrap: str, topic: str, value: bytes) -> None:
    delivered: list = []
    p = Producer({"bootstrap.servers": bootstrap})
    p.produce(topic, value, partition=0, on_delivery=lambda err, _m: delivered.append(err))
    assert p.flush(30) == 0 and delivered == [None], delivered


def _values(bootstrap: str, topic: str) -> list[bytes]:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "x", "enable.auto.commit": False,
                  "enable.partition.eof": True})
    c.assign([TopicPartition(topic, 0, 0)])
    out: list[bytes] = []
    deadline = time.time() + 30
    while time.time() < deadline:
        m = c.poll(1.0)
        if m is None:
            continue
        if m.error():
            if m.error().code() == KafkaError._PARTITION_EOF:
                break
            continue
        out.append(m.value())
    c.close()
    return out


@pytest.mark.kafka  # starts its own embedded broker (not the session's)
@pytest.mark.slow
def test_broker_keeps_port_and_data_across_stop_and_crash(tmp_path):
    broker = EmbeddedBroker(tmp_path / "state")
    try:
        # a free port, not the default 19092: a broker another worker starts while this one
        # is stopped would take 19092, and this test's clients would reach that broker
        st = broker.start(port=free_port(), log=lambda *_: None)
        bootstrap = st.bootstrap
        admin = AdminClient({"bootstrap.servers": bootstrap})
        for f in admin.create_topics([NewTopic("kept", 1, 1)]).values():
            f.result(30)
        _produce(bootstrap, "kept", b"one")  # client connections are left behind
        assert broker.stop()
        # the clients' connections are in TIME_WAIT on the broker's port now
        st = broker.start(log=lambda *_: None)
        assert st.bootstrap == bootstrap
        _produce(bootstrap, "kept", b"two")
        assert _values(bootstrap, "kept") == [b"one", b"two"]

        pid = int(json.loads(broker.info_file.read_text())["pid"])
        os.kill(pid, signal.SIGKILL)  # a crash: no clean shutdown
        wait_for(lambda: not _pid_alive(pid), 30, f"the killed broker (pid {pid}) to exit")
        assert broker.status().running is False
        st = broker.start(log=lambda *_: None)
        assert st.bootstrap == bootstrap
        assert _values(bootstrap, "kept") == [b"one", b"two"]
    finally:
        broker.destroy()


def test_a_kept_port_held_by_another_process_is_a_clear_error():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"client port {port} .*in use by another"):
            kept_port(port, "client", wait_s=0.5)
    assert kept_port(port, "client") == port  # free again
