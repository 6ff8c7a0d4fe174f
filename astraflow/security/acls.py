"""Least-privilege Kafka ACLs of a topology: each component's principal and what it needs.

``component_acls(topology)`` lists, for every component ``astraflow up`` would start (the
feeder, each processor, each RaaS pool, each policy's trainer and evaluator) and for the
operator commands, the principal it connects as (``kafka.security``; by default
``User:<run>.<key>``) and exactly the ACLs its clients use:

- READ on the topics it consumes and on its consumer group (a transactional component
  commits its offsets in its transaction, which needs READ on the group);
- READ on the topics it reads without a group (weights manifests and blobs, a followed
  topic), and DESCRIBE on the groups whose lag it reads;
- WRITE on the topics it produces to, ``status`` and ``dlq`` included;
- DELETE on a trainer's blob topic (it deletes the records of blobs no version needs);
- WRITE and DESCRIBE on its transactional-id prefix (``<group>.`` for a processor,
  ``<run>.raas.<pool>.``, ``<run>.trainer.<policy>.``);
- DESCRIBE on the assign-only reader groups its readers name (``astraflow.kafka.config``).

Only ``trainer.<policy>`` may WRITE ``weights.<policy>`` and its blob topic. READ and WRITE
imply DESCRIBE on a topic (Kafka's rule), so no topic DESCRIBE is listed beside them.
``astraflow.security.acls_apply`` makes them on a cluster (``topology acls FILE --apply``).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from astraflow.config.topology import Topology
from astraflow.kafka.config import (
    BLOB_READER_GROUP_PREFIX,
    TABLE_GROUP,
    TRAINER_REPLAY_GROUP_PREFIX,
)

Resource = Literal["TOPIC", "GROUP", "TRANSACTIONAL_ID"]
Pattern = Literal["LITERAL", "PREFIXED"]
Operation = Literal["READ", "WRITE", "DESCRIBE", "CREATE", "DELETE", "ALTER",
                    "DESCRIBE_CONFIGS", "ALTER_CONFIGS"]
OPERATOR = "operator"  # the key of the operator commands' principal (topics apply, status)


@dataclass(frozen=True, order=True)
class Acl:
    """One ALLOW rule for a principal: an operation on a resource (full names)."""

    resource: Resource
    pattern: Pattern
    name: str
    operation: Operation
    why: str = field(default="", compare=False)


@dataclass
class ComponentAcls:
    """A component's principal and the ACLs it needs."""

    key: str  # trainer.actor, pool.local, processor.staleness, feeder, eval.actor, operator
    principal: str  # User:<name>
    acls: list[Acl] = field(default_factory=list)

    def topics(self, operation: Operation) -> set[str]:
        """Full names of the (literal) topics it may ``operation``."""
        return {a.name for a in self.acls if a.resource == "TOPIC" and a.operation == operation
                and a.pattern == "LITERAL"}

    def groups(self, operation: Operation) -> set[str]:
        return {a.name for a in self.acls if a.resource == "GROUP" and a.operation == operation}


@dataclass
class _Access:
    """What one component does, in logical topic names (full names for groups)."""

    consumes: list[str] = field(default_factory=list)
    group: str | None = None
    reads: list[str] = field(default_factory=list)  # without a group
    writes: list[str] = field(default_factory=list)
    transactional_prefix: str | None = None
    deletes: list[str] = field(default_factory=list)  # DeleteRecords (pruning old blobs)
    lag_groups: list[str] = field(default_factory=list)
    reader_groups: list[str] = field(default_factory=list)  # assign-only group ids


def principal_of(topo: Topology, key: str) -> str:
    """The principal component ``key`` connects as: its username from ``kafka.security``
    (its own entry, ``credentials_dir``, else the default username), else ``<run>.<key>``."""
    sec = topo.kafka.security
    name = sec.username_for(None if key == OPERATOR else key, topo.run)
    return f"User:{name or f'{topo.run}.{key}'}"


def _declared(topo: Topology, names: list[str]) -> list[str]:
    return list(dict.fromkeys(n for n in names if n in topo.topics))


