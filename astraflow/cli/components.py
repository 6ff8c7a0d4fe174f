"""The configuration a component's command line runs with, without running it.

``configuration(argv)`` parses an ``astraflow trainer|raas|eval|feeder run`` command line
as the command does and builds the typed configuration its handler builds: the
component's section of the topology file with the flags of ``argv`` applied. A command
started by hand, by ``astraflow up`` (``astraflow.launch.plan.plan_processes``) or by a
compose service is compared by its configuration. (The configuration of a process of
``up``'s plan without its command line: ``astraflow.launch.components``.)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from astraflow.launch.components import NodeConfiguration


def configuration(argv: Sequence[str], topo: Any = None) -> Any:
    """The typed configuration of the component command line ``argv`` (without the
    leading ``astraflow``; ``topo``: its topology, else the file it names):
    ``ServiceOptions`` for ``trainer run``, a ``NodeConfiguration`` for ``raas run``,
    ``EvalSettings`` for ``eval run`` and ``FeederSpec`` for ``feeder run``. ``ValueError``
    names a refused flag or key."""
    from astraflow.cli import eval as eval_cli
    from astraflow.cli import feeder, raas, trainer
    from astraflow.cli.context import load_run_topology
    from astraflow.cli.main import build_parser

    args = build_parser().parse_args(list(argv))
    topo = topo or load_run_topology(args)
    command = (args.command, getattr(args, f"{args.command}_command", None))
    if command == ("trainer", "run"):
        return trainer._options(args, topo)
    if command == ("raas", "run"):
        node = raas.settings(args, topo)
        return NodeConfiguration(node, raas.node_options(args, node))
    if command == ("eval", "run"):
        return eval_cli.settings(args, topo)
    if command == ("feeder", "run"):
        return feeder.settings(args, topo)
    raise ValueError(f"`astraflow {' '.join(argv)}`: not a component's run command")
