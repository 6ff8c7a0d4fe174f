"""The typed configuration each process of ``astraflow up``'s plan runs with, without
running it or parsing its command line.

``component_configuration(topo, name)`` builds what the component command of process
``name`` (``astraflow.launch.plan.plan_processes``) builds from its flags: the component's
section of the topology with the identity the plan gives it applied (the policy's model,
the node's instance). Benches build their components' settings with it; a test keeps it
equal to what the command line itself builds (``astraflow.cli.components``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from astraflow.config.components import eval_settings, feeder_spec, node_settings, trainer_spec
from astraflow.config.topology import Topology


@dataclass
class NodeConfiguration:
    """A RaaS node's: its settings (``NodeSettings``) and what the node runs with."""

    settings: Any  # astraflow.config.components.NodeSettings
    options: Any  # astraflow.raas.node.NodeOptions


def component_configuration(topo: Topology, name: str,
                            given: Mapping[str, Any] | None = None) -> Any:
    """The typed configuration of process ``name`` of ``up``'s plan for ``topo``
    (``trainer-<policy>``, ``raas-<pool>-<i>``, ``eval-<policy>``, ``feeder``), with the
    flag values of ``given`` (dest -> value, e.g. ``{"size": 50}`` for ``--size 50``)
    applied over the plan's: ``ServiceOptions`` for a trainer, a ``NodeConfiguration``
    for a node, ``EvalSettings`` for an evaluator and ``FeederSpec`` for the feeder.
    ``ValueError`` names a process the plan has not or a refused value."""
    extra = dict(given or {})
    for policy, spec in topo.policies.items():
        if name == f"trainer-{policy}":
            return trainer_options(topo, policy, {"model": spec.model, **extra})
        if name == f"eval-{policy}":
            return eval_settings(topo, policy, {"model": spec.model, **extra})
    for pool, spec in topo.pools.items():
        index = name.removeprefix(f"raas-{pool}-")
        if index != name and index.isdigit() and int(index) < spec.nodes:
            models = [(p, s.model) for p, s in topo.policies.items()]
            return node_configuration(topo, pool, {"policy_model": models, **extra},
                                      instance=f"{pool}-{index}")
    if name == "feeder":
        return feeder_spec(topo, extra)
    raise ValueError(f"{name!r}: not a component process of {topo.source}'s plan")


def trainer_options(topo: Topology, policy: str,
                    given: Mapping[str, Any] | None = None,
                    instance: str | None = None) -> Any:
    """The ``ServiceOptions`` of ``policy``'s trainer: its typed section with ``trainer
    run``'s flags of ``given`` applied, validated (``ValueError`` names the flag or the
    key)."""
    from astraflow.trainer.service import ServiceOptions

    return ServiceOptions(policy, trainer_spec(topo, policy, given), instance=instance)


def node_configuration(topo: Topology, pool: str, given: Mapping[str, Any] | None = None,
                       instance: str | None = None) -> NodeConfiguration:
    """A node of ``pool``: its settings (``raas run``'s flags of ``given`` applied) and
    its ``NodeOptions``."""
    from astraflow.raas.node import NodeOptions

    node = node_settings(topo, pool, given)
    return NodeConfiguration(node, NodeOptions.from_settings(node, instance=instance))


__all__ = ["NodeConfiguration", "component_configuration", "node_configuration",
           "trainer_options"]