def _blob_topics(topo: Topology, policy: str) -> list[str]:
    """Logical names of the topics that hold ``policy``'s weight blobs (its trainer's
    ``blob_store``, by default ``weights.blobs`` when the topology declares it)."""
    store = topo.policies[policy].trainer.blob_store
    if store is None:
        return ["weights.blobs"] if "weights.blobs" in topo.topics else []
    prefix = f"kafka://{topo.run}."
    if store.startswith(prefix) and store[len(prefix):] in topo.topics:
        return [store[len(prefix):]]
    return []


def _weights(topo: Topology, policies: list[str]) -> list[str]:
    out = [f"weights.{p}" for p in policies]
    for p in policies:
        out += _blob_topics(topo, p)
    return _declared(topo, out)


def _processor_access(topo: Topology, name: str) -> _Access:
    from astraflow.dataflow import PROCESSOR_KINDS

    spec = topo.processors[name]
    cls = PROCESSOR_KINDS[spec.kind]
    side = cls(name, list(spec.inputs), list(spec.outputs),
               cls.Options(**spec.options)).side_access(topo)
    group = topo.group_of(name)
    return _Access(consumes=list(spec.inputs), group=group,
                   reads=_declared(topo, [t for t in side.reads if t not in spec.inputs]),
                   writes=_declared(topo, [*spec.outputs, "status", "dlq"]),
                   transactional_prefix=f"{group}.", lag_groups=list(side.lag_groups),
                   reader_groups=list(side.reader_groups))


def _accesses(topo: Topology) -> dict[str, _Access]:
    """Every component's access, by component key (``Topology.component_keys``)."""
    out: dict[str, _Access] = {}
    blobs_readers = [TABLE_GROUP, BLOB_READER_GROUP_PREFIX]
    if topo.feeder is not None:  # skips the tasks it already wrote: reads its own output
        out["feeder"] = _Access(reads=_declared(topo, ["tasks.source"]),
                                writes=_declared(topo, ["tasks.source"]),
                                reader_groups=[TABLE_GROUP])
    for name in topo.processors:
        out[f"processor.{name}"] = _processor_access(topo, name)
    for pool in topo.pools:
        out[f"pool.{pool}"] = _Access(
            consumes=["tasks"], group=topo.raas_group(pool),
            reads=_weights(topo, list(topo.policies)),
            writes=_declared(topo, ["trajectories.raw", "status", "dlq"]),
            transactional_prefix=f"{topo.run}.raas.{pool}.", reader_groups=blobs_readers)
    for policy in topo.policies:
        own = _weights(topo, [policy])  # written, and read back on resume
        out[f"trainer.{policy}"] = _Access(
            consumes=[f"batches.{policy}"], group=topo.trainer_group(policy), reads=own,
            writes=_declared(topo, [*own, "status", "dlq"]),
            deletes=_blob_topics(topo, policy),
            transactional_prefix=f"{topo.trainer_group(policy)}.",
            reader_groups=[*blobs_readers, TRAINER_REPLAY_GROUP_PREFIX])
    if topo.eval is not None:
        for policy in topo.policies:
            out[f"eval.{policy}"] = _Access(reads=_weights(topo, [policy]),
                                            writes=_declared(topo, ["status", "dlq"]),
                                            reader_groups=blobs_readers)
    return out


def _acls(topo: Topology, a: _Access) -> list[Acl]:
    full = topo.full_name
    acls = [Acl("TOPIC", "LITERAL", full(t), "READ", "consumes") for t in a.consumes]
    if a.group:
        acls.append(Acl("GROUP", "LITERAL", a.group, "READ", "its consumer group"))
    acls += [Acl("TOPIC", "LITERAL", full(t), "READ", "reads without a group")
             for t in a.reads if t not in a.consumes]
    acls += [Acl("TOPIC", "LITERAL", full(t), "WRITE", "produces") for t in a.writes]
    acls += [Acl("TOPIC", "LITERAL", full(t), "DELETE", "prunes blobs no version needs")
             for t in a.deletes]
    if a.transactional_prefix:
        acls += [Acl("TRANSACTIONAL_ID", "PREFIXED", a.transactional_prefix, op,
                     "its transactions") for op in ("WRITE", "DESCRIBE")]
    acls += [Acl("GROUP", "LITERAL", g, "DESCRIBE", "reads its lag")
             for g in dict.fromkeys(a.lag_groups) if g != a.group]
    acls += [Acl("GROUP", "PREFIXED" if g.endswith("-") else "LITERAL", g, "DESCRIBE",
                 "assign-only reader (never joins, never commits)")
             for g in dict.fromkeys(a.reader_groups)]
    return acls


