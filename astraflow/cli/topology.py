"""``astraflow topology explain|validate|acls``: a topology as a graph of topics and components.

``explain`` lists every topic in the order records flow through it (partitions, record
type, which components write and read it) and every component with its typed settings;
``validate`` loads the file (every error names the file and key) and says what ``up``
would start; ``acls`` prints each component's principal and least-privilege ACLs
(``astraflow.security.acls``). ``graph(topo)`` is the decision logic, with no Kafka.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

from astraflow.config.topology import Topology

# topics beside the data flow: who writes and who reads them
SIDE_TOPICS = {
    "status": ("every component", "astraflow up, operators"),
    "dlq": ("every component", "operators"),
    "scaling": ("an autoscaler processor (none in this topology)", "operators' actuators"),
    "episodes": ("RaaS nodes' agent endpoints (every call, as answered)",
                 "a RaaS node that takes over an agent task (replay)"),
}


@dataclass
class Component:
    """One process kind of a run: the topics it consumes, follows (reads without
    consuming, e.g. weights) and produces, and a one-line summary of its settings."""

    name: str
    inputs: list[str] = field(default_factory=list)
    outputs: list[str] = field(default_factory=list)
    follows: list[str] = field(default_factory=list)
    settings: str = ""


def _policy_components(topo: Topology) -> list[Component]:
    out = []
    blobs = ["weights.blobs"] if "weights.blobs" in topo.topics else []
    for name, p in topo.policies.items():
        t = p.trainer
        out.append(Component(
            f"trainer {name}", [f"batches.{name}"], [f"weights.{name}", *blobs],
            settings=f"lr {t.lr}, anchor_interval {t.anchor_interval}, max_staleness "
                     f"{p.max_staleness}, temperature {p.temperature}, top_p {p.top_p}, "
                     f"loss {t.loss or 'clipped_tis'}"))
    if topo.eval is not None:
        for name, p in topo.policies.items():
            every = p.eval.every_versions or topo.eval.every_versions
            size = p.eval.size or topo.eval.size
            follows = [f"weights.{name}", *blobs]
            out.append(Component(f"eval {name}", follows=follows,
                                 settings=f"every {every} versions, {size} prompts"
                                          f"{', ' + p.role if p.role != 'solver' else ''}"))
    return out


def graph(topo: Topology) -> list[Component]:
    """Every component `up` runs for ``topo`` (a pool once, whatever its nodes)."""
    comps = []
    if topo.feeder is not None:
        f = topo.feeder
        what = f.dataset.path if f.dataset else f"arithmetic levels {f.levels or '1,2'}"
        comps.append(Component("feeder", outputs=["tasks.source"],
                               settings=f"{what}, rate {f.rate or 'unbounded'}/s, epochs "
                                        f"{'forever' if f.epochs == 0 else f.epochs or 1}"))
    for name, p in topo.processors.items():
        opts = ", ".join(f"{k} {v}" for k, v in p.options.items())
        comps.append(Component(f"{name} ({p.kind})", list(p.inputs), list(p.outputs),
                               settings=opts))
    weights = [f"weights.{p}" for p in topo.policies if f"weights.{p}" in topo.topics]
    weights += ["weights.blobs"] if weights and "weights.blobs" in topo.topics else []
    for name, pool in topo.pools.items():
        comps.append(Component(
            f"pool {name}", ["tasks"], ["trajectories.raw"], weights,
            settings=f"{pool.nodes} node(s), {pool.engine} engine, {pool.n_samples} samples, "
                     f"workflows {', '.join(pool.workflows) or 'as the tasks name them'}"
                     + (f", rack {pool.rack}" if pool.rack else "")))
    return comps + _policy_components(topo)


def flow_order(topo: Topology, comps: list[Component]) -> list[str]:
    """The run's topics, each after the topics it is made from (followed topics, the
    weights, close no loop); side topics last."""
    rank = dict.fromkeys(topo.topics, 0)
    for _ in range(len(comps) + 1):  # a longest-path relaxation; inputs only, no cycle
        for c in comps:
            for out in c.outputs:
                if out in rank and c.inputs:
                    rank[out] = max(rank[out], 1 + max(rank.get(i, 0) for i in c.inputs))
    data = [t for t in topo.topics if t not in SIDE_TOPICS]
    return sorted(data, key=lambda t: rank[t]) + [t for t in SIDE_TOPICS if t in topo.topics]


def _readers(topic: str, comps: list[Component]) -> list[str]:
    return [c.name + ("" if topic in c.inputs else " (follows)") for c in comps
            if topic in c.inputs or topic in c.follows]


def explain(topo: Topology) -> str:
    """The text of ``topology explain``: topics in flow order, then components."""
    comps = graph(topo)
    lines = [f"run {topo.run} ({topo.source}); topic names get the prefix {topo.run}.",
             "", "topics, in the order records flow:"]
    if topo.kafka.security.enabled:  # where passwords come from, never a password
        lines[1:1] = [f"kafka security: {topo.kafka.security.describe()}"]
    signing = topo.weight_signing
    if signing.public_key or signing.private_key:
        lines[1:1] = [f"weight signing: trainers sign with {signing.private_key or '(no key)'}"
                      f", readers verify with {signing.public_key or '(nothing)'}"]
    width = max(len(t) for t in topo.topics)
    for name in flow_order(topo, comps):
        t = topo.topic(name)
        writers = [c.name for c in comps if name in c.outputs]
        readers = _readers(name, comps)
        if name in SIDE_TOPICS:  # besides the processors that name them (an autoscaler)
            writers = writers or [SIDE_TOPICS[name][0]]
            readers = [SIDE_TOPICS[name][1], *readers]
        parts = "partition" if t.partitions == 1 else "partitions"
        lines.append(f"  {name:<{width}}  {t.partitions:>2} {parts:<10}  "
                     f"{t.schema_type.__name__:<15}  {', '.join(writers) or '(outside)'} -> "
                     f"{', '.join(readers) or '(outside)'}")
    lines += ["", "components:"]
    for c in comps:
        io = f"{', '.join(c.inputs) or '-'} -> {', '.join(c.outputs) or '-'}"
        follows = f"; follows {', '.join(c.follows)}" if c.follows else ""
        lines.append(f"  {c.name}: {io}{follows}" + (f"; {c.settings}" if c.settings else ""))
    return "\n".join(lines)


def cmd_explain(args: argparse.Namespace) -> int:
    """``astraflow topology explain``."""
    print(explain(args.loaded_topology))
    return 0


def cmd_validate(args: argparse.Namespace) -> int:
    """``astraflow topology validate``: the load did the checking (``astraflow.cli.main.main``
    prints its error and exits 2); say what is there."""
    from astraflow.launch.plan import plan_processes

    topo: Topology = args.loaded_topology
    plan = plan_processes(topo, args.topology)
    print(f"{topo.source}: valid; run {topo.run}: {len(topo.topics)} topics, "
          f"{len(topo.processors)} processors, {len(topo.policies)} policies, "
          f"{len(topo.pools)} pools; `astraflow up` starts {len(plan)} processes")
    return 0


def cmd_acls(args: argparse.Namespace) -> int:
    """``astraflow topology acls``: each component's principal and the ACLs it needs."""
    from astraflow.security.acls import component_acls, format_table, to_json

    topo: Topology = args.loaded_topology
    if args.apply:
        return _apply(args, topo)
    comps = component_acls(topo)
    print(to_json(topo, comps) if args.json else format_table(topo, comps))
    return 0


