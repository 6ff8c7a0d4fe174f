"""Replay from retained topics on a real broker: ``replay train`` reproducing a run's weights bit
for bit (and ``replay export``), and manifests another key signed refused (the range logic
without a broker: tests/unit/replay/test_ranges.py)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from astraflow.cli.main import main
from astraflow.kafka.clients import RecordProducer
from astraflow.replay.ranges import digest_at
from astraflow.weights.stores.kafka import read_manifests
from tests.conftest import REPO, wait_for
from tests.unit.trainer.test_trainer import make_batch, tiny_model  # noqa: F401 - tiny_model is a fixture


def _train_source(kafka_config, kafka_bootstrap, path, topo, tiny_model, tmp_path, n):  # noqa: F811
    """The run to replay: ``n`` batches trained by ``astraflow trainer run`` into versions
    1..n (as `up` runs it: the topology's trainer flags, one intra-op thread)."""
    from astraflow.launch.plan import trainer_args

    producer = RecordProducer(kafka_config)
    for i in range(n):
        producer.produce(topo.full_name("batches.actor"), make_batch(i), key="actor")
    producer.flush()
    cmd = [sys.executable, "-m", "astraflow.cli.main", *trainer_args(topo, str(path), "actor"),
           "--state-dir", str(tmp_path / "source-state")]
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": kafka_bootstrap, "OMP_NUM_THREADS": "1"}
    weights = topo.full_name("weights.actor")
    with open(tmp_path / "source.log", "ab") as log:
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        wait_for(lambda: max((m.version for m in read_manifests(kafka_config, weights)),
                             default=-1) >= n, 180, f"the source run at version {n}", step=1.0)
        p.send_signal(signal.SIGTERM)
        assert p.wait(60) == 0
    finally:
        if p.poll() is None:
            p.kill()


def test_replay_train_reproduces_the_weights_bit_for_bit(
        kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, capsys):  # noqa: F811
    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1},
                "weights.blobs": {"partitions": 1}},
        policies={"actor": {"model": tiny_model,
                            "trainer": {"lr": 1e-4, "anchor_interval": 2}}})
    _train_source(kafka_config, kafka_bootstrap, path, topo, tiny_model, tmp_path, n=4)
    common = ["-t", str(path), "--bootstrap", kafka_bootstrap, "--runs-dir", str(tmp_path)]

    assert main(["replay", "train", *common, "--into", f"{topo.run}-all"]) == 0
    out = capsys.readouterr().out
    assert "version 4: sha256" in out, out
    assert out.count("the same weights, bit for bit") == 2, out  # versions 0 and 4
    want = digest_at(kafka_config, topo.full_name("weights.actor"), "actor", 4)
    assert digest_at(kafka_config, f"{topo.run}-all.weights.actor", "actor", 4) == want

    # the batches of versions 1..2 only, and a changed learning rate: other weights at v2
    assert main(["replay", "train", *common, "--to-version", "2", "--into",
                 f"{topo.run}-lr", "--", "--lr", "3e-4"]) == 0
    out = capsys.readouterr().out
    assert "version 2: sha256" in out and "the weights differ" in out, out
    versions = {m.version for m in read_manifests(kafka_config, f"{topo.run}-lr.weights.actor")}
    assert versions == {0, 1, 2}

    # never into the run replayed, nor into a run whose batches are not a replay's copy
    assert main(["replay", "train", *common, "--into", topo.run]) == 2
    assert "that is the run replayed" in capsys.readouterr().err
    other, _ = make_topology(topics={"batches.actor": {"partitions": 1}})
    producer = RecordProducer(kafka_config)
    producer.produce(other.full_name("batches.actor"), make_batch(9), key="actor")
    producer.flush()
    assert main(["replay", "train", *common, "--into", other.run]) == 2
    assert "not a replay's copy" in capsys.readouterr().err

    # export: the recorded batches as JSON lines
    out_file = tmp_path / "batches.jsonl"
    assert main(["replay", "export", *common[:4], "batches.actor", "--offsets", "1:3",
                 "--out", str(out_file)]) == 0
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["batch_id"] for r in rows] == ["batch-1", "batch-2"]
    assert [r["_offset"] for r in rows] == [1, 2]


