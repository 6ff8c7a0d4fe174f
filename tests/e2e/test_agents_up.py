"""The agent examples under ``astraflow up`` on tiny models: programs written against the
`openai` client alone roll out through the node's endpoint, and their policies train (the
ReAct calculator agent; the solver and critic, two policies driven by one program)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from astraflow.kafka.clients import read_all
from astraflow.wire.records import TrajectoryGroup, WeightManifest
from tests.conftest import random_name
from tests.e2e.test_default import up_until

REPO = Path(__file__).resolve().parents[2]


def _up_until_versions(path: Path, tmp_path: Path, bootstrap: str, policies: list[str],
                       versions: int) -> str:
    """``astraflow up`` until every policy's progress shows ``versions``; its output."""

    def done(last: str) -> bool:
        got = [int(m[1]) for p in policies if (m := re.search(rf"{p} v(\d+) ", last))]
        return len(got) == len(policies) and min(got) >= versions

    return up_until(path, tmp_path, bootstrap, done, f"versions {versions} of {policies}", 400)


def _topology(name: str, tmp_path: Path, bootstrap: str, warm: dict[str, dict]) -> tuple:
    topo = yaml.safe_load((REPO / "topology" / name).read_text())
    topo["run"] = random_name("agent")
    topo["kafka"] = {"bootstrap_servers": bootstrap}
    for policy, warm_start in warm.items():  # no warm start: the mechanism, not skill
        topo["policies"][policy].update(model=str(tmp_path / policy), warm_start=warm_start)
    topo["eval"] = {"every_versions": 1000, "size": 10}
    # 4 episodes a task and batches of 2 groups: each program start costs about a second
    # of CPU (python and the openai client), so a version costs 8 of them, not 64
    topo["pools"]["local"]["n_samples"] = 4
    for proc in topo["processors"].values():
        if proc["kind"] == "batcher":
            proc["options"]["batch_size"] = 2
    path = tmp_path / name
    path.write_text(yaml.safe_dump(topo))
    return topo, path


def _check_run(kafka_config, tmp_path: Path, topo: dict, policies: list[str]) -> list:
    run = topo["run"]
    logs = tmp_path / "runs" / run / "logs"
    for name in ["raas-local-0", *(f"trainer-{p}" for p in policies)]:
        text = (logs / f"{name}.log").read_text()
        assert "Traceback" not in text, f"{name} crashed:\n{text[-3000:]}"
    for p in policies:
        versions = {r.record.version for r in read_all(kafka_config, f"{run}.weights.{p}",
                                                       expect=WeightManifest)}
        assert max(versions) >= 2, (p, versions)
    groups = [r.record for r in read_all(kafka_config, f"{run}.trajectories.raw",
                                         expect=TrajectoryGroup)]
    assert groups and {g.workflow for g in groups} == {"agent"}
    return groups


@pytest.mark.slow
def test_the_react_calculator_agent_trains_under_up(kafka_bootstrap, kafka_config, tmp_path):
    topo, path = _topology("agent-react.yaml", tmp_path, kafka_bootstrap, {"actor": {}})
    _up_until_versions(path, tmp_path, kafka_bootstrap, ["actor"], 2)
    groups = _check_run(kafka_config, tmp_path, topo, ["actor"])
    rewards = {r for g in groups for r in g.rewards}
    assert rewards <= {0.0, 1.0} and all(len(g.sequences) >= 4 for g in groups)


@pytest.mark.slow
def test_one_program_trains_a_solver_and_a_critic_under_up(kafka_bootstrap, kafka_config,
                                                           tmp_path):
    topo, path = _topology("agent-solver-critic.yaml", tmp_path, kafka_bootstrap,
                           {"solver": {}, "critic": {}})
    _up_until_versions(path, tmp_path, kafka_bootstrap, ["solver", "critic"], 2)
    groups = _check_run(kafka_config, tmp_path, topo, ["solver", "critic"])
    assert {s.policy for g in groups for s in g.sequences} == {"solver", "critic"}
    assert all(len(g.sequences) == 8 for g in groups)  # 4 episodes x (solver, critic)
