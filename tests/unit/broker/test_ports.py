"""The broker's port: one asked for and taken is a one-line error; the default one taken
gives way to a free port, said in a line."""

from __future__ import annotations

import socket

import pytest

from astraflow.broker import embedded
from astraflow.broker.embedded import BrokerError, EmbeddedBroker


@pytest.fixture
def taken():
    """A port another process holds (a listening socket)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_port_asked_for_and_taken_is_one_line(tmp_path, taken):
    with pytest.raises(BrokerError) as e:
        EmbeddedBroker(tmp_path)._choose_ports(taken, log=lambda _m: None)
    assert str(e.value).startswith(f"port {taken} on 127.0.0.1 is in use by another process")
    assert "--port" in str(e.value) and "\n" not in str(e.value)


def test_the_default_port_taken_gives_way_and_says_so(tmp_path, taken, monkeypatch):
    monkeypatch.setattr(embedded, "DEFAULT_PORT", taken)
    lines: list[str] = []
    for asked in (None, 0):
        port, controller = EmbeddedBroker(tmp_path)._choose_ports(asked, log=lines.append)
        assert port not in (taken, 0) and controller not in (taken, 0, port)
    assert lines[0].startswith(f"port {taken} is in use by another process: the broker "
                               f"listens on ")
    assert len(lines) == 2