def _forge(kafka_config, weights: str, forger) -> tuple:
    """Produce to ``weights`` a copy of version 2 with version 1's blobs and a version 3,
    both signed by ``forger``; both."""
    import copy

    published = read_manifests(kafka_config, weights)
    v1, v2 = (next(m for m in published if m.version == v) for v in (1, 2))
    forged = copy.deepcopy(v2)
    forged.blobs = v1.blobs  # version 2's identity, other weights
    later = copy.deepcopy(v2)
    later.version, later.base_version = 3, 2
    producer = RecordProducer(kafka_config)
    for m in (forger.sign(forged), forger.sign(later)):
        producer.produce(weights, m, key="actor")
    producer.flush()
    return forged, later


@pytest.mark.slow
def test_replay_refuses_manifests_another_key_signed_and_uses_the_good_ones(
        kafka_config, kafka_bootstrap, make_topology, tiny_model, tmp_path, capsys,  # noqa: F811
        monkeypatch):
    """A signed run whose weights topic also holds a forged copy of version 2 and a
    version 3, both signed by another key: `replay train` says why each is refused,
    dead-letters both to the new run's dlq and trains and compares with the signed ones
    only; `replay process` leaves them out of the version history; a --public-key that
    signed none of the run refuses the replay."""
    from astraflow.replay.process import version_history
    from astraflow.weights.signing import (
        ENV_PUBLIC_KEY,
        ENV_SIGNING_KEY,
        ManifestSigner,
        ManifestVerifier,
        keygen,
    )
    from tests.integration.weights.test_signing import dead_letters

    monkeypatch.delenv(ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_PUBLIC_KEY, raising=False)
    private, public = keygen(tmp_path / "keys")
    other, _ = keygen(tmp_path / "other")
    topo, path = make_topology(
        topics={"batches.actor": {"partitions": 1}, "weights.actor": {"partitions": 1},
                "weights.blobs": {"partitions": 1}, "dlq": {"partitions": 1}},
        policies={"actor": {"model": tiny_model,
                            "trainer": {"lr": 1e-4, "anchor_interval": 2}}},
        weight_signing={"private_key": str(private), "public_key": str(public)})
    _train_source(kafka_config, kafka_bootstrap, path, topo, tiny_model, tmp_path, n=2)
    weights = topo.full_name("weights.actor")
    forger = ManifestSigner.from_file(other)
    forged, later = _forge(kafka_config, weights, forger)
    common = ["-t", str(path), "--bootstrap", kafka_bootstrap, "--runs-dir", str(tmp_path)]

    into = f"{topo.run}-signed"
    assert main(["replay", "train", *common, "--into", into]) == 0
    out, err = capsys.readouterr()
    untrusted = f"is signed by key {forger.key_id}, which is not trusted"
    assert f"replay: refused: manifest actor v2 ({forged.kind}) {untrusted}" in err, err
    assert f"v3 ({later.kind}) {untrusted}" in err, err
    assert "version 2: sha256" in out and "version 3" not in out, out
    assert out.count("the same weights, bit for bit") == 2, out  # versions 0 and 2
    letters = dead_letters(kafka_config, f"{into}.dlq")
    assert sorted(d.error.split(" (")[0] for d in letters) == [
        "refused: manifest actor v2", "refused: manifest actor v3"]
    assert {d.source_topic for d in letters} == {weights}

    verifier = ManifestVerifier.from_files([public])
    history = version_history(kafka_config, topo, ["actor"], verifier)
    assert {v for _, v in history["actor"]} == {0, 1, 2}
    assert "refused: manifest actor v3" in capsys.readouterr().err

    _, third = keygen(tmp_path / "third")
    assert main(["replay", "train", *common, "--into", f"{topo.run}-foreign",
                 "--public-key", str(third)]) == 2
    err = capsys.readouterr().err
    assert f"every manifest on {weights} is refused" in err and "--public-key" in err, err
