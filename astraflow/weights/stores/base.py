"""The blob store interface: a blob written once under an id, every read verified.

A blob is written once under a blob id (``[A-Za-z0-9][A-Za-z0-9._-]*``) and referenced from
manifests by a ``BlobRef`` (uri, size, sha256). Every read verifies size and sha256
before returning anything; a mismatch raises ``CorruptBlobError``, a missing blob
``MissingBlobError``. The implementations: ``filesystem`` (``file:///dir``) and ``kafka``
(``kafka://topic``); ``astraflow.weights.stores.open_store`` picks one from a uri.
"""


from __future__ import annotations

import hashlib
import re
import urllib.parse
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

from astraflow.weights.errors import CorruptBlobError
from astraflow.wire.records import BlobRef

if TYPE_CHECKING:
    pass

BlobData = bytes | bytearray | memoryview | Iterable[Any]
BLOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_READ = 1 << 20


def check_blob_id(blob_id: str) -> str:
    """Return ``blob_id`` if it is a valid blob id, else raise ``ValueError``."""
    if not BLOB_ID.match(blob_id):
        raise ValueError(f"invalid blob id {blob_id!r}: use [A-Za-z0-9._-], at most 200 chars")
    return blob_id


def blob_id_of(ref: BlobRef | str) -> str:
    """The blob id a ``BlobRef`` (or its uri) names: the last path segment of the uri."""
    uri = ref.uri if isinstance(ref, BlobRef) else ref
    path = urllib.parse.urlsplit(uri).path
    return urllib.parse.unquote(path.rstrip("/").rsplit("/", 1)[-1])


def pieces(data: BlobData) -> Iterable[Any]:
    """Bytes-like data, or an iterable of bytes-like pieces, as an iterable of pieces."""
    if isinstance(data, bytes | bytearray | memoryview):
        return (data,)
    return data


@dataclass
class StoredBlob:
    """One blob as a store lists it."""

    blob_id: str
    uri: str
    bytes: int
    created_at_ms: int
    sha256: str = ""


@runtime_checkable
class BlobStore(Protocol):
    """Where blobs live. Implementations: ``FileBlobStore``, ``KafkaBlobStore``."""

    uri: str

    def put(self, blob_id: str, data: BlobData) -> BlobRef:
        """Store ``data`` (bytes, or an iterable of bytes-like pieces) under ``blob_id``."""
        ...

    def get(self, ref: BlobRef) -> bytes:
        """The blob's bytes, after checking size and sha256 against ``ref``."""
        ...

    def open(self, ref: BlobRef) -> BinaryIO:
        """A verified, readable file object positioned at the blob's first byte."""
        ...

    def delete(self, ref: BlobRef | StoredBlob) -> bool:
        """Remove a blob; False when this store cannot remove single blobs or it is gone."""
        ...

    def list(self) -> list[StoredBlob]:
        """Every blob in the store."""
        ...

    def close(self) -> None: ...


def verify_stream(f: IO[bytes], ref: BlobRef) -> None:
    """Check size and sha256 of ``f`` against ``ref`` (raises ``CorruptBlobError``); rewinds."""
    h = hashlib.sha256()
    n = 0
    while True:
        chunk = f.read(_READ)
        if not chunk:
            break
        h.update(chunk)
        n += len(chunk)
    if n != ref.bytes:
        raise CorruptBlobError(f"{ref.uri}: {n} bytes, manifest says {ref.bytes}")
    if h.hexdigest() != ref.sha256:
        raise CorruptBlobError(
            f"{ref.uri}: sha256 {h.hexdigest()} does not match manifest {ref.sha256}"
        )
    f.seek(0)


def new_blob_id(policy: str, version: int, kind: str) -> str:
    """``<policy>.v<version>.<kind>.<random>``, sanitised to the blob-id alphabet."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", policy) or "policy"
    return check_blob_id(f"{safe[:120]}.v{version:08d}.{kind}.{uuid.uuid4().hex[:12]}")
