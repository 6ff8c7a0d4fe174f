"""The megatron-core trainer backend on a broker: astraflow up with the megatron backend publishes
versions a RaaS node loads, and a megatron trainer SIGKILLed mid-run resumes exactly. Skipped,
naming the fix, when megatron-core is not installed (or, on this CPU, is not the pinned
release)."""

from __future__ import annotations

import sys

import pytest

from astraflow.trainer.megatron_shims import MegatronUnavailable, check_megatron
from tests.unit.trainer.test_megatron import llama_dir  # noqa: F401 (a fixture)

try:
    check_megatron(cpu=True)
except MegatronUnavailable as _e:
    pytest.skip(str(_e), allow_module_level=True)


@pytest.mark.slow
def test_up_with_megatron_backend_publishes_versions_raas_loads(kafka_bootstrap, kafka_config,
                                                                 tmp_path):
    """The default topology (its tiny model is a Llama) with ``trainer.backend:
    megatron``: the trainer publishes consecutive HF-named versions that the RaaS node
    applies and rolls out with."""
    import json
    import os
    import subprocess

    import yaml

    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import TrajectoryGroup, WeightManifest
    from tests.conftest import REPO, random_name

    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    run = random_name("megatron")
    topo.update(run=run, kafka={"bootstrap_servers": kafka_bootstrap}, eval=None)
    # no warm start (the box is shared): the untrained model earns little reward, so the
    # versions may change few weights; what is checked is that they are published and
    # that the RaaS node applies them
    topo["policies"]["actor"].update(model=str(tmp_path / "model"),
                                     warm_start={"steps": 0, "levels": "1"})
    topo["policies"]["actor"]["trainer"].update(backend="megatron", threads=1)
    topo["feeder"] = {"epochs": 0, "rate": 60, "levels": "1"}
    path = tmp_path / "megatron.yaml"
    path.write_text(yaml.safe_dump(topo))
    res = subprocess.run(
        [sys.executable, "-m", "astraflow.cli.main", "up", str(path), "--versions", "4",
         "--duration", "100", "--runs-dir", str(tmp_path / "runs")], capture_output=True,
        text=True, cwd=REPO,
        env={**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap}, timeout=500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    run_dir = tmp_path / "runs" / run
    for name in ("trainer-actor", "raas-local-0"):
        log = (run_dir / "logs" / f"{name}.log").read_text()
        assert "Traceback" not in log, f"{name} crashed:\n{log[-3000:]}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["versions"]["actor"] >= 2, summary
    manifests = [r.record for r in read_all(kafka_config, f"{run}.weights.actor",
                                            expect=WeightManifest)]
    versions = sorted({m.version for m in manifests})
    assert versions == list(range(len(versions))) and len(versions) >= 3, versions
    assert any(m.kind == "delta" and m.num_changed > 0 for m in manifests)
    groups = [r.record for r in read_all(kafka_config, f"{run}.trajectories.raw",
                                         expect=TrajectoryGroup)]
    rolled_with = {s.max_version for g in groups for s in g.sequences}
    assert max(rolled_with) >= 1, f"rollouts only ever used versions {rolled_with}"


@pytest.mark.slow
def test_megatron_trainer_resumes_exactly_after_sigkill(kafka_config, kafka_bootstrap,
                                                        make_topology, llama_dir, tmp_path):  # noqa: F811
    """The trainer service with ``--backend megatron``, SIGKILLed with version 3's
    transaction open and restarted: it recomputes version 2 from version 1's state,
    checks it against the published one, and goes on; every published version equals an
    uninterrupted megatron run's bit for bit (the resume logic is the torch backend's)."""
    from astraflow.config.sections import TrainerSpec
    from tests.integration.trainer.test_trainer import (
        _check_history,
        _crash_then_resume,
        _reference,
    )

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}})
    sent, _, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, llama_dir, tmp_path, n=5, crash_at=3,
        args=["--lr", "1e-4", "--micro-batch-size", "3", "--state-interval", "1",
              "--backend", "megatron"])
    assert "resumed at version 2 from the state of version 1" in text, text[-3000:]
    assert "matches version 2's manifest" in text, text[-3000:]
    cfg = TrainerSpec(lr=1e-4, micro_batch_size=3, backend="megatron")
    _check_history(kafka_config, manifests, sent, _reference(llama_dir, sent, cfg),
                   topo.full_name("batches.actor"))

