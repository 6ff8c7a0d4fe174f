"""``astraflow raas run``: one RaaS node of a pool.

``register(subparsers)`` adds the ``raas`` command group; ``astraflow.cli.main`` wires it in.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from typing import Any

from astraflow.cli.args import Option, add_command, add_group, add_run_options, add_table
from astraflow.cli.context import component_topology
from astraflow.cli.flags import add_flags, given
from astraflow.config.overrides import NODE_FLAGS


def _check_workflows(options: dict[str, dict[str, Any]]) -> None:
    """Build every configured workflow once, so bad options fail at start, not per task."""
    from astraflow.raas.workflows import make_workflow

    for name, opts in options.items():
        try:
            make_workflow(name, **opts)
        except Exception as e:  # noqa: BLE001 - reported as one line naming the workflow
            raise SystemExit(f"astraflow raas run: --workflow-options {name}: {e}") from None


def settings(args: argparse.Namespace, topo: Any = None) -> Any:
    """The ``NodeSettings`` of ``raas run``: the pool's typed section of the topology
    (``topo``, else the file of ``--topology``) and its policies, with the flags given
    applied (``ValueError`` names a refused flag)."""
    from astraflow.config.components import node_settings

    topo = component_topology(args, topo)
    return node_settings(topo, args.pool, given(args, NODE_FLAGS))


def node_options(args: argparse.Namespace, node: Any = None) -> Any:
    """The ``NodeOptions`` of ``raas run`` (its ``settings``, else built from ``args``;
    the workflow options are not checked here: ``cmd_raas_run`` builds each workflow once
    first)."""
    from astraflow.raas.node import NodeOptions

    return NodeOptions.from_settings(node or settings(args), instance=args.instance)


def node_rack(args: argparse.Namespace) -> str | None:
    """The node's own rack: ``--rack``, else ``$ASTRAFLOW_RACK``, else None (the pool's
    ``rack`` from the topology then applies); ``ValueError`` naming the flag or variable
    for a bad name."""
    from astraflow.kafka.config import RACK_ENV, check_rack

    if args.rack is not None:
        return check_rack(args.rack, "--rack")
    env = os.environ.get(RACK_ENV)
    return check_rack(env, RACK_ENV) if env else None


def cmd_raas_run(args: argparse.Namespace) -> int:
    try:  # before the imports below (torch): a bad name fails at once
        rack = node_rack(args)
    except ValueError as e:
        print(f"astraflow raas run: {e}", file=sys.stderr)
        return 2
    from astraflow.cli.context import kafka_config
    from astraflow.config.sections import engine_options
    from astraflow.kafka.shutdown import stop_on_signals
    from astraflow.models.chat import ChatFormat
    from astraflow.models.errors import ModelError
    from astraflow.models.share import ensure_model
    from astraflow.raas.engines import load_engine
    from astraflow.raas.node import RaaSNode
    from astraflow.raas.vllm_engine import VLLMNotInstalled

    log = logging.getLogger("astraflow.raas")
    topo = args.loaded_topology = component_topology(args)
    try:
        node = settings(args, topo)
    except ValueError as e:
        print(f"astraflow raas run: {e}", file=sys.stderr)
        return 2
    try:
        engine_options(node.engine, node.engine_options)  # before anything loads
    except ValueError as e:
        print(f"astraflow raas run: --engine-options: {e}", file=sys.stderr)
        return 2
    # the pool's `kafka:` and rack applied, then the pool's own credentials
    config = kafka_config(args, topo.component_kafka(f"pool.{args.pool}",
                                                     topo.pool_kafka(args.pool, rack)))
    _check_workflows(node.workflow_options)
    engines = {}
    for policy, path in node.models.items():
        try:
            if node.engine != "openai":  # a missing local model comes from the weight stream
                path = str(ensure_model(path, config, topo, policy))
            engines[policy] = load_engine(node, policy, path)
        except (VLLMNotInstalled, ModelError, ValueError) as e:
            print(f"astraflow raas run: policy {policy!r}: {e}", file=sys.stderr)
            return 2
        if policy in node.chats:
            engines[policy].chat = ChatFormat.from_options(node.chats[policy].model_dump())
        log.info("policy %s: %s engine on %s (version %d)", policy, node.engine, path,
                 engines[policy].version)
    raas = RaaSNode(topo, engines, node_options(args, node), config=config)

    stop_on_signals(raas.stop, log, "finishing the current task, then leaving the group")
    c = raas.run()
    print(
        f"{raas.component_id}: consumed {c.consumed}, produced {c.produced}, "
        f"dead-lettered {c.dead_lettered}, {c.transactions} transactions, "
        f"{c.gen_tokens} tokens generated"
    )
    return 0


_EXAMPLES = [
    "astraflow raas run -t topology/default.yaml --pool local",
    "astraflow raas run -t topology/smollm2.yaml --pool local --instance gpu-0 "
    "--policy-model actor=models/smollm2 --engine vllm",
    "astraflow raas run -t topology/solver-verifier.yaml --pool local "
    "--policy-model solver=DIR1 --policy-model verifier=DIR2 --n-samples 4",
]

_NODE: list[Option] = [
    (("--pool",), dict(default="default", help="pool name: its settings are the topology's "
                       "pools.<name> (a flag below overrides one); the nodes join group "
                       "<run>.raas, or <run>.raas.<pool> for a pool with share_tasks: false")),
    (("--instance",), dict(help="instance id, unique per running node (default: "
                           "$ASTRAFLOW_INSTANCE, else the container id in a container, "
                           "else the host name)")),
    (("--rack",), dict(help="the node's rack or region: every consumer of the node sets "
                       "client.rack to it and fetches from the replica in that rack, on "
                       "brokers with RackAwareReplicaSelector (default: $ASTRAFLOW_RACK, "
                       "else the pool's rack in the topology)")),
]


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``raas`` command group to ``subparsers`` (from ``add_subparsers``)."""
    verbs = add_group(subparsers, "raas", help="rollout-as-a-service nodes",
                      dest="raas_command", examples=_EXAMPLES[:1])
    run = add_command(
        verbs, "run",
        help="run one RaaS node: consume tasks, produce trajectory groups until SIGTERM",
        description="Join the pool's consumer group on <run>.tasks, run each task's workflow "
        "against the node's policy engines, and produce its trajectory group to "
        "<run>.trajectories.raw; follow weights.<policy> to keep each policy current.",
        examples=_EXAMPLES,
    )
    add_run_options(run)
    add_table(run, None, _NODE)
    add_flags(run, NODE_FLAGS)
    run.set_defaults(func=cmd_raas_run)
    return subparsers.choices["raas"]
