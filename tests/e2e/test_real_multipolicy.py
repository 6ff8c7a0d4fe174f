"""`astraflow up` of each shipped multi-policy topology on the real model (SmolLM2, issue
20): solver + verifier, solver + selector and code (solver + test generator), each policy
its own copy of the model, prompts through its chat template. Each topology is shrunk to a
test's size (one task per transaction, few samples and tokens, batches of one group, no
online evaluator) and runs until every policy has rollouts with rewards that vary and a
trained version, then is stopped. The mechanism only: how much each policy learns is
measured by ``python bench/learning.py --topology topology/smollm2-<...>.yaml``."""

from __future__ import annotations

import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from confluent_kafka import KafkaException

from astraflow.kafka.clients import read_all
from astraflow.wire.records import TrajectoryGroup, WeightManifest
from tests.conftest import random_name, wait_for

REPO = Path(__file__).resolve().parents[2]

# The solver's reward in the test: closeness of any final number (the shipped one pays only
# for the number alone, which the untrained model seldom writes in a few short samples)
NEAR = {"name": "closeness"}
# topology file -> (the judge's policy, the workflow, its options at a test's size)
CASES = {
    "smollm2-solver-verifier.yaml": ("verifier", "solve_verify", {
        "max_new_tokens": 6, "verifier_sampling": {"max_new_tokens": 3}, "reward": NEAR}),
    "smollm2-solver-selector.yaml": ("selector", "solve_select", {
        "max_new_tokens": 6, "candidates": 3, "selector_sampling": {"max_new_tokens": 3},
        "reward": NEAR}),
    "smollm2-code.yaml": ("generator", "code_tests", {
        "max_new_tokens": 40, "generator_sampling": {"max_new_tokens": 48}}),
}


def _small_run(name: str, run: str, model: Path, bootstrap: str, tmp: Path) -> dict:
    """The shipped topology ``name`` at a test's size: both policies start from the one
    imported model directory (read only), batches of one group, 2-4 samples a task."""
    judge, workflow, options = CASES[name]
    topo = yaml.safe_load((REPO / "topology" / name).read_text())
    topo.update(run=run, kafka={"bootstrap_servers": bootstrap}, status_interval_s=2)
    topo.pop("eval")
    for policy, spec in topo["policies"].items():
        spec.update(model=str(model), import_from=None)
        spec["trainer"]["state_dir"] = str(tmp / f"state-{policy}")
    for batcher in ("batcher-solver", f"batcher-{judge}"):
        topo["processors"][batcher]["options"]["batch_size"] = 1
    pool = topo["pools"]["local"]
    pool.update(n_samples=2 if workflow == "solve_select" else 4, tasks_per_transaction=1)
    wf = pool["workflows"][workflow]
    for key, value in options.items():  # a judge's sampling options merged, not replaced
        wf[key] = {**wf.get(key, {}), **value} if key.endswith("_sampling") else value
    feeder = topo["feeder"]
    feeder["rate"] = 1
    if "dataset" in feeder:
        feeder["dataset"]["path"] = str(REPO / feeder["dataset"]["path"])
    else:
        feeder["levels"] = "1"  # one-operation specs: the model gets some of them right
    return topo


def _seen(config, run: str, policies: list[str]) -> dict[str, tuple[list[float], int]]:
    """Per policy: the rewards of its sequences in ``trajectories.raw`` and its latest
    published version."""
    groups = [r.record for r in read_all(config, f"{run}.trajectories.raw", idle_s=0.5,
                                         expect=TrajectoryGroup)]
    out = {}
    for policy in policies:
        rewards = [s.reward for g in groups for s in g.sequences if s.policy == policy]
        versions = [r.record.version for r in read_all(config, f"{run}.weights.{policy}",
                                                       idle_s=0.5, expect=WeightManifest)]
        out[policy] = (rewards, max(versions, default=-1))
    return out


def _ready(seen: dict[str, tuple[list[float], int]]) -> bool:
    return all(len(set(rewards)) > 1 and version >= 1 for rewards, version in seen.values())


@pytest.mark.slow
@pytest.mark.kafka
@pytest.mark.parametrize("name", sorted(CASES))
def test_real_model_multipolicy_topology_trains_every_policy(name, smollm2_dir, kafka_bootstrap,
                                                             kafka_config, tmp_path):
    t0 = time.time()
    run = random_name(name.removesuffix(".yaml"))
    topo = _small_run(name, run, smollm2_dir, kafka_bootstrap, tmp_path)
    policies = sorted(topo["policies"])
    path = tmp_path / name
    path.write_text(yaml.safe_dump(topo))
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    log = open(tmp_path / "up.log", "wb")
    up = subprocess.Popen(
        [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--duration", "600",
         "--runs-dir", str(tmp_path / "runs")],
        stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    try:
        def ready():
            assert up.poll() is None, (tmp_path / "up.log").read_text()[-3000:]
            try:
                seen = _seen(kafka_config, run, policies)
            except KafkaException:  # `up` has not made the run's topics yet
                return None
            return seen if _ready(seen) else None

        wait_for(ready, 480, f"{name}: rewards that vary and a trained version per policy",
                 step=3)
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(120)
        log.close()
    for component in [f"trainer-{p}" for p in policies] + ["raas-local-0"]:
        text = (tmp_path / "runs" / run / "logs" / f"{component}.log").read_text()
        assert "Traceback" not in text, f"{component} crashed:\n{text[-3000:]}"
    seen = _seen(kafka_config, run, policies)
    for policy, (rewards, version) in seen.items():
        assert version >= 1, (policy, version)
        assert statistics.pstdev(rewards) > 0, (policy, rewards)
        assert all(0.0 <= r <= 1.5 for r in rewards), (policy, rewards)  # exact: 1 + 0.5
        print(f"{name} {policy}: {len(rewards)} sequences, reward mean "
              f"{statistics.fmean(rewards):.3f} std {statistics.pstdev(rewards):.3f}, "
              f"non-zero {sum(r > 0 for r in rewards) / len(rewards):.0%}, version {version}")
    print(f"{name}: {time.time() - t0:.0f}s")
