"""Signed weight manifests: signing, verifying, refusing, and keeping the held version."""

from __future__ import annotations

import copy
import os
import stat
import threading
from pathlib import Path

import pytest

from astraflow.config.topology import WeightSigningSpec
from astraflow.weights.errors import ManifestSignatureError
from astraflow.weights.signing import (
    ENV_PUBLIC_KEY,
    ENV_SIGNING_KEY,
    ManifestSigner,
    ManifestVerifier,
    SigningKeyError,
    canonical_bytes,
    keygen,
    load_private_key,
    load_public_key,
    refusal,
    refusal_letter,
    signer_from,
    split_trusted,
    verifier_for,
    verifier_from,
)
from astraflow.wire.codec import make_codec
from astraflow.wire.records import BlobRef, PartitionOffset, TensorInfo, WeightManifest
from tests.unit.trainer.test_trainer import tiny_model  # noqa: F401 - a fixture


@pytest.fixture(autouse=True)
def _no_env_keys(monkeypatch):
    monkeypatch.delenv(ENV_SIGNING_KEY, raising=False)
    monkeypatch.delenv(ENV_PUBLIC_KEY, raising=False)


@pytest.fixture
def keys(tmp_path):
    """(signer, verifier, private path, public path) of a fresh key pair."""
    private, public = keygen(tmp_path / "keys")
    return ManifestSigner.from_file(private), ManifestVerifier.from_files([public]), private, public


def manifest(version: int = 3, kind: str = "delta", **kw) -> WeightManifest:
    data = dict(policy="actor", version=version, base_version=version - 1, kind=kind,
                dtype="bf16", tensors=[TensorInfo("w", [2, 2], "bf16")],
                blobs=[BlobRef(f"file:///b/{version}", 10, "ab" * 32)], num_params=4,
                num_changed=1, sparsity=0.75, encoded_bytes=10, trainer_step=version,
                consumed_offsets=[PartitionOffset("r.batches.actor", 0, 7)],
                created_at_ms=1, codec="astraflow-delta-v1", meta={"lr": "1e-5"})
    data.update(kw)
    return WeightManifest(**data)


def test_a_signed_manifest_verifies_and_survives_the_wire(keys):
    signer, verifier, _, _ = keys
    m = signer.sign(manifest())
    assert m.signing_key == signer.key_id and len(m.signature) == 64
    verifier.verify(m)
    codec = make_codec()
    back = codec.decode(codec.encode(m, "r.weights.actor"))
    assert back.signature == m.signature and back.signing_key == m.signing_key
    verifier.verify(back)


@pytest.mark.parametrize("change", [
    lambda m: setattr(m, "version", 4),
    lambda m: setattr(m.blobs[0], "sha256", "cd" * 32),  # other weights
    lambda m: setattr(m.blobs[0], "uri", "file:///elsewhere"),
    lambda m: m.meta.update(extra="1"),
    lambda m: setattr(m, "sparsity", 0.7500001),
    lambda m: m.consumed_offsets.append(PartitionOffset("r.batches.actor", 1, 1)),
])
def test_any_change_after_signing_is_refused(keys, change):
    signer, verifier, _, _ = keys
    m = signer.sign(manifest())
    forged = copy.deepcopy(m)
    change(forged)
    with pytest.raises(ManifestSignatureError, match=r"bad signature for key [0-9a-f]{16}"):
        verifier.verify(forged)


def test_unsigned_and_foreign_manifests_are_refused_with_the_reason(keys, tmp_path):
    _, verifier, _, _ = keys
    with pytest.raises(ManifestSignatureError, match=r"actor v3 \(delta\) is unsigned"):
        verifier.verify(manifest())
    other, _ = keygen(tmp_path / "other")
    foreign = ManifestSigner.from_file(other).sign(manifest())
    with pytest.raises(ManifestSignatureError, match="which is not trusted"):
        verifier.verify(foreign)
    # another key's signature under our key id
    foreign.signing_key = next(iter(verifier.keys))
    with pytest.raises(ManifestSignatureError, match="bad signature"):
        verifier.verify(foreign)


