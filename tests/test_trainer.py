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


def test_zero_advantage_sequences_are_skipped_without_changing_the_update(tiny_model):
    import dataclasses

    from astraflow.trainer.loss import policy_loss
    from astraflow.trainer.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    batch = make_batch(5, groups=3)
    # group 0 all right: no signal, so the trainer must not run it
    flat = dataclasses.replace(batch.groups[0], sequences=[
        dataclasses.replace(s, reward=1.0) for s in batch.groups[0].sequences])
    batch = dataclasses.replace(batch, groups=[flat, *batch.groups[1:]])
    cfg = TrainerConfig(lr=1e-3, micro_batch_size=4)
    tr = Trainer(tiny_model, cfg, policy="actor")
    calls: list[int] = []
    real = tr.token_logprobs
    tr.token_logprobs = lambda ids, attn: calls.append(len(ids)) or real(ids, attn)
    m = tr.train_step(batch)
    assert sum(calls) == 8  # the 8 sequences of the two groups with signal, not 12
    assert m["trainer/zero_advantage_frac"] == pytest.approx(4 / 12)
    assert m["trainer/sequences"] == 12.0

    # the reference: one pass over every sequence, the loss divided by all their tokens
    ref = Trainer(tiny_model, cfg, policy="actor")
    rows = ref._rows(batch)
    ids, attn, behaviour, mask, adv = ref._tensors(rows)
    out = policy_loss(ref.token_logprobs(ids, attn), behaviour, adv, mask,
                      clip_low=cfg.clip_low, clip_high=cfg.clip_high, tis_cap=cfg.tis_cap)
    ref.optimizer.zero_grad()
    out.loss.backward()
    torch.nn.utils.clip_grad_norm_(ref.model.parameters(), cfg.max_grad_norm)
    ref.optimizer.step()
    assert m["trainer/loss"] == pytest.approx(out.loss.item(), rel=1e-4, abs=1e-7)
    for (k, a), b in zip(tr.state_dict().items(), ref.state_dict().values()):
        assert torch.allclose(a, b, atol=1e-6), k

    # a batch without any signal still takes the optimizer step (Adam's momentum moves on)
    still = Trainer(tiny_model, cfg, policy="actor")
    still.train_step(batch)
    before = {k: v.clone() for k, v in still.state_dict().items()}
    calls.clear()
    still.token_logprobs = lambda ids, attn: calls.append(len(ids)) or real(ids, attn)
    m = still.train_step(dataclasses.replace(batch, groups=[flat]))
    assert calls == [] and m["trainer/zero_advantage_frac"] == 1.0
    assert any(not torch.equal(before[k], v) for k, v in still.state_dict().items())


def test_published_state_rounds_fp32_master_weights(tiny_model):
    from astraflow.trainer.trainer import Trainer, TrainerConfig
    from astraflow.weights.delta import state_bytes_equal

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-4, micro_batch_size=3), policy="actor")
    assert tr.config.publish_dtype == "bf16" and tr.keeps_master  # the default
    tr.train_step(make_batch(0))
    master, published = tr.state_dict(), tr.published_state()
    assert {v.dtype for v in master.values()} == {torch.float32}
    assert {v.dtype for v in published.values()} == {torch.bfloat16}
    for k, v in published.items():
        assert torch.equal(v, master[k].to(torch.bfloat16)), k
    # the master weights round-trip bit for bit; loading them into a bf16 model is refused
    data = tr.master_bytes()
    other = Trainer(tiny_model, TrainerConfig(lr=1e-4, micro_batch_size=3), policy="actor")
    assert not state_bytes_equal(other.state_dict(), master)
    other.load_master_bytes(data)
    assert state_bytes_equal(other.state_dict(), master)
    half = Trainer(tiny_model, TrainerConfig(dtype="bf16"), policy="actor")
    assert not half.keeps_master  # trains in bf16: the published weights are the weights
    with pytest.raises(ValueError, match="--dtype"):
        half.load_master_bytes(data)
    same = Trainer(tiny_model, TrainerConfig(publish_dtype="same"), policy="actor")
    assert not same.keeps_master
    assert {v.dtype for v in same.published_state().values()} == {torch.float32}
    with pytest.raises(ValueError, match="publish_dtype"):
        Trainer(tiny_model, TrainerConfig(publish_dtype="int8"), policy="actor")


