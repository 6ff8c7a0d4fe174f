"""The RaaS node on a real broker: exactly once across a SIGKILL mid-rollout, dead letters,
status, weights followed, several tasks a transaction rolled out as one batch (the engine and
the workflows without a broker: tests/unit/raas/test_engine.py,
tests/unit/raas/test_workflows.py)."""

from __future__ import annotations

import signal
import sys
from pathlib import Path

import pytest
import torch

from astraflow.raas.engine import TorchEngine
from astraflow.wire.records import ComponentStatus, DeadLetter, TrajectoryGroup
from tests.conftest import REPO, running, wait_for
from tests.unit.raas.test_engine import tiny_model, tiny_tokenizer
from tests.unit.raas.test_workflows import check_sequence_invariants, task_of


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny-model")
    tiny_model().save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def node_topology(make_topology, **topics):
    return make_topology(
        topics={"tasks": {"partitions": 1}, "trajectories.raw": {"partitions": 1}, **topics}
    )


def start_node(kafka_bootstrap, path, model_dir, instance, log, *extra):
    import os
    import subprocess

    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    args = [
        sys.executable,
        "-m",
        "astraflow.cli.main",
        "raas",
        "run",
        "--topology",
        str(path),
        "--policy-model",
        f"actor={model_dir}",
        "--instance",
        instance,
        "--n-samples",
        "2",
        "--session-timeout-ms",
        "6000",
        *extra,
    ]
    return subprocess.Popen(
        args, env=env, stdout=open(log, "ab"), stderr=subprocess.STDOUT, cwd=REPO
    )


@pytest.mark.slow
def test_node_exactly_once_across_sigkill_mid_rollout(
    kafka_config, kafka_bootstrap, make_topology, model_dir, tmp_path
):
    from astraflow.kafka.clients import RecordProducer, read_all

    topo, path = node_topology(make_topology)
    producer = RecordProducer(kafka_config)
    tasks = topo.full_name("tasks")
    producer.produce(tasks, task_of("{not json", tid="bad"), key="p-bad")
    for i in range(2):
        producer.produce(
            tasks,
            task_of({"prompt": f"{i}+{i}=", "answer": str(2 * i)}, tid=f"t{i}"),
            key=f"p-t{i}",
        )
    producer.flush()
    opts = [
        "--workflow-options",
        'single_turn={"max_new_tokens": 12, "env_latency": 2.5, "temperature": 1.0}',
    ]
    procs = []
    try:
        log_a = tmp_path / "a.log"
        a = start_node(kafka_bootstrap, path, model_dir, "a", log_a, *opts)
        procs.append(a)
        wait_for(
            lambda: "rollout of task t1 (" in log_a.read_text(),
            60,
            "node a to start its second task",
        )
        a.send_signal(signal.SIGKILL)
        a.wait(10)
        out = topo.full_name("trajectories.raw")
        done = [r.record for r in read_all(kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)]
        assert [g.task_id for g in done] == ["t0"]

        log_b = tmp_path / "b.log"
        b = start_node(kafka_bootstrap, path, model_dir, "b", log_b, *opts)
        procs.append(b)
        wait_for(
            lambda: "rollout of task t1 done" in log_b.read_text(),
            60,
            "node b to complete the redelivered task",
        )
        # its transaction committed: the group is readable (read_committed) on the output
        wait_for(
            lambda: "t1" in {r.record.task_id for r in read_all(
                kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)},
            60,
            "node b to commit the group of task t1",
        )
        b.send_signal(signal.SIGTERM)
        assert b.wait(30) == 0, log_b.read_text()[-2000:]
        assert "leaving group" in log_b.read_text()

        groups = [r.record for r in read_all(kafka_config, out, idle_s=0.5, expect=TrajectoryGroup)]
        assert sorted(g.task_id for g in groups) == ["t0", "t1"]
        by_task = {g.task_id: g for g in groups}
        assert by_task["t0"].raas_id == "raas.default/a"
        assert by_task["t1"].raas_id == "raas.default/b"
        for g in groups:
            assert g.pool == "default" and g.workflow == "single_turn"
            assert len(g.sequences) == 2 and len(g.rewards) == 2
            assert g.metrics["rollout/seconds"] >= 2.5
            assert g.metrics["rollout/gen_tokens"] == sum(sum(s.loss_mask) for s in g.sequences)
            for s in g.sequences:
                prompt_len = s.loss_mask.index(1)
                check_sequence_invariants(s, prompt_len)
                assert s.min_version == 0 and s.max_version == 0

        dead = [
            r.record
            for r in read_all(kafka_config, topo.full_name("dlq"), idle_s=0.5, expect=DeadLetter)
        ]
        assert len(dead) == 1 and "TaskError" in dead[0].error
        assert dead[0].component_id == "raas.default/a"
        status = [
            r.record
            for r in read_all(
                kafka_config, topo.full_name("status"), idle_s=0.5, expect=ComponentStatus
            )
        ]
        mine = [s for s in status if s.component_id == "raas.default/b"]
        assert mine and all(s.kind == "raas" and s.weight_versions == {"actor": 0} for s in mine)
        assert mine[-1].produced == 1 and mine[-1].busy_s > 0
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait(10)


