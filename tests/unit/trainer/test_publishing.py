"""The trainer's publishing apart from its Kafka work (``astraflow.trainer.publishing``):
versions into a blob store, signed manifests, the model's files in a full checkpoint's
meta, and the pruning of blobs no reader needs. No broker: the service's transactions are
tested with one in tests/unit/trainer/test_trainer.py."""

from __future__ import annotations

import torch

from tests.unit.trainer.test_trainer import make_batch, tiny_model  # noqa: F401 (fixture)


def test_publishing_writes_versions_signs_and_prunes_what_no_reader_needs(tiny_model,  # noqa: F811
                                                                         tmp_path):
    from astraflow.config.sections import TrainerSpec
    from astraflow.trainer.publishing import Publishing
    from astraflow.trainer.trainer import Trainer
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores import FileBlobStore

    torch.set_num_threads(1)
    tr = Trainer(tiny_model, TrainerSpec(lr=1e-3, micro_batch_size=3), policy="actor")
    store = FileBlobStore(tmp_path / "blobs")
    signed = []

    class Signer:
        def sign(self, m):
            signed.append(m.version)

    pub = Publishing(tr, store, "actor", anchor_interval=2, keep_versions=1,
                     model_path=tiny_model, signer=Signer())
    pub.restart()  # no base: version 0 is a full checkpoint
    every = []
    for v in range(5):
        if v:
            tr.train_step(make_batch(v))
        ms = pub.publish(v, meta={"batch_id": f"b{v}"})
        pub.add_model_files(ms)
        assert pub.signed(ms) is ms
        every.append(ms)
        pub.committed(ms, states=[])
    pub.close()
    kinds = [[m.kind for m in ms] for ms in every]
    # a delta each version, with a full checkpoint beside it every anchor_interval
    assert kinds[0] == ["full"] and kinds[1] == ["delta"] and "full" in kinds[2]
    assert signed == [m.version for ms in every for m in ms]
    assert all(("model_files_uri" in m.meta) == (m.kind == "full") for ms in every
               for m in ms)
    assert [m.trainer_step for ms in every for m in ms if m.kind == "delta"] == [1, 2, 3, 4]
    # keep_versions 1: the history starts at the newest full checkpoint (version 4's), the
    # blobs before it are gone from the store, and a reader still rebuilds version 4
    assert min(m.version for m in pub.history) == 4
    kept = {ref.uri for m in pub.history for ref in m.blobs}
    gone = {ref.uri for ms in every[:4] for m in ms for ref in m.blobs} - kept
    assert gone and not {b.uri for b in store.list()} & gone
    follower = WeightFollower(policy="actor", stores=[store], inplace=False)
    follower.observe(pub.history)
    follower.update(4)
    assert all(torch.equal(follower.state[k], v) for k, v in tr.published_state().items())


def test_a_restore_resumes_only_from_trusted_manifests(tmp_path):
    """With a public key configured, a resume uses only the manifests its key signed; when
    none is left there is nothing to resume from (and version 0 must not be published
    over them)."""
    import pytest

    from astraflow.trainer.restore import Restorer
    from astraflow.weights.signing import ManifestSignatureError
    from astraflow.wire.records import WeightManifest

    def manifest(version: int) -> WeightManifest:
        return WeightManifest(policy="actor", version=version, base_version=None, kind="full",
                              dtype="bfloat16", tensors=[], blobs=[], num_params=0,
                              num_changed=0, sparsity=1.0, encoded_bytes=0, trainer_step=0,
                              meta={})

    class Verifier:
        def verify(self, m):
            if m.version != 1:
                raise ManifestSignatureError("not signed")

    r = Restorer(None, None, None, None, policy="actor", weights_topic="r.weights.actor",
                 batches_topic="r.batches.actor", state_dir=tmp_path, verifier=Verifier())
    assert [m.version for m in r.trusted([manifest(0), manifest(1)])] == [1]
    assert [(m.version, why) for m, why in r.refused] == [(0, "not signed")]
    with pytest.raises(RuntimeError, match="every manifest of actor is refused"):
        r.trusted([manifest(0)])
