"""The trainer: loss maths, a step on a tiny model, and exact resume after SIGKILL on Kafka."""

from __future__ import annotations

import math
import os
import random
import signal
import subprocess
import sys

import pytest
import torch

from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.records import Batch, ComponentStatus, Sequence, TrajectoryGroup
from astraflow.trainer.loss import group_advantages, policy_loss

from .conftest import REPO, wait_for

VOCAB = 64


# --------------------------------------------------------------------------- maths
def test_group_advantages():
    a, b, c = group_advantages([[1.0, 0.0, 0.0, 1.0], [2.0, 2.0], [5.0]])
    assert torch.allclose(a, torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5)  # std 0.5
    assert torch.equal(b, torch.zeros(2)) and torch.equal(c, torch.zeros(1))
    (d,) = group_advantages([[3.0, 1.0]], normalize_std=False)
    assert torch.allclose(d, torch.tensor([1.0, -1.0]))
    (e,) = group_advantages([[0.0, 1.0, 2.0]], eps=0.0)
    assert torch.allclose(e, torch.tensor([-1.0, 0.0, 1.0]) / math.sqrt(2 / 3))


def test_policy_loss_hand_computed():
    # ratios r = exp(new - behaviour); clip [0.8, 1.28]; tis cap 2.0
    r = torch.tensor([1.1, 1.5, 0.5, 0.5, 1.5, 3.0, 1.0])
    adv = torch.tensor([1.0, 1.0, 1.0, -1.0, -1.0, -2.0, 5.0])
    mask = torch.tensor([1, 1, 1, 1, 1, 1, 0])
    behaviour = torch.full((7,), -1.0)
    new = (behaviour + torch.log(r)).requires_grad_(True)
    out = policy_loss(new, behaviour, adv, mask, clip_low=0.2, clip_high=0.28, tis_cap=2.0)
    # per token objective:
    #  1.1*1 (inside) | 1.28*1 (high clip) | 0.5*1 (unclipped, below) | 0.8*-1 (low clip)
    #  1.5*-1 (open side, below cap) | 2.0*-2 (open side, truncated at the cap)
    expected = [1.1, 1.28, 0.5, -0.8, -1.5, -4.0]
    assert out.loss.item() == pytest.approx(-sum(expected) / 6, rel=1e-5)
    out.loss.backward()
    # d loss / d new_t = -(weight * A_t)/N with weight r (inside or unclipped), 0 (clipped),
    # min(r, cap) (truncated)
    grad = [-1.1 * 1, 0.0, -0.5 * 1, 0.0, -1.5 * -1, -2.0 * -2, 0.0]
    assert torch.allclose(new.grad, torch.tensor(grad) / 6, atol=1e-6)
    m = out.metrics
    assert m["clip_frac_high"] == pytest.approx(1 / 6)
    assert m["clip_frac_low"] == pytest.approx(1 / 6)
    assert m["clip_frac"] == pytest.approx(2 / 6)
    assert m["truncated_frac"] == pytest.approx(1 / 6)
    assert m["ratio_max"] == pytest.approx(3.0, rel=1e-5)
    assert m["ratio_mean"] == pytest.approx(sum(r[:6].tolist()) / 6, rel=1e-5)
    kl = sum(x - 1 - math.log(x) for x in r[:6].tolist()) / 6
    assert m["approx_kl"] == pytest.approx(kl, rel=1e-5)
    # a global token count (micro-batching) only rescales
    out2 = policy_loss(new, behaviour, adv, mask, num_tokens=12)
    assert out2.loss.item() == pytest.approx(out.loss.item() / 2, rel=1e-5)
    with pytest.raises(ValueError):
        policy_loss(new, behaviour, adv, mask, clip_high=0.28, tis_cap=1.2)


# --------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=128,
    )
    path = tmp_path_factory.mktemp("tiny-qwen2")
    Qwen2ForCausalLM(cfg).save_pretrained(path)
    return str(path)


