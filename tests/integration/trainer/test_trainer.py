"""The trainer on a broker: exact resume after SIGKILL, the versions after the newest state
recomputed on resume, state written in the background and restored exactly, a dead letter not
written twice after a crash, a batch that decodes but makes no sense dead-lettered, blobs older
than the kept versions pruned, and a reader without the model building it from the weight
stream."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from astraflow.kafka.clients import RecordProducer, read_all
from astraflow.wire.records import Batch, ComponentStatus
from tests.conftest import REPO, wait_for
from tests.unit.trainer.test_trainer import (  # noqa: F401 (fixtures)
    VOCAB,
    _optimizer_states_equal,
    make_batch,
    tiny_model,
)

# no staleness bound in practice: the trainer tests' batches are all of version 0
NO_STALENESS_BOUND = 10**9


def service_options(model: str, state_dir: Path | str, *, max_staleness: int =
                    NO_STALENESS_BOUND, temperature: float = 1.0, **trainer):
    """The ``ServiceOptions`` of a test's trainer of policy ``actor``: its typed section
    (``trainer``: its ``trainer:`` keys over lr 1e-4 and 3 sequences per micro-batch) and
    a short poll."""
    from astraflow.config.sections import PolicySpec
    from astraflow.trainer.service import ServiceOptions

    section = {"lr": 1e-4, "micro_batch_size": 3, "state_dir": str(state_dir), **trainer}
    return ServiceOptions("actor", PolicySpec(
        model=model, trainer=section, max_staleness=max_staleness, temperature=temperature),
        poll_timeout_s=0.2)


# --------------------------------------------------------------------------- on Kafka
def batches_on_kafka(make_topology, kafka_config, batches: list[Batch]):
    """A topology of one policy (``batches.actor`` and ``weights.actor`` of a partition
    each) with ``batches`` on its batches topic: the topology, its file and the records as
    read back (their offsets)."""
    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}})
    producer = RecordProducer(kafka_config)
    for b in batches:
        producer.produce(topo.full_name("batches.actor"), b, key="actor")
    producer.flush()
    sent = read_all(kafka_config, topo.full_name("batches.actor"), idle_s=1.0, expect=Batch)
    assert len(sent) == len(batches)
    return topo, path, sent


def _crash_then_resume(kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, *,  # noqa: F811
                       n: int, crash_at: int, args: list[str]):
    """``astraflow trainer run`` over ``n`` batches: SIGKILLed with version ``crash_at``'s
    transaction open (blobs written, manifests and offsets sent, no commit), then restarted
    until version ``n`` and stopped with SIGTERM. Returns the batches sent, the manifests
    after the crash and at the end, and the log."""
    from astraflow.weights.stores.kafka import read_manifests

    batches_topic = topo.full_name("batches.actor")
    weights_topic = topo.full_name("weights.actor")
    producer = RecordProducer(kafka_config)
    for i in range(n):
        producer.produce(batches_topic, make_batch(i), key="actor")
    producer.flush()
    sent = read_all(kafka_config, batches_topic, idle_s=1.0, expect=Batch)
    assert len(sent) == n
    log = tmp_path / "trainer.log"
    cmd = [sys.executable, "-m", "astraflow.cli.main", "trainer", "run", "--topology", str(path),
           "--policy", "actor", "--model", tiny_model, "--state-dir", str(tmp_path / "state"),
           "--anchor-interval", "4", "--threads", "1", "--instance", "0", *args]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env={**env, "ASTRAFLOW_TRAINER_CRASH_AT": str(crash_at)},
                             stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        assert p.wait(180) == -signal.SIGKILL, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    before = read_manifests(kafka_config, weights_topic)
    assert sorted({m.version for m in before}) == list(range(crash_at))

    def newest() -> int:
        return max((m.version for m in read_manifests(kafka_config, weights_topic)), default=-1)

    with open(log, "ab") as out:
        p = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: newest() >= n, 180, f"version {n}", step=1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0, log.read_text()[-3000:]
    finally:
        if p.poll() is None:
            p.kill()
    return sent, before, read_manifests(kafka_config, weights_topic), log.read_text()


def _reference(tiny_model, sent, spec, **policy) -> dict[str, dict]:  # noqa: F811
    """The uninterrupted run over the same (decoded) batches: per version its master
    weights, published weights and optimizer state (``policy``: the Trainer's keywords)."""
    import copy

    from astraflow.trainer.trainer import Trainer

    torch.set_num_threads(1)
    ref = Trainer(tiny_model, spec, policy="actor", **policy)
    out: dict[str, dict] = {"master": {}, "published": {}, "optimizer": {}}

    def keep(v: int) -> None:
        out["master"][v] = {k: t.clone() for k, t in ref.state_dict().items()}
        out["published"][v] = {k: t.clone() for k, t in ref.published_state().items()}
        out["optimizer"][v] = copy.deepcopy(ref.optimizer.state_dict())

    keep(0)
    for v, r in enumerate(sent, start=1):
        ref.train_step(r.record)
        keep(v)
    return out


def _check_history(kafka_config, manifests, sent, ref, batches_topic: str) -> None:
    """Versions 1..n contiguous, version v trained on batch v-1 (each batch once), and
    every published version equal to the uninterrupted run's bit for bit."""
    from astraflow.weights.bits import state_bytes_equal
    from astraflow.weights.follower import WeightFollower

    n = len(sent)
    assert sorted(m.version for m in manifests if m.kind == "delta") == list(range(1, n + 1))
    for m in manifests:
        if m.version == 0:
            assert m.consumed_offsets == []
            continue
        (po,) = m.consumed_offsets
        assert (po.topic, po.partition) == (batches_topic, 0)
        assert po.offset == sent[m.version - 1].offset + 1
        assert m.meta["batch_id"] == f"batch-{m.version - 1}"
        assert int(m.meta["batch_offset"]) == sent[m.version - 1].offset
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    for target in range(n + 1):
        follower.update(target)
        assert state_bytes_equal(follower.state, ref["published"][target]), target


def _recorded(manifests) -> dict[int, object]:
    """state version -> the manifest that records it."""
    from astraflow.trainer.state import recorded_state_version

    out = {}
    for m in sorted(manifests, key=lambda m: m.version):
        v = recorded_state_version(m.version, m.meta)
        if v is not None:
            assert v not in out or out[v].meta["optimizer_uri"] == m.meta["optimizer_uri"]
            out.setdefault(v, m)
    return out


def _check_state_blobs(store, manifest, ref, version: int, master: bool) -> None:
    """The state blobs a manifest records equal the uninterrupted run's at ``version``."""
    import io

    from astraflow.weights.bits import state_bytes_equal

    opt = torch.load(io.BytesIO(store.get(_meta_ref(manifest.meta, "optimizer"))),
                     weights_only=True)
    assert _optimizer_states_equal(opt, ref["optimizer"][version]), version
    assert ("master_uri" in manifest.meta) == master
    if master:
        weights = torch.load(io.BytesIO(store.get(_meta_ref(manifest.meta, "master"))),
                             weights_only=True)
        assert state_bytes_equal(weights, ref["master"][version]), version


@pytest.mark.kafka
@pytest.mark.slow
@pytest.mark.parametrize("publish,overlap", [(None, "off"), ("same", "off"), (None, "on")],
                         ids=["publish-bf16-default", "publish-same", "publish-overlap"])
def test_trainer_resumes_exactly_after_sigkill(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, publish, overlap  # noqa: F811
):
    """State written every version. Default: fp32 master weights, bf16 published; ``same``:
    fp32 published. ``publish-overlap``: each version is written while the next batch
    trains and committed with the next step (its batch's offset held back until then):
    the SIGKILL then comes with batch 4 trained and version 3's transaction open."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.weights.stores import FileBlobStore

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    n = 6
    lr = "1e-4"  # the tiny random model's weights are ~0.02: larger rates move every bf16
    sent, before, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, n=n, crash_at=3,
        args=["--lr", lr, "--micro-batch-size", "3", "--state-interval", "1",
              "--publish-overlap", overlap,
              *(["--publish-dtype", publish] if publish else [])])
    # every version's state is recorded by the next version's manifest (lag <= interval):
    # version 1's by version 2's; version 2's was to go with the crashed version 3
    assert sorted(_recorded(before)) == [1]
    assert "resumed at version 2 from the state of version 1" in text, text[-3000:]
    assert "recomputed versions 2..2" in text, text[-3000:]
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

    assert sorted(m.version for m in manifests if m.kind == "full") == [0, 4]
    cfg = TrainerSpec(lr=float(lr), micro_batch_size=3, publish_dtype=publish or "bf16")
    ref = _reference(tiny_model, sent, cfg)
    _check_history(kafka_config, manifests, sent, ref, topo.full_name("batches.actor"))
    dtype = "float32" if publish == "same" else "bfloat16"
    assert {m.dtype for m in manifests} == {dtype}
    # version v's state is recorded by version v+1. Version 2's went with the crashed
    # transaction (its blobs are garbage) and the resumed trainer recomputed version 2
    # without writing it; the write after the last version is recorded by none and deleted
    # at the stop
    recorded = _recorded(manifests)
    assert sorted(recorded) == [1, *range(3, n)], sorted(recorded)
    assert all(m.version == v + 1 for v, m in recorded.items())
    store = FileBlobStore(tmp_path / "state" / "blobs", create=False)
    for v in (n - 1,):  # the resumed trainer's state equals the uninterrupted run's
        _check_state_blobs(store, recorded[v], ref, v, master=publish is None)
    # the newest 3 recorded states are kept (--keep-optimizer); older ones are deleted, and
    # so is the one written after the last version
    kept = {".".join(b.blob_id.split(".")[1:3]) for b in store.list()}
    kinds = ["optim", "master"] if publish is None else ["optim"]
    for v in range(n - 3, n):
        assert {f"v{v:08d}.{k}" for k in kinds} <= kept, (v, kept)
    for v in (1, n):
        assert not {f"v{v:08d}.{k}" for k in kinds} & kept, (v, kept)

    # delta sparsity: AdamW moves every fp32 weight each step, but only some of them cross
    # a bf16 rounding step (at this lr about 0.3-0.5 of the bf16 weights stay unchanged)
    masters = ref["master"]
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


@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_recomputes_the_versions_after_the_newest_state_on_resume(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path  # noqa: F811
):
    """State every 3 versions, crash between state writes (version 6's transaction open):
    the restart loads the state of version 3, recomputes 4 and 5 without publishing
    (checked against the published ones), then trains on. The real-model settings (bf16
    autocast, gradient checkpointing, token-budget micro-batches) and a learning-rate
    schedule that changes every step resume exactly too."""
    from astraflow.config.sections import TrainerSpec
    from astraflow.weights.stores import FileBlobStore

    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    n = 8
    sent, before, manifests, text = _crash_then_resume(
        kafka_config, kafka_bootstrap, topo, path, tiny_model, tmp_path, n=n, crash_at=6,
        args=["--lr", "1e-4", "--micro-batch-tokens", "40", "--autocast", "bf16",
              "--gradient-checkpointing", "--state-interval", "3", "--state-max-lag", "1",
              "--lr-warmup-steps", "2", "--lr-decay", "cosine", "--lr-final", "2e-5",
              "--lr-decay-steps", "5"])
    recorded_before = _recorded(before)
    assert sorted(recorded_before) == [3] and recorded_before[3].version == 4
    assert "resumed at version 5 from the state of version 3" in text, text[-3000:]
    assert "recomputed versions 4..5" in text, text[-3000:]
    assert "recomputed version 4 from batch batch-3" in text, text[-3000:]
    cfg = TrainerSpec(lr=1e-4, micro_batch_tokens=40, autocast="bf16",
                        gradient_checkpointing=True, lr_warmup_steps=2, lr_decay="cosine",
                        lr_final=2e-5, lr_decay_steps=5)
    ref = _reference(tiny_model, sent, cfg)
    _check_history(kafka_config, manifests, sent, ref, topo.full_name("batches.actor"))
    recorded = _recorded(manifests)
    assert {v: m.version for v, m in recorded.items()} == {3: 4, 6: 7}
    store = FileBlobStore(tmp_path / "state" / "blobs", create=False)
    for v, m in recorded.items():
        _check_state_blobs(store, m, ref, v, master=True)
    states = {".".join(b.blob_id.split(".")[1:3]) for b in store.list()
              if b.blob_id.split(".")[2] in ("optim", "master")}
    assert {s.split(".")[0] for s in states} == {"v00000003", "v00000006"}, states


def _meta_ref(meta: dict[str, str], kind: str):
    from astraflow.wire.records import BlobRef

    return BlobRef(
        uri=meta[f"{kind}_uri"], bytes=int(meta[f"{kind}_bytes"]), sha256=meta[f"{kind}_sha256"]
    )


@pytest.mark.kafka
@pytest.mark.slow
def test_trainer_state_is_written_in_the_background_and_restores_exactly(
    kafka_config, make_topology, tiny_model, tmp_path  # noqa: F811
):
    """In process, state every 2 versions: a write is recorded by a later manifest, at the
    latest by the next state's version; a restart recomputes the versions after the newest
    state and then equals the trainer that wrote them; a master blob whose bytes changed
    (sha256) is refused; other settings are published as a rebase version."""
    from astraflow.trainer.service import TrainerService
    from astraflow.weights.bits import state_bytes_equal
    from astraflow.weights.stores.kafka import read_manifests

    topo, _ = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    )
    producer = RecordProducer(kafka_config)
    for i in range(4):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def options(temperature: float = 1.0, **kw):
        return service_options(tiny_model, tmp_path / "state", temperature=temperature,
                               state_interval=2, **kw)

    def restored(**kw) -> TrainerService:
        svc = TrainerService(topo, options(**kw), config=kafka_config)
        svc._open()
        try:
            svc._restore()
        finally:
            svc.store.close()
        return svc

    # no state yet after version 1: the next run starts from version 0 (the model
    # directory) and recomputes version 1
    TrainerService(topo, options(max_steps=1), config=kafka_config).run()
    first = TrainerService(topo, options(max_steps=3), config=kafka_config)
    first.run()
    assert first.resumed_from == 1 and first.version == 4
    manifests = read_manifests(kafka_config, topo.full_name("weights.actor"))
    recorded = _recorded(manifests)
    assert list(recorded) == [2] and recorded[2].version in (3, 4), recorded
    assert first.state_version == 2
    blobs = [b.blob_id for b in first.store.list()]
    assert not [b for b in blobs if ".v00000004.optim" in b or ".v00000004.master" in b]

    second = restored()
    assert second.resumed_from == 4
    assert second.trainer.state_dict()["model.norm.weight"].dtype == torch.float32
    assert state_bytes_equal(second.trainer.state_dict(), first.trainer.state_dict())
    assert _optimizer_states_equal(
        second.trainer.optimizer.state_dict(), first.trainer.optimizer.state_dict()
    )
    assert state_bytes_equal(second.publishing.publisher._prev, first.publishing.publisher._prev)
    assert second.positions == first.positions

    assert recorded[2].dtype == "bfloat16"
    blob = tmp_path / "state" / "blobs" / recorded[2].meta["master_uri"].rsplit("/", 1)[1]
    data = bytearray(blob.read_bytes())
    data[len(data) // 2] ^= 0x01  # one flipped bit, same size
    blob.write_bytes(bytes(data))
    with pytest.raises(RuntimeError, match="master state of version 2.*sha256"):
        restored()
    data[len(data) // 2] ^= 0x01
    blob.write_bytes(bytes(data))

    # other settings recompute other weights: published as a rebase (version 5), not
    # refused (tests/integration/trainer/test_trainer_resume.py follows one through)
    rebased = TrainerService(topo, options(temperature=0.9), config=kafka_config)
    rebased.stop()  # start (restore, rebase), then stop at once
    rebased.run()
    assert rebased.resumed_from == 4 and rebased.version == 5
    assert max(m.version for m in read_manifests(
        kafka_config, topo.full_name("weights.actor"))) == 5


@pytest.mark.kafka
@pytest.mark.slow
def test_a_dead_letter_behind_a_held_version_is_not_written_twice_after_a_crash(
    kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path  # noqa: F811
):
    """publish_overlap on: version 1 (batch 0) is still being written when batch 1 turns out
    bad. Its dead letter commits together with version 1 and the offsets past batch 1, so
    a SIGKILL before that commit loses both and the restart writes the letter once."""
    from astraflow.weights.stores.kafka import read_manifests
    from astraflow.wire.records import DeadLetter

    topo, path = make_topology(topics={"batches.actor": {"partitions": 1},
                                       "weights.actor": {"partitions": 1}, "dlq": {}})
    bad = make_batch(1)
    seq = bad.groups[0].sequences[0]
    bad.groups[0].sequences[0] = dataclasses.replace(seq, logprobs=seq.logprobs[:-1])
    producer = RecordProducer(kafka_config)
    for b in (make_batch(0), bad, make_batch(2)):
        producer.produce(topo.full_name("batches.actor"), b, key="actor")
    producer.flush()
    cmd = [sys.executable, "-m", "astraflow.cli.main", "trainer", "run", "--topology", str(path),
           "--policy", "actor", "--model", tiny_model, "--state-dir", str(tmp_path / "state"),
           "--threads", "1", "--lr", "1e-4", "--micro-batch-size", "3",
           "--publish-overlap", "on"]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "PYTHONUNBUFFERED": "1"}
    log = tmp_path / "trainer.log"
    with open(log, "ab") as out:
        code = subprocess.run(cmd, env={**env, "ASTRAFLOW_TRAINER_CRASH_AT": "1"}, stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO, timeout=180).returncode
    assert code == -signal.SIGKILL, log.read_text()[-3000:]
    with open(log, "ab") as out:
        code = subprocess.run([*cmd, "--max-steps", "2"], env=env, stdout=out,
                              stderr=subprocess.STDOUT, cwd=REPO, timeout=180).returncode
    assert code == 0, log.read_text()[-3000:]
    manifests = read_manifests(kafka_config, topo.full_name("weights.actor"))
    assert sorted(m.version for m in manifests if m.kind == "delta") == [1, 2]
    assert {m.meta["batch_id"] for m in manifests if m.version} == {"batch-0", "batch-2"}
    letters = read_all(kafka_config, topo.full_name("dlq"), idle_s=1.0, expect=DeadLetter)
    assert len(letters) == 1, [r.record.error for r in letters]


@pytest.mark.kafka
def test_trainer_dead_letters_a_batch_that_decodes_but_makes_no_sense(
    kafka_config, make_topology, tiny_model, tmp_path  # noqa: F811
):
    """A group whose sequence fields differ in length, a NaN reward, or a token of a version
    not yet published goes to dlq with the reason; the trainer trains the good batches
    around them instead of crash-looping."""
    from astraflow.trainer.service import TrainerService
    from astraflow.wire.records import DeadLetter

    topo, _ = make_topology(topics={"batches.actor": {"partitions": 1},
                                    "weights.actor": {"partitions": 1}, "dlq": {}})
    good = make_batch(0)
    short = make_batch(1)
    seq = short.groups[0].sequences[0]
    short.groups[0].sequences[0] = dataclasses.replace(seq, logprobs=seq.logprobs[:-1])
    nan = make_batch(2)
    nan.groups[1].sequences[2] = dataclasses.replace(nan.groups[1].sequences[2],
                                                     reward=float("nan"))
    future = make_batch(1, seed=2)  # generated by version 7, which does not exist yet
    future.groups[0].sequences[1] = dataclasses.replace(
        future.groups[0].sequences[1],
        versions=[v if v < 0 else 7 for v in future.groups[0].sequences[1].versions])
    producer = RecordProducer(kafka_config)
    for b in (good, short, nan, future, make_batch(1, seed=3)):
        producer.produce(topo.full_name("batches.actor"), b, key="actor")
    producer.flush()
    torch.set_num_threads(1)
    svc = TrainerService(topo, service_options(tiny_model, tmp_path / "state", max_steps=2),
                         config=kafka_config)
    svc.run()
    assert svc.version == 2 and svc.counters.dead_lettered == 3
    dead = [r.record for r in read_all(kafka_config, topo.full_name("dlq"), expect=DeadLetter)]
    assert len(dead) == 3
    assert "generated by version 7, newer than the newest published (1)" in dead[2].error
    assert "logprobs (" in dead[0].error and "differ in length" in dead[0].error
    assert "InvalidRecord: Batch: group" in dead[0].error
    assert "reward is nan" in dead[1].error


@pytest.mark.kafka
@pytest.mark.parametrize("store", ["kafka", "file"])
def test_trainer_prunes_blobs_older_than_the_kept_versions(kafka_config, make_topology,
                                                          tiny_model, tmp_path, store):  # noqa: F811
    """With full checkpoints every 2 versions and 2 versions kept, the blobs of the old
    versions go (Kafka: DeleteRecords on weights.blobs; file: deleted), and a new reader
    still reaches the newest version; with keep_versions 0 everything stays."""

    from astraflow.trainer.service import TrainerService
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    topics = {"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1}}
    if store == "kafka":
        topics["weights.blobs"] = {"partitions": 1, "max_message_bytes": 16_777_216}
    topo, _ = make_topology(topics=topics)
    producer = RecordProducer(kafka_config)
    for i in range(8):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)

    def train(keep: int, steps: int) -> TrainerService:
        svc = TrainerService(topo, service_options(
            tiny_model, tmp_path / "state", max_steps=steps, anchor_interval=2,
            keep_versions=keep, state_interval=100), config=kafka_config)
        svc.run()
        return svc

    svc = train(keep=0, steps=3)
    assert svc.blob_uri.startswith("kafka://" if store == "kafka" else "file://")
    before = _oldest_blob(svc, kafka_config)
    assert before == 0  # keep_versions 0: everything stays
    svc = train(keep=2, steps=4)  # versions 4..7; full checkpoints at 4 and 6
    assert svc.version == 7
    # kept: from the newest full checkpoint at or below version 7 - 2 + 1 = 6, seen when
    # version 6 (a full one) was committed: 4
    assert _oldest_blob(svc, kafka_config) == (4 if store == "file" else
                                               _first_offset_of(svc, 4))
    manifests = [m for m in read_manifests(kafka_config, topo.full_name("weights.actor"))]
    follower = WeightFollower(policy="actor", kafka_config=kafka_config, inplace=False)
    follower.observe(manifests)
    assert follower.update().version == 7
    assert follower.state is not None


def _oldest_blob(svc, kafka_config) -> int:
    """The blob topic's low watermark, or the oldest version with a weight blob file."""
    from confluent_kafka import Consumer, TopicPartition

    if svc.blob_uri.startswith("kafka://"):
        c = Consumer(kafka_config.consumer_conf("x"))
        try:
            return c.get_watermark_offsets(TopicPartition(svc.blob_uri[8:], 0), timeout=10)[0]
        finally:
            c.close()
    names = [p.name for p in Path(svc.blob_uri[7:]).iterdir() if ".optim" not in p.name
             and ".master" not in p.name and not p.name.startswith(".")]
    return min(int(n.split(".v")[1][:8]) for n in names)


def _first_offset_of(svc, version: int) -> int:
    """The offset of the first chunk of ``version``'s first blob (from its uri)."""
    from astraflow.weights.stores.kafka import read_manifests

    ms = [m for m in read_manifests(svc.config, svc.weights_topic) if m.version == version]
    return min(int(ref.uri.split("offset=")[1]) for m in ms for ref in m.blobs)


@pytest.mark.kafka
def test_a_reader_without_the_model_builds_it_from_the_weight_stream(kafka_config,
                                                                     make_topology,
                                                                     tiny_model, tmp_path):  # noqa: F811
    """The trainer names the model's other files in every full checkpoint; a component
    whose model directory is missing builds it from Kafka alone: those files plus the
    weights of the newest version, bit for bit what the trainer published."""
    from safetensors.torch import load_file

    from astraflow.models.share import ensure_model, fetch_model, pack_model_files
    from astraflow.trainer.service import TrainerService

    topo, _ = make_topology(topics={"batches.actor": {"partitions": 1},
                                    "weights.actor": {"partitions": 1},
                                    "weights.blobs": {"partitions": 1}})
    (Path(tiny_model) / "tokenizer_config.json").write_text('{"model_max_length": 64}')
    producer = RecordProducer(kafka_config)
    for i in range(3):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    torch.set_num_threads(1)
    svc = TrainerService(topo, service_options(tiny_model, tmp_path / "state", max_steps=3,
                                               anchor_interval=2), config=kafka_config)
    svc.run()
    assert svc.version == 3

    dest = tmp_path / "elsewhere" / "model"
    assert ensure_model(dest, kafka_config, topo, "actor") == dest
    files = sorted(p.name for p in dest.iterdir())
    assert files == ["config.json", "generation_config.json", "model.safetensors",
                     "tokenizer_config.json"], files
    assert (dest / "config.json").read_bytes() == (Path(tiny_model) / "config.json").read_bytes()
    fetched = load_file(dest / "model.safetensors")
    published = svc.trainer.published_state()
    assert fetched.keys() == published.keys()
    assert all(torch.equal(fetched[k], published[k]) for k in published)
    assert b"model.safetensors" not in pack_model_files(tiny_model)
    assert ensure_model(dest, kafka_config, topo, "actor") == dest  # there now: kept

    empty, _ = make_topology(topics={"weights.actor": {"partitions": 1}})
    with pytest.raises(Exception, match="no model for policy actor .* after 1s"):
        fetch_model(kafka_config, empty.full_name("weights.actor"), "actor",
                    tmp_path / "never", wait_s=1)

