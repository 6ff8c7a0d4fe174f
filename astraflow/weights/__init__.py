"""Bit-exact sparse weight deltas, versioned manifests, and blob stores.

Codec (``delta``): ``encode_delta(old, new) -> (blob, stats)``, ``apply_delta(state, blob)``,
``encode_full(state)``, ``decode_full(blob)``, ``apply_blob``, ``inspect_blob``.
History (``history``): ``plan_update``, ``WeightPublisher``, ``WeightFollower``,
``retained_manifests``, ``collect_garbage``.
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
    "FileBlobStore": "stores.filesystem",
    "GcResult": "history",
    "KafkaBlobStore": "stores.kafka",
    "MissingBlobError": "errors",
    "NoPlanError": "errors",
    "StoredBlob": "stores.base",
    "UnsupportedFormatError": "errors",
    "UpdateResult": "history",
    "WeightFollower": "history",
    "WeightPublisher": "history",
    "WeightsError": "errors",
    "apply_blob": "delta",
    "apply_delta": "delta",
    "collect_garbage": "history",
    "create_blob_topic": "stores.kafka",
    "decode_full": "delta",
    "encode_delta": "delta",
    "encode_full": "delta",
    "inspect_blob": "delta",
    "iter_encode_delta": "delta",
    "iter_encode_full": "delta",
    "load_manifests": "history",
    "open_store": "stores",
    "plan_bytes": "history",
    "plan_update": "history",
    "read_manifests": "stores.kafka",
    "retained_manifests": "history",
    "save_manifest": "history",
    "state_bytes_equal": "delta",
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
    "FileBlobStore",
    "GcResult",
    "KafkaBlobStore",
    "MissingBlobError",
    "NoPlanError",
    "StoredBlob",
    "UnsupportedFormatError",
    "UpdateResult",
    "WeightFollower",
    "WeightPublisher",
    "WeightsError",
    "apply_blob",
    "apply_delta",
    "collect_garbage",
    "create_blob_topic",
    "decode_full",
    "encode_delta",
    "encode_full",
    "inspect_blob",
    "iter_encode_delta",
    "iter_encode_full",
    "load_manifests",
    "open_store",
    "plan_bytes",
    "plan_update",
    "read_manifests",
    "retained_manifests",
    "save_manifest",
    "state_bytes_equal",
]
