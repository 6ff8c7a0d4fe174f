"""Bit-exact sparse weight deltas, versioned manifests, and blob stores.

The blob codec: the container format (``blob``: ``read_header``, ``inspect_blob``,
``Rows`` for parts of tensors, ``CODEC_NAME``); tensors as bit patterns (``bits``:
``state_bytes_equal``); its integer streams (``packing``) and segment checksums
(``checksums``); encoding on the CPU (``encode``: ``encode_delta``, ``encode_full``,
``iter_encode_delta``, ``iter_encode_full``) or finding the delta on the tensors' device
(``extract``: ``extract_delta``, ``iter_encode_extracted``); applying blobs (``apply``:
``apply_delta``, ``decode_full``, ``apply_blob``, ``apply_parts``, ``empty_state``), whose
parts must cover a state exactly (``coverage``).
Digest (``digest``): ``state_digest``, which lets a follower take the weights its engine
loaded from disk as version 0 (``WeightFollower.adopt``).
Versions: manifests' identity and JSON files (``manifests``), update plans (``planning``:
``plan_update``), publishing (``publisher``: ``WeightPublisher``, ``prepare`` ->
``PreparedVersion.write``), one manifest from a group's parts (``merge``:
``merge_parts``), following (``follower``: ``WeightFollower``), retention and GC
(``retention``: ``retained_manifests``, ``collect_garbage``).
Stores (``stores``: ``base``, ``filesystem``, ``kafka``): ``BlobStore``, ``FileBlobStore``,
``KafkaBlobStore``, ``open_store``.
"""

import importlib
from typing import Any

# Lazy exports: the codec imports torch, which takes seconds; `import astraflow.weights`
# (e.g. by the CLI) stays cheap until a name is used.
_EXPORTS = {
    "CODEC_NAME": "blob",
    "BaseMismatchError": "errors",
    "BlobError": "errors",
    "BlobInfo": "blob",
    "BlobStore": "stores.base",
    "CorruptBlobError": "errors",
    "EncodeStats": "encode",
    "ExtractedDelta": "extract",
    "FileBlobStore": "stores.filesystem",
    "GcResult": "retention",
    "KafkaBlobStore": "stores.kafka",
    "MissingBlobError": "errors",
    "NoPlanError": "errors",
    "PreparedVersion": "publisher",
    "Rows": "blob",
    "StoredBlob": "stores.base",
    "UnsupportedFormatError": "errors",
    "UpdateResult": "follower",
    "WeightFollower": "follower",
    "WeightPublisher": "publisher",
    "WeightsError": "errors",
    "apply_blob": "apply",
    "apply_delta": "apply",
    "apply_parts": "apply",
    "collect_garbage": "retention",
    "create_blob_topic": "stores.kafka",
    "decode_full": "apply",
    "empty_state": "apply",
    "encode_delta": "encode",
    "encode_full": "encode",
    "extract_delta": "extract",
    "inspect_blob": "blob",
    "iter_encode_delta": "encode",
    "iter_encode_extracted": "extract",
    "iter_encode_full": "encode",
    "load_manifests": "manifests",
    "merge_parts": "merge",
    "open_store": "stores",
    "plan_bytes": "planning",
    "plan_update": "planning",
    "read_manifests": "stores.kafka",
    "retained_manifests": "retention",
    "save_manifest": "manifests",
    "state_bytes_equal": "bits",
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
