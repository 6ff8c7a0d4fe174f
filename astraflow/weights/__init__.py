"""Bit-exact sparse weight deltas, versioned manifests, and blob stores.

Codec (``delta``): ``encode_delta(old, new) -> (blob, stats)``, ``apply_delta(state, blob)``,
``encode_full(state)``, ``decode_full(blob)``, ``apply_blob``, ``inspect_blob``; parts of
tensors (rows of dim 0: ``Rows``, ``apply_parts``, ``empty_state``); deltas found on the
tensors' device (``extract_delta``, ``iter_encode_extracted``).
Digest (``digest``): ``state_digest``, which lets a follower take the weights its engine
loaded from disk as version 0 (``WeightFollower.adopt``).
History (``history``): ``plan_update``, ``WeightPublisher`` (``prepare`` ->
``PreparedVersion.write``), ``WeightFollower``, ``merge_parts``, ``retained_manifests``,
``collect_garbage``.
Stores (``stores``: ``base``, ``filesystem``, ``kafka``): ``BlobStore``, ``FileBlobStore``,
``KafkaBlobStore``, ``open_store``.
"""

import importlib
from typing import Any

# Lazy exports: the codec imports torch, which takes seconds; `import astraflow.weights`
# (e.g. by the CLI) stays cheap until a name is used.
_EXPORTS = {
    "CODEC_NAME": "delta",
    "BaseMismatchError": "errors",
    "BlobError": "errors",
    "BlobInfo": "delta",
    "BlobStore": "stores.base",
    "CorruptBlobError": "errors",
    "EncodeStats": "delta",
    "ExtractedDelta": "delta",
    "FileBlobStore": "stores.filesystem",
    "GcResult": "history",
    "KafkaBlobStore": "stores.kafka",
    "MissingBlobError": "errors",
    "NoPlanError": "errors",
    "PreparedVersion": "history",
    "Rows": "delta",
    "StoredBlob": "stores.base",
    "UnsupportedFormatError": "errors",
    "UpdateResult": "history",
    "WeightFollower": "history",
    "WeightPublisher": "history",
    "WeightsError": "errors",
    "apply_blob": "delta",
    "apply_delta": "delta",
    "apply_parts": "delta",
    "collect_garbage": "history",
    "create_blob_topic": "stores.kafka",
    "decode_full": "delta",
    "empty_state": "delta",
    "encode_delta": "delta",
    "encode_full": "delta",
    "extract_delta": "delta",
    "inspect_blob": "delta",
    "iter_encode_delta": "delta",
    "iter_encode_extracted": "delta",
    "iter_encode_full": "delta",
    "load_manifests": "history",
    "merge_parts": "history",
    "open_store": "stores",
    "plan_bytes": "history",
    "plan_update": "history",
    "read_manifests": "stores.kafka",
    "retained_manifests": "history",
    "save_manifest": "history",
    "state_bytes_equal": "delta",
    "state_digest": "digest",
}


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'astraflow.weights' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"astraflow.weights.{module}"), name)
    globals()[name] = value
    return value


__all__ = [
    "CODEC_NAME",
    "BaseMismatchError",
    "BlobError",
    "BlobInfo",
    "BlobStore",
    "CorruptBlobError",
    "EncodeStats",
    "ExtractedDelta",
    "FileBlobStore",
    "GcResult",
    "KafkaBlobStore",
    "MissingBlobError",
    "NoPlanError",
    "PreparedVersion",
    "Rows",
    "StoredBlob",
    "UnsupportedFormatError",
    "UpdateResult",
    "WeightFollower",
    "WeightPublisher",
    "WeightsError",
    "apply_blob",
    "apply_delta",
    "apply_parts",
    "collect_garbage",
    "create_blob_topic",
    "decode_full",
    "empty_state",
    "encode_delta",
    "encode_full",
    "extract_delta",
    "inspect_blob",
    "iter_encode_delta",
    "iter_encode_extracted",
    "iter_encode_full",
    "load_manifests",
    "merge_parts",
    "open_store",
    "plan_bytes",
    "plan_update",
    "read_manifests",
    "retained_manifests",
    "save_manifest",
    "state_bytes_equal",
    "state_digest",
]