@pytest.mark.slow
def test_node_follows_published_weights(kafka_config, make_topology, tmp_path):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode
    from astraflow.weights import FileBlobStore, WeightPublisher

    topo, _ = node_topology(make_topology, **{"weights.actor": {"partitions": 1}})
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    store = FileBlobStore(str(tmp_path / "blobs"))
    pub = WeightPublisher(store, "actor", anchor_interval=10)
    v0 = {k: v.clone() for k, v in eng.model.state_dict().items()}
    v1 = {k: v + 0.01 * torch.randn_like(v) for k, v in v0.items()}
    producer = RecordProducer(kafka_config)
    for state in (v0, v1):
        for m in pub.publish(state):
            producer.produce(topo.full_name("weights.actor"), m, key="actor")
    producer.produce(
        topo.full_name("tasks"), task_of({"prompt": "1+2=", "answer": "3"}), key="p-t0"
    )
    producer.flush()

    node = RaaSNode(
        topo,
        {"actor": eng},
        NodeOptions(
            instance="w",
            n_samples=2,
            poll_timeout_s=0.2,
            workflow_options={"single_turn": {"max_new_tokens": 6}},
        ),
    )
    with running(node) as thread:
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: read_all(kafka_config, out, idle_s=0.3), 60, "a trajectory group")
        (g,) = [r.record for r in read_all(kafka_config, out, idle_s=0.3, expect=TrajectoryGroup)]
        assert all(s.min_version == 1 and s.max_version == 1 for s in g.sequences)
        assert eng.version == 1
        for k, t in eng.model.state_dict().items():
            assert torch.equal(t, v1[k]), k
    assert not thread.is_alive()
    assert node.status().weight_versions == {"actor": 1}
    m = node.status().metrics  # the update's time, as a remote pool's bench reads it
    assert m["raas/weight_updates"] == 1 and m["raas/weight_sync_s"] == m[
        "raas/weight_sync_last_s"] > 0


@pytest.mark.slow
def test_node_rolls_out_several_tasks_per_transaction_as_one_batch(kafka_config, make_topology):
    from astraflow.kafka.clients import RecordProducer, read_all
    from astraflow.raas.node import NodeOptions, RaaSNode

    topo, _ = node_topology(make_topology)
    eng = TorchEngine(tiny_model(), tiny_tokenizer(), policy="actor", version=0)
    calls: list[int] = []
    real = eng.generate
    eng.generate = lambda prompts, params: calls.append(len(prompts)) or real(prompts, params)
    producer = RecordProducer(kafka_config)
    tasks = topo.full_name("tasks")
    bad_workflow = task_of({"prompt": "1+1=", "answer": "2"}, "no_such_workflow", "nowf")
    for t in (task_of({"prompt": "1+2=", "answer": "3"}, tid="t0"),
              task_of("{not json", tid="bad"),
              task_of({"prompt": "2+2=", "answer": "4"}, tid="t1"),
              bad_workflow,
              task_of({"prompt": "3+4=", "answer": "7"}, tid="t2")):
        producer.produce(tasks, t, key=f"p-{t.task_id}")
    producer.flush()
    node = RaaSNode(topo, {"actor": eng}, NodeOptions(
        instance="w", n_samples=2, poll_timeout_s=1.0, tasks_per_transaction=8,
        workflow_options={"single_turn": {"max_new_tokens": 4}}))
    with running(node):
        out = topo.full_name("trajectories.raw")
        wait_for(lambda: len(read_all(kafka_config, out, idle_s=0.3)) >= 3, 60, "three groups")
        groups = [r.record for r in read_all(kafka_config, out, idle_s=0.3,
                                             expect=TrajectoryGroup)]
        dead = [r.record for r in read_all(kafka_config, topo.full_name("dlq"), idle_s=0.5,
                                           expect=DeadLetter)]
    assert [g.task_id for g in groups] == ["t0", "t1", "t2"]
    assert all(len(g.sequences) == 2 for g in groups)
    assert sorted(d.error.split(":")[0] for d in dead) == ["TaskError", "TaskError"]
    assert any("no_such_workflow" in d.error for d in dead)
    # the three good tasks were one generate call of 3 prompts (2 samples each), unless
    # the poll returned them in pieces
    assert sum(calls) == 3 and max(calls) > 1
