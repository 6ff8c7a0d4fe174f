"""The agent examples under ``astraflow up``: programs written against the `openai` client
alone roll out through the node's endpoint, and their policies train. The ReAct calculator
agent on a tiny model (plain-text prompts: it has no chat template) and on SmolLM2; the
solver and critic, two policies driven by one program, on SmolLM2. On SmolLM2 every prompt
goes through its chat template, which has no place for tools: the endpoint writes them into
the system message (``raas/agent/chat.py``)."""

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
    # 2 episodes a task and batches of 1 group: each program start costs about a second
    # of CPU (python and the openai client), so a version costs 2 of them, not 64
    topo["pools"]["local"]["n_samples"] = 2
    for proc in topo["processors"].values():
        if proc["kind"] == "batcher":
            proc["options"]["batch_size"] = 1
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
    assert rewards <= {0.0, 1.0} and all(len(g.sequences) >= 2 for g in groups)


def _smollm2(name: str, tmp_path: Path, bootstrap: str, model: Path) -> tuple:
    """A shipped agent topology at a test's size on SmolLM2 (no warm start, no online
    evaluator, one task per transaction, batches of one group, 2 episodes a task)."""
    topo = yaml.safe_load((REPO / "topology" / name).read_text())
    topo.update(run=random_name("agent-smol"), kafka={"bootstrap_servers": bootstrap},
                status_interval_s=2)
    topo.pop("eval", None)
    for policy, spec in topo["policies"].items():
        spec.pop("warm_start", None)
        spec.update(model=str(model), dtype="best", chat={"template": "auto"})
        spec["trainer"].update(autocast="best", state_dir=str(tmp_path / f"state-{policy}"))
    pool = topo["pools"]["local"]
    pool.update(n_samples=2, tasks_per_transaction=1)
    # the worked exchange (AGENT_DEMO) and room for a call: SmolLM2 writes none without
    pool["workflows"]["agent"].update(max_new_tokens=40, env={"AGENT_DEMO": "1"})
    for proc in topo["processors"].values():
        if proc["kind"] == "batcher":
            proc["options"]["batch_size"] = 1
    topo["feeder"]["rate"] = 1
    path = tmp_path / name
    path.write_text(yaml.safe_dump(topo))
    return topo, path


@pytest.mark.slow
@pytest.mark.parametrize("name,policies", [("agent-react.yaml", ["actor"]),
                                           ("agent-solver-critic.yaml", ["solver", "critic"])])
def test_the_agent_examples_train_smollm2_under_up(name, policies, smollm2_dir,
                                                   kafka_bootstrap, kafka_config, tmp_path):
    from transformers import AutoTokenizer

    topo, path = _smollm2(name, tmp_path, kafka_bootstrap, smollm2_dir)
    _up_until_versions(path, tmp_path, kafka_bootstrap, policies, 1)
    run, logs = topo["run"], tmp_path / "runs" / topo["run"] / "logs"
    for log in ["raas-local-0", *(f"trainer-{p}" for p in policies)]:
        text = (logs / f"{log}.log").read_text()
        assert "Traceback" not in text, f"{log} crashed:\n{text[-3000:]}"
    groups = [r.record for r in read_all(kafka_config, f"{run}.trajectories.raw",
                                         expect=TrajectoryGroup)]
    assert groups and {g.workflow for g in groups} == {"agent"}
    assert {s.policy for g in groups for s in g.sequences} == set(policies)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    seq = groups[0].sequences[0]
    text = tok.decode(seq.token_ids)
    assert text.startswith("<|im_start|>")  # SmolLM2's chat template, not plain text
    if name == "agent-react.yaml":  # the tools reached the model through its template
        assert "<tools>" in text and '"name": "calculate"' in text, text
