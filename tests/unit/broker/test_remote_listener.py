"""The embedded broker's REMOTE listener without a broker: the config with and without it, the
expected form, the ``broker start`` flag (clients through it on a real broker:
tests/integration/broker/test_remote_pool.py)."""

from __future__ import annotations

import pytest

from astraflow.broker.embedded import _server_properties, parse_remote_listener
from astraflow.cli.main import build_parser


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