def make_batch(i: int, groups: int = 2, samples: int = 4, seed: int = 0) -> Batch:
    rng = random.Random(seed * 1000 + i)
    out = []
    for g in range(groups):
        prompt = [rng.randrange(1, VOCAB) for _ in range(rng.randint(3, 6))]
        seqs = []
        for s in range(samples):
            gen = [rng.randrange(1, VOCAB) for _ in range(rng.randint(2, 7))]
            n = len(prompt) + len(gen)
            seqs.append(
                Sequence(
                    policy="actor",
                    token_ids=prompt + gen,
                    loss_mask=[0] * len(prompt) + [1] * len(gen),
                    logprobs=[0.0] * len(prompt)
                    + [-math.log(VOCAB) + rng.uniform(-0.3, 0.3) for _ in gen],
                    versions=[-1] * len(prompt) + [max(0, i - 1)] * len(gen),
                    reward=float(rng.random() < 0.5) + 0.1 * s,
                    sample_index=s,
                    finish_reason="stop",
                )
            )
            assert len(seqs[-1].token_ids) == n
        out.append(
            TrajectoryGroup(
                group_id=f"b{i}g{g}",
                prompt_id=f"p{g}",
                task_id=f"t{g}",
                workflow="single_turn",
                source="test",
                raas_id="r",
                pool="p",
                sequences=seqs,
                rewards=[x.reward for x in seqs],
            )
        )
    return Batch(policy="actor", batch_id=f"batch-{i}", groups=out)


