"""docker-compose.yml: every service command is a real `astraflow` subcommand."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from astraflow.cli import build_parser
from astraflow.topology import load_topology

REPO = Path(__file__).resolve().parents[1]
COMPOSE = yaml.safe_load((REPO / "docker-compose.yml").read_text())
SERVICES = COMPOSE["services"]


def test_kafka_service_is_apache_kafka_with_healthcheck():
    kafka = SERVICES["kafka"]
    assert kafka["image"].startswith("apache/kafka:")
    assert "healthcheck" in kafka
    assert kafka["environment"]["KAFKA_PROCESS_ROLES"] == "broker,controller"  # KRaft


@pytest.mark.parametrize("name", [n for n in SERVICES if n != "kafka"])
def test_service_command_is_an_astraflow_subcommand(name):
    command = SERVICES[name]["command"]
    assert isinstance(command, list) and command[0] == "astraflow", command
    parser = build_parser()
    try:
        args = parser.parse_args(command[1:])
    except SystemExit as e:  # argparse exits on an unknown subcommand or option
        pytest.fail(f"service {name}: `{' '.join(command)}` is not a valid command ({e})")
    assert callable(args.func)
    topology = getattr(args, "topology", None)
    if topology:
        topo = load_topology(REPO / topology)
        if getattr(args, "name", None) and args.command == "processor":
            assert args.name in topo.processors, f"{args.name} not in {topology}"


def test_every_processor_of_the_default_topology_has_a_service():
    topo = load_topology(REPO / "topology" / "default.yaml")
    run_services = {
        s["command"][3] for s in SERVICES.values()
        if s.get("command", [None])[:3] == ["astraflow", "processor", "run"]
    }
    assert set(topo.processors) <= run_services
