"""What every command handler shares: the run's topology as the command line gives it
(``--topology``, ``--run``, ``--bootstrap``), its Kafka configuration, and a clean stop on
SIGTERM or SIGINT."""

from __future__ import annotations

import argparse
import os

from astraflow.config.topology import (
    Topology,
    load_topology,
    with_overrides,
)
from astraflow.errors import AstraflowError
from astraflow.kafka.config import KafkaConfig


def kafka_config(args: argparse.Namespace, base: KafkaConfig | None = None) -> KafkaConfig:
    """The topology's Kafka config (or ``base``: a pool's), ``--bootstrap`` applied, then
    made effective (``ASTRAFLOW_BOOTSTRAP`` wins, else the embedded broker)."""
    topology: Topology | None = getattr(args, "loaded_topology", None)
    if base is None:
        base = topology.kafka if topology else KafkaConfig()
    if getattr(args, "bootstrap", None):
        base = base.model_copy(update={"bootstrap_servers": args.bootstrap})
    return base.effective()


def run_name(args: argparse.Namespace) -> str | None:
    """The run a command works on: the loaded topology's (``--run`` applied), else ``--run``
    or ``$ASTRAFLOW_RUN`` alone (commands whose topology is optional), else ``None``."""
    topo: Topology | None = getattr(args, "loaded_topology", None)
    if topo is not None:
        return topo.run
    return getattr(args, "run", None) or os.environ.get("ASTRAFLOW_RUN") or None


def load_run_topology(args: argparse.Namespace) -> Topology | None:
    """The topology of ``--topology`` with ``--run`` (else ``$ASTRAFLOW_RUN``) and
    ``--bootstrap`` applied; ``None`` for a command without one."""
    path = getattr(args, "topology", None)
    if not (isinstance(path, str) and path):
        command = getattr(args, "topology_required", None)
        if command:
            raise AstraflowError(f"{command}: give the topology: --topology FILE")
        return None
    run = getattr(args, "run", None)
    if run is None and hasattr(args, "run"):  # a command with --run: the environment's
        run = os.environ.get("ASTRAFLOW_RUN") or None
    return with_overrides(load_topology(path), run, getattr(args, "bootstrap", None))


def component_topology(args: argparse.Namespace, topo: Topology | None = None) -> Topology:
    """The topology a component command works on: ``topo`` when given, else the one
    ``main`` loaded (``--run`` and ``--bootstrap`` applied), else the file of
    ``--topology`` as it is (a handler called without ``main``, e.g. by a bench)."""
    return topo or getattr(args, "loaded_topology", None) or load_topology(args.topology)