def test_train_step_raises_logprob_of_positive_advantage_tokens(tiny_model):
    from astraflow.trainer.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerConfig(lr=3e-3, micro_batch_size=3), policy="actor")
    batch = make_batch(0)
    rows = tr._rows(batch)

    def seq_logprob() -> list[float]:
        with torch.no_grad():
            ids, attn, _, mask, _ = tr._tensors(rows)
            return (tr.token_logprobs(ids, attn) * mask).sum(1).tolist()

    before = seq_logprob()
    m = tr.train_step(batch, current_version=3)
    after = seq_logprob()
    for key in (
        "trainer/loss",
        "trainer/reward_mean",
        "trainer/clip_frac",
        "trainer/grad_norm",
        "trainer/step_seconds",
        "trainer/approx_kl",
        "trainer/staleness_mean",
    ):
        assert key in m and math.isfinite(m[key]), key
    assert m["trainer/staleness_mean"] == 3.0
    pos = [a - b for r, a, b in zip(rows, after, before) if r.advantage > 0]
    neg = [a - b for r, a, b in zip(rows, after, before) if r.advantage < 0]
    assert pos and neg
    assert sum(pos) / len(pos) > 0 > sum(neg) / len(neg)
    # micro-batching gives the same step as one full pass
    t1 = Trainer(tiny_model, TrainerConfig(lr=1e-3, micro_batch_size=1), policy="actor")
    t8 = Trainer(tiny_model, TrainerConfig(lr=1e-3, micro_batch_size=8), policy="actor")
    t1.train_step(batch)
    t8.train_step(batch)
    for (k, a), b in zip(t1.state_dict().items(), t8.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k


# --------------------------------------------------------------------------- on Kafka
@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_resumes_exactly_after_sigkill(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path
):
    from astraflow.trainer.trainer import Trainer, TrainerConfig
    from astraflow.weights.delta import state_bytes_equal
    from astraflow.weights.history import WeightFollower
    from astraflow.weights.kafka_store import read_manifests

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    batches_topic = topo.full_name("batches.actor")
    weights_topic = topo.full_name("weights.actor")
    n = 6
    producer = RecordProducer(kafka_config)
    for i in range(n):
        producer.produce(batches_topic, make_batch(i), key="actor")
    producer.flush()
    sent = read_all(kafka_config, batches_topic, idle_s=1.0, expect=Batch)
    assert len(sent) == n

    lr = "2e-3"
    log = tmp_path / "trainer.log"
    cmd = [
        sys.executable,
        "-m",
        "astraflow.cli",
        "trainer",
        "run",
        "--topology",
        str(path),
        "--policy",
        "actor",
        "--model",
        tiny_model,
        "--state-dir",
        str(tmp_path / "state"),
        "--lr",
        lr,
        "--anchor-interval",
        "4",
        "--threads",
        "1",
        "--micro-batch-size",
        "3",
        "--instance",
        "0",
    ]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    # first run: SIGKILLs itself with version 3's transaction open (blobs written,
    # manifests and offsets sent, no commit)
    with open(log, "ab") as out:
        p = subprocess.Popen(
            cmd,
            env={**env, "ASTRAFLOW_TRAINER_CRASH_AT": "3"},
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        assert p.wait(120) == -signal.SIGKILL, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    versions = sorted({m.version for m in read_manifests(kafka_config, weights_topic)})
    assert versions == [0, 1, 2], versions

    # second run: resumes at version 2, trains the remaining batches, SIGTERM exits 0
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(
            lambda: (
                max((m.version for m in read_manifests(kafka_config, weights_topic)), default=-1)
                >= n
            ),
            120,
            f"version {n}",
            step=1.0,
        )
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    text = log.read_text()
    assert "resumed at version 2" in text, text[-3000:]
    assert "matches version 2's manifest" in text, text[-3000:]

    statuses = [
        r.record
        for r in read_all(
            kafka_config, topo.full_name("status"), idle_s=1.0, expect=ComponentStatus
        )
    ]
    mine = [s for s in statuses if s.kind == "trainer" and s.policy == "actor"]
    assert mine and max(s.weight_versions["actor"] for s in mine) >= 3
    assert all("trainer/wait_fraction" in s.metrics for s in mine)

    manifests = read_manifests(kafka_config, weights_topic)
    deltas = sorted(m.version for m in manifests if m.kind == "delta")
    fulls = sorted(m.version for m in manifests if m.kind == "full")
    assert deltas == list(range(1, n + 1)) and fulls == [0, 4]
    # every batch trained exactly once, in order: version k consumed batch k-1
    for m in manifests:
        if m.version == 0:
            assert m.consumed_offsets == []
            continue
        (po,) = m.consumed_offsets
        assert (po.topic, po.partition) == (batches_topic, 0)
        assert po.offset == sent[m.version - 1].offset + 1
        assert m.meta["batch_id"] == f"batch-{m.version - 1}"
        assert "optimizer_sha256" in m.meta

    # the uninterrupted reference run over the same (decoded) batches
    torch.set_num_threads(1)
    ref = Trainer(tiny_model, TrainerConfig(lr=float(lr), micro_batch_size=3), policy="actor")
    states = {0: {k: v.clone() for k, v in ref.state_dict().items()}}
    for k, r in enumerate(sent, start=1):
        ref.train_step(r.record)
        states[k] = {k2: v.clone() for k2, v in ref.state_dict().items()}
    for target in (2, n):
        follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
        follower.observe(manifests)
        follower.update(target)
        assert state_bytes_equal(follower.state, states[target]), f"version {target} differs"


def test_group_staleness_guard_drops_old_groups():
    from astraflow.records import Sequence, TrajectoryGroup
    from astraflow.trainer.trainer import _group_staleness

    def grp(versions):
        s = Sequence(policy="actor", token_ids=[1, 2, 3], loss_mask=[0, 1, 1],
                     logprobs=[0.0, -1.0, -1.0], versions=versions, reward=1.0, sample_index=0,
                     finish_reason="stop")
        return TrajectoryGroup(group_id="g", prompt_id="p", task_id="t", workflow="w",
                               source="s", raas_id="r", pool="p", sequences=[s], rewards=[1.0])

    assert _group_staleness(grp([-1, 3, 5]), "actor", 7) == 4
    assert _group_staleness(grp([-1, -1, -1]), "actor", 7) == 0
    assert _group_staleness(grp([-1, 3, 5]), "other", 7) == 0