def _apply(args: argparse.Namespace, topo: Topology) -> int:
    """``topology acls --apply``: make the users and ACLs as the operator."""
    from pathlib import Path

    from astraflow.cli.context import kafka_config
    from astraflow.security.acls_apply import apply

    config = kafka_config(args)
    cred_dir = Path(args.credentials_dir).expanduser() if args.credentials_dir else None
    done = apply(topo, config, cred_dir)
    print(f"run {topo.run} on {config.bootstrap_servers} as {config.principal()}")
    print(done.summary())
    return 0


def register(subparsers: Any) -> None:
    """Add ``topology explain|validate|acls`` to ``subparsers``."""
    from astraflow.cli.args import add_command, add_group, add_run_options

    verbs = add_group(subparsers, "topology",
                      help="inspect a topology file: explain, validate, acls",
                      dest="topology_command",
                      examples=["astraflow topology explain topology/default.yaml"])
    for name, func, help_text in (
        ("explain", cmd_explain, "print the graph of topics and components of a topology"),
        ("validate", cmd_validate, "check a topology file; say what `up` would start"),
    ):
        p = add_command(verbs, name, help=help_text,
                        examples=[f"astraflow topology {name} topology/solver-verifier.yaml",
                                  f"astraflow topology {name} -t topology/default.yaml"])
        add_run_options(p, positional=True, bootstrap=False)
        p.set_defaults(func=func)
    p = add_command(verbs, "acls", help="print each component's principal and the Kafka ACLs "
                    "it needs, and nothing more",
                    examples=["astraflow topology acls topology/default.yaml",
                              "astraflow topology acls -t topology/default.yaml --json",
                              "astraflow topology acls topology/default.yaml --apply "
                              "--credentials-dir ~/.config/astraflow/credentials"])
    add_run_options(p, positional=True, bootstrap=True)
    p.add_argument("--json", action="store_true", help="print as JSON")
    p.add_argument("--apply", action="store_true",
                   help="create the components' SCRAM users and these ACLs on the cluster "
                   "(as the operator: the topology's default credentials or ASTRAFLOW_SASL_*; "
                   "safe to run again)")
    p.add_argument("--credentials-dir", default=None, metavar="DIR",
                   help="with --apply: write each component's password to DIR/<key>.password "
                   "(mode 0600; default kafka.security.credentials_dir)")
    p.set_defaults(func=cmd_acls)
