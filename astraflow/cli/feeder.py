"""``astraflow feeder run``: write the topology's tasks to ``<run>.tasks.source``.

Its settings are the topology's ``feeder:``; each flag overrides one of them
(``astraflow.config.overrides.FEEDER_FLAGS``). ``astraflow.dataflow.feeder.feed`` runs it.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from typing import Any

from astraflow.cli.args import add_command, add_group, add_run_options
from astraflow.cli.context import component_topology
from astraflow.cli.flags import add_flags, given
from astraflow.config.overrides import FEEDER_FLAGS

_EXAMPLES = [
    "astraflow feeder run -t topology/default.yaml",
    "astraflow feeder run -t topology/default.yaml --epochs 0 --rate 60   # forever",
    "astraflow feeder run -t topology/default.yaml --dataset data/addition.train.jsonl",
    "astraflow feeder run -t topology/default.yaml --dataset gsm8k.parquet "
    "--prompt-field question --answer-field answer",
    "astraflow feeder run -t topology/default.yaml --task-family code --levels 1,2,3 --count 500",
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``feeder`` command group (``feeder run``) to ``subparsers``."""
    verbs = add_group(subparsers, "feeder", help="feed tasks from a dataset into tasks.source",
                      dest="feeder_command", examples=_EXAMPLES[:1])
    r = add_command(
        verbs, "run",
        help="write Task records to <run>.tasks.source",
        description=(
            "Write Task records (keyed by prompt id) to the topology's tasks.source topic: "
            "synthetic arithmetic (--levels) or a local JSONL/Parquet file (--dataset), for "
            "--epochs passes in seeded order, at --rate tasks/s, at most --count tasks. The "
            "settings are the topology's feeder:; a flag of the same name overrides one."
        ),
        examples=_EXAMPLES,
    )
    add_run_options(r)
    add_flags(r, FEEDER_FLAGS)
    r.set_defaults(func=cmd_feeder_run)
    return subparsers.choices["feeder"]


def settings(args: argparse.Namespace, topo: Any = None) -> Any:
    """The feeder's ``FeederSpec``: the topology's (``topo``, else the file of
    ``--topology``) with the flags given applied (``ValueError`` names a refused flag)."""
    from astraflow.config.components import feeder_spec

    topo = component_topology(args, topo)
    return feeder_spec(topo, given(args, FEEDER_FLAGS))


def cmd_feeder_run(args: argparse.Namespace) -> int:
    from astraflow.dataflow.feeder import feed

    stop = threading.Event()
    previous = {}
    try:
        topo = component_topology(args)
        spec = settings(args, topo)
        config = topo.component_kafka("feeder").effective()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                previous[sig] = signal.signal(sig, lambda *_: stop.set())
        result = feed(topo, spec, config, stop)
    except ValueError as e:  # a TopologyError, a DatasetError, nothing to feed
        print(f"astraflow: {e}", file=sys.stderr)
        return 2
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print(json.dumps(result), flush=True)
    return 0
