"""The plan of ``astraflow up``: every process it starts for a topology, each an ordinary
``astraflow`` subcommand given the topology file and its identity only (policy, pool and
instance, processor name, where its model is), so that it reads its settings from the file
as a component started by hand does; and what each process gets besides (niceness, metrics
port, a remote pool's bootstrap address)."""

from __future__ import annotations

import sys

from astraflow.config.topology import Topology


def astraflow_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "astraflow.cli.main", *args]


def plan_processes(topo: Topology, path: str) -> dict[str, list[str]]:
    """Name -> command line of every process `up` starts for ``topo``: each component with
    the topology file ``path`` and its identity only (policy, pool and instance, processor
    name; where its model is), so that it reads its settings from the file itself, as it
    does when started by hand or by a compose service."""
    procs: dict[str, list[str]] = {}
    for policy in topo.policies:
        procs[f"trainer-{policy}"] = astraflow_command(*trainer_args(topo, path, policy))
    for name in topo.processors:
        procs[f"processor-{name}"] = astraflow_command("processor", "run", name, "--topology", path,
                                                "--instance", "up")
    for pool, spec in topo.pools.items():
        for i in range(spec.nodes):
            procs[f"raas-{pool}-{i}"] = astraflow_command(*raas_args(topo, path, pool, i))
    if topo.feeder is not None:
        procs["feeder"] = astraflow_command("feeder", "run", "--topology", path)
    if topo.eval is not None:
        for policy in topo.policies:
            procs[f"eval-{policy}"] = astraflow_command(*eval_args(topo, path, policy))
    return procs


def trainer_args(topo: Topology, path: str, policy: str) -> list[str]:
    """The ``astraflow`` arguments of ``policy``'s trainer (``trainer run``): the file,
    the policy and its model directory."""
    return ["trainer", "run", "--topology", path, "--policy", policy,
            "--model", topo.policies[policy].model]


def raas_args(topo: Topology, path: str, pool: str, index: int) -> list[str]:
    """The ``astraflow`` arguments of node ``index`` of ``pool`` (``raas run``): the file,
    the pool, the node's instance and each policy's model directory."""
    args = ["raas", "run", "--topology", path, "--pool", pool, "--instance", f"{pool}-{index}"]
    for policy, p in topo.policies.items():
        args += ["--policy-model", f"{policy}={p.model}"]
    return args


def eval_args(topo: Topology, path: str, policy: str) -> list[str]:
    """The ``astraflow`` arguments of ``policy``'s evaluator (``eval run``): the file,
    the policy and its model directory."""
    return ["eval", "run", "--topology", path, "--policy", policy,
            "--model", topo.policies[policy].model]


def process_niceness(topo: Topology) -> dict[str, int]:
    """Name -> CPU niceness of the processes `up` starts with one (a policy's ``nice``: its
    trainer and evaluator); the others keep the launcher's."""
    out = {}
    for policy, spec in topo.policies.items():
        if spec.nice:
            out[f"trainer-{policy}"] = spec.nice
            if topo.eval is not None:
                out[f"eval-{policy}"] = spec.nice
    return out


def metrics_ports(topo: Topology) -> dict[str, int]:
    """Process name -> the port of its Prometheus metrics (``metrics_port`` and up)."""
    if topo.metrics_port is None:
        return {}
    served = [n for n in plan_processes(topo, "")  # those that run the transactional loop
              if n.startswith(("trainer-", "processor-", "raas-"))]
    return {name: topo.metrics_port + i for i, name in enumerate(served)}


def pool_bootstrap(topo: Topology, name: str) -> str | None:
    """The bootstrap address of process ``name`` when it is a node (``raas-<pool>-<i>``)
    of a pool whose ``kafka:`` sets one: ``up`` hands it over as ``ASTRAFLOW_BOOTSTRAP``
    in place of the run's (e.g. a remote pool behind a proxy); else None."""
    for pool, spec in topo.pools.items():
        index = name.removeprefix(f"raas-{pool}-")
        if index != name and index.isdigit():
            return spec.kafka.get("bootstrap_servers")
    return None
