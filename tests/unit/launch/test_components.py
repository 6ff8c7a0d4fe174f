"""`launch.components`: the configuration of each process of `up`'s plan, built without
its command line, is the one its command builds from the plan's flags."""

from __future__ import annotations

from pathlib import Path

import pytest

from astraflow.cli.components import configuration
from astraflow.config.topology import load_topology
from astraflow.launch.components import component_configuration
from astraflow.launch.plan import plan_processes

REPO = Path(__file__).resolve().parents[3]
TOPOLOGIES = sorted(p.relative_to(REPO).as_posix() for p in (REPO / "topology").rglob("*.yaml"))
COMPONENTS = ("trainer-", "raas-", "eval-", "feeder")


@pytest.mark.parametrize("path", TOPOLOGIES)
def test_each_process_of_the_plan_is_configured_as_its_command_configures_it(path):
    topo = load_topology(REPO / path)
    plan = plan_processes(topo, path)
    names = [n for n in plan if n.startswith(COMPONENTS)]
    assert names, path
    for name in names:
        # after `python -m astraflow.cli.main`
        assert component_configuration(topo, name) == configuration(plan[name][3:], topo), name


def test_given_values_apply_over_the_plans_and_unknown_processes_are_refused():
    topo = load_topology(REPO / "topology" / "solver-verifier.yaml")
    plan = plan_processes(topo, "t.yaml")
    ev = component_configuration(topo, "eval-solver", {"size": 7})
    assert ev == configuration([*plan["eval-solver"][3:], "--size", "7"], topo)
    assert ev.size == 7
    node = component_configuration(topo, "raas-local-0")
    assert node.options.instance == "local-0"
    for name in ("trainer-nobody", "raas-local-99", "processor-x", "up"):
        with pytest.raises(ValueError, match="not a component process"):
            component_configuration(topo, name)