def test_canonical_bytes_leave_out_the_signature_and_defaults():
    m = manifest()
    before = canonical_bytes(m)
    m.signature, m.signing_key = b"x" * 64, "0" * 16
    assert canonical_bytes(m) == before  # what is signed does not include the signature
    # a field at its default (None, "", [] or {}) is left out, as if the schema lacked it
    assert b'"meta"' not in canonical_bytes(manifest(meta={}))
    assert b'"codec"' not in canonical_bytes(manifest(codec=""))
    assert b'"base_version"' not in canonical_bytes(manifest(kind="full", base_version=None))
    assert before.startswith(b"astraflow.WeightManifest.v1\n")


def test_keygen_writes_a_private_key_only_its_owner_reads_and_never_overwrites(tmp_path):
    private, public = keygen(tmp_path)
    assert stat.S_IMODE(os.stat(private).st_mode) == 0o600
    load_private_key(private)
    load_public_key(public)
    with pytest.raises(SigningKeyError, match="exists: keys are never overwritten"):
        keygen(tmp_path)
    garbage = tmp_path / "bad.pem"
    garbage.write_text("not a key at all: hunter2")
    for load in (load_private_key, load_public_key):
        with pytest.raises(SigningKeyError) as e:
            load(garbage)
        assert str(garbage) in str(e.value) and "hunter2" not in str(e.value)
    with pytest.raises(SigningKeyError, match="cannot read"):
        load_public_key(tmp_path / "missing.pub")


def test_keys_come_from_the_topology_or_the_environment(keys, tmp_path, monkeypatch):
    signer, _, private, public = keys
    assert signer_from(WeightSigningSpec()) is None and verifier_from(WeightSigningSpec()) is None
    spec = WeightSigningSpec(private_key=str(private), public_key=str(public))
    assert signer_from(spec).key_id == signer.key_id
    assert list(verifier_from(spec).keys) == [signer.key_id]
    other_private, other_public = keygen(tmp_path / "env")
    monkeypatch.setenv(ENV_PUBLIC_KEY, str(other_public))  # the environment wins
    assert list(verifier_from(spec).keys) != [signer.key_id]
    with pytest.raises(SigningKeyError, match="does not belong to the public key"):
        signer_from(spec)
    monkeypatch.setenv(ENV_SIGNING_KEY, str(other_private))
    assert signer_from(spec).key_id == list(verifier_from(spec).keys)[0]
    assert "PRIVATE" not in repr(signer_from(spec))


def test_the_topology_takes_key_paths_never_keys():
    from astraflow.config.topology import TopologyError, parse_topology

    pem = "-----BEGIN PRIVATE KEY-----\nMC4CAQAwBQYDK2VwBCIEIP\n-----END PRIVATE KEY-----"
    with pytest.raises(TopologyError) as e:
        parse_topology({"run": "r", "weight_signing": {"private_key": pem}}, source="t.yaml")
    assert "t.yaml: weight_signing.private_key: the path of a PEM file" in str(e.value)
    assert "MC4CAQ" not in str(e.value)


# --- refusing in the follower: the held version stays in use ---------------------------
def _states():
    import torch

    g = torch.Generator().manual_seed(0)
    s0 = {"w": torch.randn(8, 8, generator=g).to(torch.bfloat16)}
    s1 = {"w": s0["w"] + torch.ones(8, 8, dtype=torch.bfloat16)}
    s2 = {"w": s1["w"] * 2}
    return [s0, s1, s2]


def test_the_follower_refuses_unsigned_and_forged_manifests(keys, tmp_path):
    from astraflow.weights import FileBlobStore, WeightFollower, WeightPublisher
    from astraflow.weights.bits import state_bytes_equal

    signer, verifier, _, _ = keys
    s0, s1, s2 = _states()
    store = FileBlobStore(tmp_path / "blobs")
    pub = WeightPublisher(store, "actor", anchor_interval=10, threads=1)
    good = [signer.sign(m) for s in (s0, s1) for m in pub.publish(s)]
    unsigned = pub.publish(s2)  # v2 by a writer without the key: valid blobs, no signature
    forged = copy.deepcopy(good[-1])
    forged.blobs = unsigned[0].blobs  # v1's identity, other weights, the old signature
    follower = WeightFollower(policy="actor", stores=[store], verifier=verifier, threads=1)
    follower.observe([*good, *unsigned, forged])
    assert follower.latest_version == 1  # v2 is not even seen
    result = follower.update_reachable()
    assert result.version == 1 and state_bytes_equal(follower.state, s1)
    refused = follower.take_refused()
    assert [(m.version, "unsigned" in why or "bad signature" in why) for m, why in refused] == [
        (2, True), (1, True)]
    assert follower.take_refused() == []  # each refusal is handed over once
    follower.observe([*unsigned, forged])  # seen again: refused, not reported twice
    assert follower.take_refused() == [] and follower.latest_version == 1
    # without a verifier every manifest is taken, as before
    trusting = WeightFollower(policy="actor", stores=[store], threads=1)
    trusting.observe([*good, *unsigned])
    assert trusting.latest_version == 2


