"""``astraflow run up|down`` and their shortcuts ``up`` and ``down``.

The command line of ``astraflow.launch.up``: it builds the ``UpOptions`` of ``up``; the
launcher imports nothing of the command line.
"""

from __future__ import annotations

import argparse
from typing import Any

from astraflow.cli.args import add_cluster_options, add_command, add_group, add_run_options

_UP_EXAMPLES = [
    "astraflow run up -t topology/default.yaml",
    "astraflow run up -t topology/default.yaml --duration 0        # until Ctrl-C",
    "astraflow run up -t topology/default.yaml --run trial2 --fresh",
    "astraflow up topology/default.yaml --versions 20             # the shortcut",
    "astraflow up topology/default.yaml --secure     # SASL_SSL, one principal per component",
    "astraflow up topology/default.yaml --brokers 3  # on a 3-node cluster, replication 3",
]
_DOWN_EXAMPLES = ["astraflow run down -t topology/default.yaml",
                  "astraflow down topology/default.yaml   # the shortcut"]


def register(subparsers: Any) -> None:
    """Add ``run up|down`` and their shortcuts ``up`` and ``down`` to ``subparsers``."""
    verbs = add_group(subparsers, "run", help="a whole run as local processes: up, down",
                      dest="run_command", examples=[*_UP_EXAMPLES[:1], *_DOWN_EXAMPLES[:1]])
    for where, shortcut in ((verbs, False), (subparsers, True)):  # `astraflow up`: shortcut
        _add_up(where, shortcut)
        _add_down(where, shortcut)


def _add_up(subparsers: Any, shortcut: bool) -> None:
    p = add_command(
        subparsers, "up", help="shortcut of `run up`" if shortcut else
        "run a whole topology locally, with live progress",
        description="Start the embedded broker if needed, apply the topics, write missing "
        "tiny models, then run every component of the topology as its own process (logs "
        "under RUNS_DIR/<run>/logs) until --duration or --versions; print progress, then "
        "stop them and write the run's summary.json. Each component is started with the "
        "topology file and its identity only, and reads its settings from the file.",
        examples=_UP_EXAMPLES)
    add_run_options(p, positional=True)
    p.add_argument("--runs-dir", default="runs", help="where logs and summaries go")
    p.add_argument("--duration", type=float, default=600.0, help="seconds to run (0: forever)")
    p.add_argument("--versions", type=int, default=0, help="stop after this many versions")
    p.add_argument("--fresh", action="store_true",
                   help="start from version 0: under the next free name RUN-N if RUN already "
                   "has topics (they stay; `astraflow run delete RUN` removes them)")
    p.add_argument("--keep-broker", action="store_true",
                   help="leave the embedded broker running when the run ends (default: stop "
                   "it if this `up` started it)")
    add_cluster_options(p, "run on the embedded cluster (`broker start --brokers N`), "
                        "started if needed and stopped at the end if started here")
    p.add_argument("--secure", action="store_true",
                   help="run on the secured embedded broker (SASL_SSL, ACLs enforced), each "
                   "component as its own principal with exactly the ACLs `topology acls` "
                   "prints, weights signed and verified (docs/security.md)")
    p.set_defaults(func=cmd_up)


def _add_down(subparsers: Any, shortcut: bool) -> None:
    d = add_command(subparsers, "down", help="shortcut of `run down`" if shortcut else
                    "stop what `astraflow up` started",
                    examples=_DOWN_EXAMPLES)
    add_run_options(d, positional=True, bootstrap=False)
    d.add_argument("--runs-dir", default="runs", help="where `up` wrote the run's process ids")
    d.set_defaults(func=cmd_down)


def up_options(args: argparse.Namespace) -> Any:
    """The ``UpOptions`` of a parsed ``up`` command line."""
    from astraflow.launch.up import UpOptions

    return UpOptions(topology=args.topology, runs_dir=args.runs_dir, duration=args.duration,
                     versions=args.versions, fresh=args.fresh, keep_broker=args.keep_broker,
                     brokers=args.brokers, racks=args.racks, secure=args.secure)


def cmd_up(args: argparse.Namespace) -> int:
    from astraflow.launch.up import up

    return up(up_options(args), args.loaded_topology)


def cmd_down(args: argparse.Namespace) -> int:
    from astraflow.launch.up import down

    return down(args.runs_dir, args.loaded_topology)