def test_engine_computes_in_its_own_dtype_with_bf16_published_weights(tiny_model):
    """A RaaS engine (fp32 model) loads the published bf16 state: values cast, dtype kept."""
    from transformers import AutoModelForCausalLM

    from astraflow.raas.engine import SamplingParams, TorchEngine
    from astraflow.trainer.trainer import Trainer, TrainerConfig

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerConfig(lr=1e-3, micro_batch_size=3), policy="actor")
    tr.train_step(make_batch(0))
    published = tr.published_state()
    engine = TorchEngine(
        AutoModelForCausalLM.from_pretrained(tiny_model, local_files_only=True), None
    )
    engine.load_state_dict(published, 1)
    held = engine.state_dict()
    assert engine.version == 1 and {v.dtype for v in held.values()} == {torch.float32}
    for k, v in published.items():
        assert torch.equal(held[k], v.float()), k
    (gens,) = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, seed=0))
    assert len(gens[0].token_ids) == 3


def _optimizer_states_equal(a: dict, b: dict) -> bool:
    """Bit-identical optimizer ``state_dict()``s (tensors compared by their bytes)."""
    if a["param_groups"] != b["param_groups"] or a["state"].keys() != b["state"].keys():
        return False
    for i, sa in a["state"].items():
        sb = b["state"][i]
        if sa.keys() != sb.keys():
            return False
        for k, x in sa.items():
            y = sb[k]
            if isinstance(x, torch.Tensor):
                if not (
                    isinstance(y, torch.Tensor)
                    and x.dtype == y.dtype
                    and x.shape == y.shape
                    and torch.equal(x.view(-1).view(torch.uint8), y.view(-1).view(torch.uint8))
                ):
                    return False
            elif x != y:
                return False
    return True


# --------------------------------------------------------------------------- on Kafka
@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("publish", [None, "same"], ids=["publish-bf16-default", "publish-same"])
def test_trainer_resumes_exactly_after_sigkill(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, publish
):
    """Default: fp32 master weights, bf16 published; ``same``: fp32 published."""
    import io

    from astraflow.trainer.trainer import Trainer, TrainerConfig
    from astraflow.weights.delta import state_bytes_equal
    from astraflow.weights.history import WeightFollower
    from astraflow.weights.kafka_store import read_manifests
    from astraflow.weights.store import FileBlobStore

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

    lr = "1e-4"  # the tiny random model's weights are ~0.02: larger rates move every bf16
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
        *(["--publish-dtype", publish] if publish else []),
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
    master_log = "master weights loaded" if publish is None else "master weights the published"
    assert master_log in text, text[-3000:]

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
        assert ("master_sha256" in m.meta) == (publish is None)

    # the uninterrupted reference run over the same (decoded) batches
    torch.set_num_threads(1)
    ref = Trainer(
        tiny_model,
        TrainerConfig(lr=float(lr), micro_batch_size=3, publish_dtype=publish or "bf16"),
        policy="actor",
    )
    masters = {0: {k: v.clone() for k, v in ref.state_dict().items()}}
    states = {0: {k: v.clone() for k, v in ref.published_state().items()}}
    for k, r in enumerate(sent, start=1):
        ref.train_step(r.record)
        masters[k] = {k2: v.clone() for k2, v in ref.state_dict().items()}
        states[k] = {k2: v.clone() for k2, v in ref.published_state().items()}
    # every published version, resumed or not, equals the reference bit for bit
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    for target in range(n + 1):
        follower.update(target)
        assert state_bytes_equal(follower.state, states[target]), f"version {target} differs"
    dtype = "float32" if publish == "same" else "bfloat16"
    assert {m.dtype for m in manifests} == {dtype}
    # the resumed trainer's master weights and optimizer state, as saved with version n
    # (the newest keep-optimizer versions keep them), equal the uninterrupted run's
    store = FileBlobStore(tmp_path / "state" / "blobs", create=False)
    (last,) = [m for m in manifests if m.version == n]
    opt = torch.load(
        io.BytesIO(store.get(_meta_ref(last.meta, "optimizer"))), weights_only=True
    )
    assert _optimizer_states_equal(opt, ref.optimizer.state_dict())
    if publish is None:
        master = torch.load(
            io.BytesIO(store.get(_meta_ref(last.meta, "master"))), weights_only=True
        )
        assert state_bytes_equal(master, masters[n])
        # the optimizer and master blobs of the newest 3 versions are kept (--keep-optimizer),
        # older ones the resumed trainer knew of (version 2's) are deleted
        kept = {".".join(b.blob_id.split(".")[1:3]) for b in store.list()}
        for v in range(n - 2, n + 1):
            assert {f"v{v:08d}.optim", f"v{v:08d}.master"} <= kept, (v, kept)
        assert not kept & {"v00000002.optim", "v00000002.master"}, kept

    # delta sparsity: AdamW moves every fp32 weight each step, but only some of them cross
    # a bf16 rounding step (at this lr about 0.3-0.5 of the bf16 weights stay unchanged)
    deltas = {m.version: m for m in manifests if m.kind == "delta"}
    fp32_unchanged = [
        sum(int((masters[v][k] == masters[v - 1][k]).sum()) for k in masters[v])
        / sum(t.numel() for t in masters[v].values())
        for v in range(1, n + 1)
    ]
    assert max(fp32_unchanged) < 0.05, fp32_unchanged
    if publish is None:
        sparsity = [deltas[v].sparsity for v in range(1, n + 1)]
        assert min(sparsity[2:]) > 0.25 and max(fp32_unchanged) + 0.2 < min(sparsity[2:]), (
            sparsity
        )
    else:
        assert max(deltas[v].sparsity for v in range(1, n + 1)) < 0.05


