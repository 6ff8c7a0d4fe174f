"""Blob stores: where weight blobs live, behind one small interface (``base``).

* ``FileBlobStore`` (``file:///dir``, ``filesystem``): one file per blob.
* ``KafkaBlobStore`` (``kafka://topic``, ``kafka``): chunks on a topic.

``open_store(uri)`` picks the right one; ``StoreResolver`` opens (once) the store each
``BlobRef`` points into.
"""


from __future__ import annotations

import urllib.parse
from collections.abc import Iterable
from typing import TYPE_CHECKING, BinaryIO

from astraflow.weights.errors import MissingBlobError, WeightsError
from astraflow.wire.records import BlobRef

if TYPE_CHECKING:
    from astraflow.kafka.config import KafkaConfig

from astraflow.weights.stores.base import BlobStore, StoredBlob, new_blob_id
from astraflow.weights.stores.filesystem import FileBlobStore


def open_store(uri: str, kafka_config: KafkaConfig | None = None) -> BlobStore:
    """Open a blob store: ``file:///dir`` (or a plain path) or ``kafka://topic``.

    Kafka stores use ``kafka_config``, else ``KafkaConfig.from_env()``.
    """
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme in ("", "file"):
        path = urllib.parse.unquote(parts.path) if parts.scheme else uri
        if parts.scheme and parts.netloc not in ("", "localhost"):
            raise ValueError(f"{uri}: only local file:// uris are supported")
        return FileBlobStore(path)
    if parts.scheme == "kafka":
        from astraflow.weights.stores.kafka import KafkaBlobStore

        topic = parts.netloc or parts.path.strip("/")
        if not topic:
            raise ValueError(f"{uri}: no topic (expected kafka://<topic>)")
        if kafka_config is None:
            from astraflow.kafka.config import KafkaConfig

            kafka_config = KafkaConfig.from_env()
        return KafkaBlobStore(kafka_config, topic)
    raise ValueError(f"unsupported blob store uri {uri!r} (file:///dir or kafka://topic)")


def store_uri_of(ref: BlobRef | str) -> str:
    """The uri of the store a ``BlobRef`` points into (its uri minus the blob id)."""
    uri = ref.uri if isinstance(ref, BlobRef) else ref
    parts = urllib.parse.urlsplit(uri)
    if parts.scheme == "kafka":
        return f"kafka://{parts.netloc}"
    path = parts.path.rstrip("/").rsplit("/", 1)[0]
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, "", ""))


class StoreResolver:
    """Opens (once) and caches the store each ``BlobRef`` points into.

    ``stores`` pre-seeds the cache, e.g. with a store object the caller already has.
    """

    def __init__(
        self, stores: Iterable[BlobStore] = (), kafka_config: KafkaConfig | None = None
    ) -> None:
        self.kafka_config = kafka_config
        self._stores: dict[str, BlobStore] = {s.uri: s for s in stores}

    def store_for(self, ref: BlobRef) -> BlobStore:
        key = store_uri_of(ref)
        store = self._stores.get(key)
        if store is None:
            try:
                store = open_store(key, self.kafka_config)
            except (ValueError, OSError, WeightsError) as e:
                raise MissingBlobError(f"{ref.uri}: cannot open its store: {e}") from e
            self._stores[key] = store
        return store

    def open(self, ref: BlobRef) -> BinaryIO:
        return self.store_for(ref).open(ref)

    def close(self) -> None:
        for s in self._stores.values():
            s.close()


__all__ = [
    "BlobStore", "FileBlobStore", "StoreResolver", "StoredBlob", "new_blob_id", "open_store",
    "store_uri_of",
]
