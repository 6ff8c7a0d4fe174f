"""``astraflow status``: a running topology at a glance, live or once."""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from astraflow.launch.status import StatusReader, render

_EXAMPLES = ["astraflow status -t topology/default.yaml",
             "astraflow status -t topology/default.yaml --once --json | jq .groups"]


# --- the command ---------------------------------------------------------------------------
def register(subparsers: Any) -> None:
    from astraflow.cli.args import add_command, add_run_options

    p = add_command(subparsers, "status", help="a running topology: components, rates, lag "
                    "on every edge, staleness drops, dlq", examples=_EXAMPLES,
                    description="A live view of a running topology, refreshed every "
                    "--interval seconds: every component with its weight versions, records/s "
                    "in and out, dead letters and waiting fraction; the lag of every consumer "
                    "group (RaaS pools, processors, trainers); groups dropped as stale in the "
                    "filter, the batcher and the trainer; the dlq's size. --once prints it "
                    "once; --json as JSON.")
    add_run_options(p)
    p.add_argument("--once", action="store_true", help="print once and exit")
    p.add_argument("--json", action="store_true", help="JSON (with --once: one document)")
    p.add_argument("--interval", type=float, default=2.0, help="seconds between refreshes")
    p.set_defaults(func=cmd_status)


def cmd_status(args: argparse.Namespace) -> int:
    from confluent_kafka import KafkaException

    from astraflow.cli.context import kafka_config
    from astraflow.errors import AstraflowError

    topo = args.loaded_topology
    try:
        reader = StatusReader(topo, kafka_config(args))
    except KafkaException as e:
        raise AstraflowError(f"status: cannot read {topo.full_name('status')}: {e}; has run "
                             f"{topo.run} been started (`astraflow run list`)?") from None
    try:
        if args.once:
            snap = reader.read()
            if args.json:
                print(json.dumps(snap, indent=2))
            else:
                from rich.console import Console

                Console().print(render(snap))
            return 0
        return _live(reader, args)
    finally:
        reader.close()


def _live(reader: StatusReader, args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    try:
        if args.json:  # one JSON document per line, every interval
            while True:
                print(json.dumps(reader.read()), flush=True)
                time.sleep(args.interval)
        with Live(render(reader.read()), console=Console(), refresh_per_second=4) as live:
            while True:
                time.sleep(args.interval)
                live.update(render(reader.read()))
    except KeyboardInterrupt:
        return 0
