"""Kafka blob store and manifest reading on the real broker."""

from __future__ import annotations

import hashlib
import os

import pytest
import torch
from confluent_kafka import Producer

from astraflow.weights import (
    CorruptBlobError,
    KafkaBlobStore,
    MissingBlobError,
    WeightFollower,
    WeightPublisher,
    collect_garbage,
    open_store,
    read_manifests,
    retained_manifests,
)
from astraflow.wire.codec import make_codec
from astraflow.wire.records import BlobRef

pytestmark = pytest.mark.kafka

BIG = {"max.message.bytes": str(8 << 20)}


def raw(t: torch.Tensor) -> bytes:
    t = t.contiguous().reshape(-1)
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()]).numpy().tobytes()


def test_kafka_blob_store_round_trip(kafka_config, new_topic):
    topic = new_topic(1, **BIG)
    store = KafkaBlobStore(kafka_config, topic, chunk_bytes=64 << 10)
    try:
        small = b"tiny blob"
        multi = os.urandom(300_000)  # 5 chunks of 64 KiB
        empty = b""
        r_small = store.put("small", small)
        r_multi = store.put("multi", [multi[:1000], memoryview(multi)[1000:]])
        r_empty = store.put("empty", empty)
        assert r_multi.bytes == len(multi)
        assert r_multi.sha256 == hashlib.sha256(multi).hexdigest()
        assert r_multi.uri.startswith(f"kafka://{topic}/multi?partition=0&offset=")
        assert store.get(r_small) == small
        assert store.get(r_multi) == multi
        assert store.get(r_empty) == empty
        # a fresh store (another process) reads by the uri's hint, and without it by scanning
        other = open_store(f"kafka://{topic}", kafka_config)
        try:
            assert other.get(r_multi) == multi
            bare = BlobRef(uri=f"kafka://{topic}/multi", bytes=r_multi.bytes, sha256=r_multi.sha256)
            assert other.get(bare) == multi
            wrong_hint = BlobRef(
                uri=f"kafka://{topic}/multi?partition=0&offset=0",
                bytes=len(multi),
                sha256=r_multi.sha256,
            )
            assert other.get(wrong_hint) == multi
            assert {b.blob_id for b in other.list()} == {"small", "multi", "empty"}
            # a wrong sha256 or size is refused; an unknown blob is missing
            with pytest.raises(CorruptBlobError):
                other.get(BlobRef(uri=r_multi.uri, bytes=r_multi.bytes, sha256="0" * 64))
            with pytest.raises(CorruptBlobError):
                other.get(BlobRef(uri=r_small.uri, bytes=3, sha256=r_small.sha256))
            with pytest.raises(MissingBlobError):
                other.get(BlobRef(uri=f"kafka://{topic}/nope", bytes=1, sha256="0" * 64))
            assert other.delete(r_small) is False
        finally:
            other.close()
    finally:
        store.close()


def test_kafka_default_chunks_and_publisher_follower(kafka_config, new_topic):
    blobs = new_topic(1, **BIG)
    manifests_topic = new_topic(1)
    store = KafkaBlobStore(kafka_config, blobs)  # 4 MiB chunks
    g = torch.Generator().manual_seed(0)
    versions = [{"w": (torch.randn(4096, 1536, generator=g) * 0.02).to(torch.bfloat16)}]
    for _ in range(4):
        w = versions[-1]["w"].clone()
        idx = torch.randint(0, w.numel(), (20_000,), generator=g)
        w.view(-1)[idx] = (w.view(-1)[idx].float() * 1.01).to(torch.bfloat16)
        versions.append({"w": w})
    pub = WeightPublisher(store, "policy-a", anchor_interval=3)
    manifests = [m for v in versions for m in pub.publish(v)]
    full0 = manifests[0]
    assert full0.kind == "full" and full0.encoded_bytes > 4 * 2**20  # spans several chunks
    # the trainer would publish the manifests; do that, then read them back
    codec = make_codec(kafka_config.schema_registry_url)
    prod = Producer(kafka_config.producer_conf())
    for m in manifests:
        prod.produce(manifests_topic, key=m.policy.encode(), value=codec.encode(m, manifests_topic))
    assert prod.flush(30) == 0
    seen = read_manifests(kafka_config, manifests_topic)
    assert [(m.version, m.kind) for m in seen] == [(m.version, m.kind) for m in manifests]
    assert seen[1].blobs == manifests[1].blobs

    follower = WeightFollower(kafka_config=kafka_config)  # opens the store from the uris
    follower.observe(seen)
    res = follower.update()
    assert follower.version == 4 and not res.failures
    assert [(m.kind, m.version) for m in res.applied] == [("full", 3), ("delta", 4)]
    assert raw(follower.state["w"]) == raw(versions[4]["w"])
    follower.close()

    # GC on a Kafka store reports, and can truncate below the oldest blob still needed
    kept = retained_manifests(seen, keep_last=1)
    res = collect_garbage(store, kept, min_age_s=0, dry_run=True)
    assert not res.can_delete
    assert len(res.unreachable) == len(seen) - len(kept)
    res = collect_garbage(store, kept, min_age_s=0, kafka_truncate=True)
    assert res.truncated and res.truncated[0] > 0
    after = WeightFollower(stores=[KafkaBlobStore(kafka_config, blobs)])
    after.observe(kept)
    after.update()
    assert raw(after.state["w"]) == raw(versions[4]["w"])
    after.close()
    store.close()