def _meta_ref(meta: dict[str, str], kind: str):
    from astraflow.records import BlobRef

    return BlobRef(
        uri=meta[f"{kind}_uri"], bytes=int(meta[f"{kind}_bytes"]), sha256=meta[f"{kind}_sha256"]
    )


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


@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_master_blob_restores_exactly_and_is_checksummed(
    kafka_config, make_topology, tiny_model, tmp_path
):
    """In process: the restored fp32 master weights and optimizer state equal the trainer's
    that wrote them; a master blob whose bytes changed is refused (sha256)."""
    from astraflow.trainer.service import ServiceOptions, TrainerService
    from astraflow.trainer.trainer import TrainerConfig
    from astraflow.weights.delta import state_bytes_equal
    from astraflow.weights.kafka_store import read_manifests

    topo, _ = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    producer = RecordProducer(kafka_config)
    for i in range(2):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def options(**kw) -> ServiceOptions:
        return ServiceOptions(
            policy="actor",
            model_path=tiny_model,
            state_dir=str(tmp_path / "state"),
            poll_timeout_s=0.2,
            trainer=TrainerConfig(lr=1e-4, micro_batch_size=3),
            **kw,
        )

    first = TrainerService(topo, options(max_steps=2), config=kafka_config)
    first.run()
    assert first.version == 2

    second = TrainerService(topo, options(), config=kafka_config)
    second._open()
    second._restore()
    assert second.resumed_from == 2
    assert second.trainer.state_dict()["model.norm.weight"].dtype == torch.float32
    assert state_bytes_equal(second.trainer.state_dict(), first.trainer.state_dict())
    assert _optimizer_states_equal(
        second.trainer.optimizer.state_dict(), first.trainer.optimizer.state_dict()
    )
    assert state_bytes_equal(second.publisher._prev, first.publisher._prev)
    second.store.close()

    (v2,) = [m for m in read_manifests(kafka_config, topo.full_name("weights.actor"))
             if m.version == 2]
    assert v2.dtype == "bfloat16"
    blob = tmp_path / "state" / "blobs" / v2.meta["master_uri"].rsplit("/", 1)[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    blob.write_bytes(bytes(data))
    third = TrainerService(topo, options(), config=kafka_config)
    third._open()
    with pytest.raises(RuntimeError, match="master state of version 2.*sha256"):
        third._restore()
    third.store.close()
