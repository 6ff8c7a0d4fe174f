"""``astraflow run list`` and ``astraflow run delete``: the runs a cluster holds."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

_LIST_EXAMPLES = ["astraflow run list",
                  "astraflow run list --topics          # each run's topics too",
                  "astraflow run list --json --bootstrap kafka:9092"]
_DELETE_EXAMPLES = ["astraflow run delete trial2 --yes",
                    "astraflow run delete default-3      # asks first"]


def register(subparsers: Any) -> None:
    """Add ``list`` and ``delete`` to the ``run`` group (``astraflow.launch.up`` makes it)."""
    from astraflow.cli.args import add_command, verbs_of

    verbs = verbs_of(subparsers, "run")
    p = add_command(verbs, "list", help="the runs on the cluster: topics, records, size, "
                    "time span, versions", examples=_LIST_EXAMPLES,
                    description="List the runs whose topics the cluster holds (a run is the "
                    "prefix of its topics; every run has a status and a dlq topic): per run "
                    "its topic count, records (offsets retained), size on disk (the embedded "
                    "broker only; ? elsewhere), first and last record time, and the newest "
                    "weight version of each policy.")
    p.add_argument("--bootstrap", metavar="SERVERS", help="Kafka bootstrap servers "
                   "(default $ASTRAFLOW_BOOTSTRAP, else the embedded broker)")
    p.add_argument("--topics", action="store_true", help="also list each run's topics")
    p.add_argument("--json", action="store_true", help="one JSON document, for scripts")
    p.set_defaults(func=cmd_run_list)
    d = add_command(verbs, "delete", help="delete a run: its topics and consumer groups",
                    examples=_DELETE_EXAMPLES,
                    description="Delete every topic and consumer group of RUN. What replay "
                    "works from goes with them; nothing else deletes a run's topics.")
    d.add_argument("name", metavar="RUN", help="the run's name (see `astraflow run list`)")
    d.add_argument("--bootstrap", metavar="SERVERS", help="Kafka bootstrap servers")
    d.add_argument("--yes", "-y", action="store_true", help="do not ask first")
    d.set_defaults(func=cmd_run_delete)


def cmd_run_list(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.launch.runs import Runs, format_runs, format_topics

    runs = Runs(kafka_config(args))
    topics = runs.topics()
    summaries = [runs.summary(name, topics) for name in runs.names()]
    if args.json:
        print(json.dumps({"bootstrap": runs.config.bootstrap_servers,
                          "runs": [s.to_dict() for s in summaries]}, indent=2))
        return 0
    if not summaries:
        print(f"no runs on {runs.config.bootstrap_servers}")
        return 0
    print(format_runs(summaries))
    if args.topics:
        for s in summaries:
            print(f"\n{s.run}:\n{format_topics(s)}")
    return 0


def cmd_run_delete(args: argparse.Namespace) -> int:
    from astraflow.cli.context import kafka_config
    from astraflow.launch.runs import Runs, human_bytes

    runs = Runs(kafka_config(args))
    summary = runs.summary(args.name)  # RunNotFound: one line, exit 2
    if not args.yes:
        if not sys.stdin.isatty():
            raise SystemExit(f"astraflow run delete: run {args.name!r} has "
                             f"{len(summary.topics)} topics; add --yes to delete them")
        answer = input(f"delete run {args.name!r}: {len(summary.topics)} topics, "
                       f"{summary.records} records, {human_bytes(summary.bytes)}? [y/N] ")
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing deleted")
            return 1
    topics, groups, kept = runs.delete(args.name)
    print(f"deleted run {args.name}: {len(topics)} topics, {len(groups)} consumer groups")
    for g, why in kept.items():
        print(f"kept consumer group {g}: {why}")
    return 0
