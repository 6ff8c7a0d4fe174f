"""VLLMEngine in a RaaS node on a real broker, following published weights (the engine alone:
tests/unit/raas/test_vllm_engine.py). Runs where vLLM imports (bash scripts/vllm-env, then
.venv-vllm/bin/python -m pytest -m vllm); elsewhere it skips with that reason."""

from __future__ import annotations

import json

import pytest

from tests.conftest import running, wait_for
from tests.unit.raas.test_vllm_engine import (  # noqa: F401 (engine, model_dir: fixtures)
    LOGPROB_TOL,
    engine,
    fresh,
    hf,
    hf_logprobs,
    model_dir,
    needs_vllm,
    trained,
)

# written out (needs_vllm marks it too): .ci/run finds the vLLM files by this text
pytestmark = pytest.mark.vllm


@needs_vllm
@pytest.mark.kafka
def test_node_with_vllm_follows_published_weights(kafka_config, make_topology, fresh, hf,  # noqa: F811
                                                  tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import FileBlobStore, WeightPublisher
    from astraflow.wire.records import Task, TrajectoryGroup

    eng = fresh
    topo, _ = make_topology({"tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1},
                             "dlq": {"partitions": 1}, "status": {"partitions": 1},
                             "weights.actor": {"partitions": 1}})
    pub = WeightPublisher(FileBlobStore(str(tmp_path / "blobs")), "actor", anchor_interval=10)
    v0 = {k: v.clone() for k, v in hf.state_dict().items()}
    v1 = trained(hf, seed=3)
    producer = RecordProducer(kafka_config)
    for state in (v0, v1):
        for m in pub.publish(state):
            producer.produce(topo.full_name("weights.actor"), m, key="actor")
    task = Task(task_id="t0", prompt_id="p-t0", workflow="single_turn",
                payload=json.dumps({"prompt": "12+34=", "answer": "46"}), source="test",
                policies=["actor"])
    producer.produce(topo.full_name("tasks"), task, key="p-t0")
    producer.flush()

    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="v", n_samples=2, poll_timeout_s=0.2,
        workflow_options={"single_turn": {"max_new_tokens": 6, "temperature": 1.0}}))
    out = topo.full_name("trajectories.raw")
    with running(node) as thread:
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 120, "a trajectory group")
    assert not thread.is_alive()
    (g,) = [r.record for r in read_all(kafka_config, out, idle_s=0.3, expect=TrajectoryGroup)]
    assert len(g.sequences) == 2 and eng.version == 1
    for s in g.sequences:
        gen = [v for v, m in zip(s.versions, s.loss_mask) if m]
        assert gen and all(v == 1 for v in gen)
        prompt_len = s.loss_mask.index(1)
        toks = s.token_ids[prompt_len:]
        ref = hf_logprobs(hf, s.token_ids[:prompt_len], toks, 1.0)
        lps = [lp for lp, m in zip(s.logprobs, s.loss_mask) if m]
        assert max(abs(a - b) for a, b in zip(ref, lps)) < LOGPROB_TOL
    assert node.status().weight_versions == {"actor": 1}

