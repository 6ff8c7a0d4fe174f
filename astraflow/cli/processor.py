"""``astraflow processor run|list``: one stream processor of a topology, and the kinds there are."""

from __future__ import annotations

import argparse
import logging
from typing import Any

from astraflow.cli.args import (
    add_command,
    add_group,
    add_run_options,
)
from astraflow.cli.context import kafka_config
from astraflow.config.topology import (  # with_overrides: also for cli.replay
    Topology,
)
from astraflow.kafka.shutdown import stop_on_signals


# --- processors --------------------------------------------------------------------------
def cmd_processor_run(args: argparse.Namespace) -> int:
    from astraflow.dataflow.runtime import ProcessorRuntime

    topo: Topology = args.loaded_topology
    runtime = ProcessorRuntime(topo, args.name, instance=args.instance, config=kafka_config(
        args, topo.component_kafka(f"processor.{args.name}")))

    stop_on_signals(runtime.stop, logging.getLogger("astraflow"), "finishing the open transaction")
    counters = runtime.run()
    print(
        f"{runtime.component_id}: consumed {counters.consumed}, produced {counters.produced}, "
        f"dead-lettered {counters.dead_lettered}, {counters.transactions} transactions"
    )
    return 0


def cmd_processor_list(args: argparse.Namespace) -> int:
    from astraflow.dataflow import PROCESSOR_KINDS

    topo: Topology | None = args.loaded_topology
    if topo is None:
        for kind, cls in sorted(PROCESSOR_KINDS.items()):
            doc = (cls.__doc__ or "").strip().splitlines()[0] if cls.__doc__ else ""
            print(f"{kind:20} {doc}")
        return 0
    for name, spec in topo.processors.items():
        print(f"{name:20} {spec.kind:16} {','.join(spec.inputs)} -> {','.join(spec.outputs)}")
    return 0


def _add_processor(sub: Any) -> None:
    verbs = add_group(sub, "processor", help="run stream processors", dest="action",
                      examples=["astraflow processor list -t topology/default.yaml",
                                "astraflow processor run batcher -t topology/default.yaml"])
    p = add_command(
        verbs, "run", help="run one processor of a topology until SIGTERM",
        description="Run the processor NAME of the topology in its consumer group, its "
        "outputs and the offsets they came from committed together in Kafka transactions. "
        "Start more copies (each its own --instance) to share its partitions.",
        examples=["astraflow processor run batcher -t topology/default.yaml",
                  "astraflow processor run router -t topology/default.yaml --instance r2"])
    p.add_argument("name", metavar="NAME", help="the processor's name in the topology")
    add_run_options(p)
    p.add_argument(
        "--instance",
        help="instance id, unique per running copy (default: $ASTRAFLOW_INSTANCE, else the "
        "container id in a container, else the host name)",
    )
    p.set_defaults(func=cmd_processor_run)
    p = add_command(verbs, "list", help="processor kinds, or a topology's processors",
                    examples=["astraflow processor list", "astraflow processor list -t "
                              "topology/default.yaml"])
    add_run_options(p, required=False, bootstrap=False)
    p.set_defaults(func=cmd_processor_list)


def register(subparsers: Any) -> None:
    """Add the ``processor`` command group to ``astraflow``."""
    _add_processor(subparsers)
