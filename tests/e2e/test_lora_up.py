"""A LoRA policy under ``astraflow up`` on the tiny model: the trainer publishes adapter
versions, the RaaS node applies each one in place and rolls out with it, the evaluator
scores them, and ``replay eval`` scores the same from the retained weight stream."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from astraflow.config.lora import LoraSpec
from astraflow.kafka.clients import read_all
from astraflow.models.lora import settings_of
from astraflow.wire.records import TrajectoryGroup, WeightManifest
from tests.conftest import random_name
from tests.e2e.test_default import _up_until_evaluated

REPO = Path(__file__).resolve().parents[2]
LORA = {"rank": 8, "alpha": 16.0, "target_modules": ["q_proj", "v_proj", "up_proj"]}


@pytest.mark.slow
def test_up_trains_a_lora_policy_whose_adapters_the_node_applies(kafka_bootstrap, kafka_config,
                                                                 tmp_path):
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = random_name("lora")
    topo["run"] = run
    topo["kafka"] = {"bootstrap_servers": kafka_bootstrap}
    topo["policies"]["actor"].update(
        model=str(tmp_path / "model"), lora=LORA, trainer={"lr": 1e-3, "anchor_interval": 5},
        warm_start={"steps": 120, "slip": 0.7, "levels": "1"})  # answers, sometimes right
    topo["feeder"] = {"epochs": 0, "rate": 60, "levels": "1"}
    topo["eval"] = {"every_versions": 2, "size": 30, "levels": "1"}
    path = tmp_path / "lora.yaml"
    path.write_text(yaml.safe_dump(topo))
    _up_until_evaluated(path, tmp_path, kafka_bootstrap)
    run_dir = tmp_path / "runs" / run
    for name in ("trainer-actor", "raas-local-0", "eval-actor"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in log, f"{name} crashed:\n{log[-3000:]}"
    raas_log = (run_dir / "logs" / "raas-local-0.log").read_text()
    assert "engine now at version" in raas_log, raas_log[-3000:]

    manifests = [r.record for r in read_all(kafka_config, f"{run}.weights.actor",
                                            expect=WeightManifest)]
    versions = sorted({m.version for m in manifests})
    assert versions == list(range(len(versions))) and len(versions) >= 4, versions
    want = LoraSpec(**LORA)  # dropout: its one default
    assert all(settings_of(m.meta) == want for m in manifests)
    # the adapter alone travels: q, v and up projections, A and B, in each layer
    layers = json.loads((tmp_path / "model" / "config.json").read_text())["num_hidden_layers"]
    assert {len(m.tensors) for m in manifests} == {3 * 2 * layers}
    assert max(m.encoded_bytes for m in manifests) < 200_000
    assert any(m.num_changed > 0 for m in manifests if m.version > 0)
    groups = [r.record for r in read_all(kafka_config, f"{run}.trajectories.raw",
                                         expect=TrajectoryGroup)]
    rolled_with = {s.max_version for g in groups for s in g.sequences}
    assert max(rolled_with) >= 1, f"rollouts only ever used versions {rolled_with}"
    summary = json.loads((run_dir / "summary.json").read_text())
    evaluated = {e["version"]: e["accuracy"] for e in summary["eval"]["actor"]}
    assert max(evaluated) >= 2, evaluated

    # replay eval rebuilds the adapters from the stream: the same held-out accuracy
    from astraflow.cli.main import main

    curve_file = tmp_path / "curve.json"
    assert main(["replay", "eval", "-t", str(path), "--bootstrap", kafka_bootstrap,
                 "--every", "2", "--out", str(curve_file)]) == 0
    curve = {c["version"]: c["accuracy"] for c in json.loads(curve_file.read_text())["curve"]}
    common = set(curve) & set(evaluated)
    assert common and all(curve[v] == evaluated[v] for v in common), (curve, evaluated)