def _operator(topo: Topology) -> ComponentAcls:
    """``topics apply`` (create, add partitions, set configs), ``status``, ``groups lag``,
    ``run list|delete`` on this run's topics and groups."""
    prefix = f"{topo.run}."
    ops: list[Operation] = ["CREATE", "ALTER", "DESCRIBE_CONFIGS", "ALTER_CONFIGS", "READ",
                            "DELETE"]
    acls = [Acl("TOPIC", "PREFIXED", prefix, op, "operator commands on the run's topics")
            for op in ops]
    acls += [Acl("GROUP", "PREFIXED", prefix, op, "lag of the run's groups; run delete")
             for op in ("DESCRIBE", "DELETE")]
    acls += [Acl("GROUP", "LITERAL", TABLE_GROUP, "DESCRIBE",
                 "assign-only reader (never joins, never commits)")]
    return ComponentAcls(OPERATOR, principal_of(topo, OPERATOR), acls)


def component_acls(topo: Topology, operator: bool = True) -> list[ComponentAcls]:
    """Every component's principal and ACLs, in ``component_keys`` order (then the
    operator's, unless ``operator`` is false)."""
    out = [ComponentAcls(key, principal_of(topo, key), _acls(topo, access))
           for key, access in _accesses(topo).items()]
    return out + [_operator(topo)] if operator else out


def overlaps(topo: Topology, comps: list[ComponentAcls]) -> list[str]:
    """Warnings where one component's grant reaches another's resources: a transactional
    prefix that starts another's, or one consumer group used by two kinds of component
    (e.g. a processor named ``raas``)."""
    out = []
    prefixes = [(c.key, a.name) for c in comps for a in c.acls
                if a.resource == "TRANSACTIONAL_ID" and a.operation == "WRITE"]
    for key, p in prefixes:
        for other, q in prefixes:
            if other != key and q.startswith(p):
                out.append(f"{key}: transactional-id prefix {p} also covers {other}'s ({q})")
    owners: dict[str, set[str]] = {}
    for c in comps:
        for g in c.groups("READ"):
            owners.setdefault(g, set()).add(c.key.split(".", 1)[0])
    out += [f"group {g} is shared by {', '.join(sorted(kinds))}"
            for g, kinds in owners.items() if len(kinds) > 1]
    return out


def format_table(topo: Topology, comps: list[ComponentAcls]) -> str:
    """The text of ``topology acls``: per component, its principal and one ACL a line."""
    lines = [f"run {topo.run} ({topo.source}): least-privilege ACLs, ALLOW only; READ or "
             "WRITE on a topic implies DESCRIBE"]
    for c in comps:
        lines += ["", f"{c.key}  {c.principal}"]
        width = max((len(a.name) for a in c.acls), default=0)
        for a in c.acls:
            res = f"{a.resource.lower().replace('_', '-')}"
            lines.append(f"  {a.operation:<16} {res:<17} {a.pattern.lower():<8} "
                         f"{a.name:<{width}}  {a.why}")
    warnings = overlaps(topo, comps)
    if warnings:
        lines += ["", "warnings:"] + [f"  {w}" for w in warnings]
    return "\n".join(lines)


def to_json(topo: Topology, comps: list[ComponentAcls]) -> str:
    """The ``--json`` form: run, components (key, principal, acls) and warnings."""
    doc: dict[str, Any] = {
        "run": topo.run,
        "components": [{"key": c.key, "principal": c.principal,
                        "acls": [asdict(a) for a in c.acls]} for c in comps],
        "warnings": overlaps(topo, comps),
    }
    return json.dumps(doc, indent=2)


__all__ = ["Acl", "ComponentAcls", "component_acls", "format_table", "overlaps",
           "principal_of", "to_json"]
