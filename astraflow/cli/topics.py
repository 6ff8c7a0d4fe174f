"""``astraflow topics apply|list|describe`` and ``astraflow groups lag``: a run's topics and the
consumer groups on them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from astraflow.cli.args import (
    add_command,
    add_group,
    add_run_options,
)
from astraflow.cli.context import kafka_config, run_name
from astraflow.config.topology import (  # with_overrides: also for cli.replay
    Topology,
)
from astraflow.errors import AstraflowError


def _full_name(run: str | None, topic: str) -> str:
    """``topic`` with the run prefix, unless it has it already (or there is no run)."""
    return topic if run is None or topic.startswith(f"{run}.") else f"{run}.{topic}"


def cmd_topics_apply(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import apply_topics

    topo: Topology = args.loaded_topology
    config = kafka_config(args)
    changes = apply_topics(make_admin(config), topo.resolved_topics())
    for c in changes:
        print(f"{c.action:9}  {c.topic}" + (f"  ({c.detail})" if c.detail else ""))
    print(f"{len(changes)} topics of run {topo.run!r} on {config.bootstrap_servers}")
    return 0


def cmd_topics_list(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin

    config = kafka_config(args)
    topics = make_admin(config).list_topics(timeout=10).topics
    run = run_name(args)
    prefix = f"{run}." if run else ""
    for name in sorted(topics):
        if name.startswith("__") or not name.startswith(prefix):
            continue
        print(f"{name}  ({len(topics[name].partitions)} partitions)")
    return 0


def cmd_topics_describe(args: argparse.Namespace) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import describe_topic

    config = kafka_config(args)
    name = _full_name(run_name(args), args.topic)
    print(json.dumps(describe_topic(make_admin(config), name), indent=2))
    return 0


def cmd_groups_lag(args: argparse.Namespace) -> int:
    from astraflow.kafka.lag import LagReader, format_lag_table

    pairs: list[tuple[str, list[str]]] = []
    topo: Topology | None = args.loaded_topology
    if args.group:
        topics = [_full_name(run_name(args), t) for t in args.topic or []]
        if not topics:
            raise AstraflowError(
                "groups lag: --group needs --topic (or a --topology naming the group's "
                "processor)"
            )
        pairs.append((args.group, topics))
    elif topo:  # every group: processors, RaaS pools, trainers
        for _, group, inputs in topo.consumer_groups():
            pairs.append((group, [topo.full_name(t) for t in inputs]))
    else:
        raise AstraflowError("groups lag: give --topology FILE, or --group G --topic T")
    reader = LagReader(kafka_config(args))
    rows = []
    try:
        for group, topics in pairs:
            rows += reader.lag(group, topics)
    finally:
        reader.close()
    print(format_lag_table(rows))
    return 0


def _add_topics(sub: Any) -> None:
    verbs = add_group(sub, "topics", help="create and inspect a run's topics", dest="action",
                      examples=["astraflow topics apply -t topology/default.yaml",
                                "astraflow topics list -t topology/default.yaml"])
    p = add_command(
        verbs, "apply", help="create or update the topics of a topology (idempotent)",
        description="Create the topology's missing topics, add partitions and set the configs "
        "of existing ones. Running it again changes nothing.",
        examples=["astraflow topics apply -t topology/default.yaml",
                  "astraflow topics apply -t topology/default.yaml --run trial2"
                  "   # a second run's topics",
                  "astraflow topics apply topology/default.yaml   # older spelling"])
    add_run_options(p, positional=True)
    p.set_defaults(func=cmd_topics_apply)
    p = add_command(verbs, "list", help="list topics (of one run with --topology or --run)",
                    examples=["astraflow topics list -t topology/default.yaml",
                              "astraflow topics list --run default",
                              "astraflow topics list   # every run's"])
    add_run_options(p, required=False)
    p.set_defaults(func=cmd_topics_list)
    p = add_command(verbs, "describe", help="partitions and configs of a topic",
                    examples=["astraflow topics describe tasks -t topology/default.yaml",
                              "astraflow topics describe default.weights.actor"])
    p.add_argument("topic", metavar="TOPIC",
                   help="the topic, with its run prefix or without (given a topology or --run)")
    add_run_options(p, required=False)
    p.set_defaults(func=cmd_topics_describe)


_LAG_EXAMPLES = ["astraflow groups lag -t topology/default.yaml   # every group of the run",
                 "astraflow groups lag --group default.batcher --topic default.samples.actor"]


def _add_lag(verbs: Any, name: str, hidden: bool = False) -> None:
    p = add_command(verbs, name, help="consumer-group lag per partition",
                    examples=_LAG_EXAMPLES, hidden=hidden)
    add_run_options(p, required=False)
    p.add_argument("--group", "-g", help="one consumer group (default: every processor's)")
    p.add_argument("--topic", action="append", metavar="TOPIC",
                   help="topic of --group (repeatable; the run prefix is added when missing)")
    p.set_defaults(func=cmd_groups_lag)


def _add_groups(sub: Any) -> None:
    verbs = add_group(sub, "groups", help="consumer groups: how far behind they are",
                      dest="action", examples=_LAG_EXAMPLES)
    _add_lag(verbs, "lag")
    _add_lag(sub, "lag", hidden=True)  # `astraflow lag`, the older spelling


def register(subparsers: Any) -> None:
    """Add the ``topics`` and ``groups`` command groups to ``astraflow``."""
    _add_topics(subparsers)
    _add_groups(subparsers)