def test_a_watcher_dead_letters_each_refusal_with_where_it_was_read(keys):
    from astraflow.kafka.table import Entry
    from astraflow.raas.weights_follow import WeightWatcher
    from astraflow.weights import WeightFollower

    _, verifier, _, _ = keys
    codec = make_codec()
    watcher = object.__new__(WeightWatcher)  # its Kafka table left out: fed by hand
    watcher.topic, watcher.codec, watcher._where = "r.weights.actor", codec, {}
    watcher.manifests_seen, watcher._failed_target = 0, None
    watcher._lock = threading.RLock()  # the follower's, shared with a prefetch thread
    watcher.follower = WeightFollower(policy="actor", verifier=verifier)
    unsigned = manifest(version=5)
    assert watcher._key(Entry("r.weights.actor", 2, 41, b"actor", unsigned, 0)) is not None
    watcher._observe(None, None, unsigned)
    letters = watcher.dead_letters("raas.local/n0")
    assert len(letters) == 1
    d = letters[0]
    assert (d.source_topic, d.partition, d.offset, d.component_id) == (
        "r.weights.actor", 2, 41, "raas.local/n0")
    assert d.error.startswith("refused: manifest actor v5 (delta) is unsigned")
    assert codec.decode(d.raw).version == 5
    assert watcher.dead_letters("raas.local/n0") == []
    assert watcher.follower.latest_version is None


def test_keygen_command(tmp_path, capsys):
    from astraflow.cli.main import main

    assert main(["weights", "keygen", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "weights-signing.key" in out and "key id" in out
    assert main(["weights", "keygen", "--out", str(tmp_path)]) == 2
    assert Path(tmp_path / "weights-signing.pub").is_file()


# --- the helpers the trainer's resume and replay use ---------------------------------------
def test_manifests_are_split_into_trusted_and_refused_with_the_reason(keys, tmp_path,
                                                                       monkeypatch):
    signer, verifier, _, public = keys
    other, other_public = keygen(tmp_path / "other")
    good = signer.sign(manifest(version=1))
    foreign = ManifestSigner.from_file(other).sign(manifest(version=2))
    unsigned = manifest(version=3)
    kept, refused = split_trusted([good, foreign, unsigned], verifier)
    assert kept == [good]
    assert [(m.version, why.split(",")[0].split(";")[0]) for m, why in refused] == [
        (2, f"manifest actor v2 (delta) is signed by key {foreign.signing_key}"),
        (3, "manifest actor v3 (delta) is unsigned")]
    assert refusal(verifier, good) is None and refusal(None, unsigned) is None
    assert split_trusted([good, unsigned], None) == ([good, unsigned], [])
    codec = make_codec()
    letter = refusal_letter(foreign, refused[0][1], "r.weights.actor", "trainer.actor/0",
                            codec, (0, 12))
    assert (letter.source_topic, letter.partition, letter.offset) == ("r.weights.actor", 0, 12)
    assert letter.error == f"refused: {refused[0][1]}"
    assert codec.decode(letter.raw).version == 2
    # a command's --public-key comes before the environment and the topology
    monkeypatch.setenv(ENV_PUBLIC_KEY, str(public))
    spec = WeightSigningSpec(public_key=str(public))
    assert verifier_for(spec).keys.keys() == verifier.keys.keys()
    chosen = verifier_for(spec, other_public)
    assert refusal(chosen, foreign) is None and refusal(chosen, good) is not None
    monkeypatch.delenv(ENV_PUBLIC_KEY)
    assert verifier_for(WeightSigningSpec()) is None
