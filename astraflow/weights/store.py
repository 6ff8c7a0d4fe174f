"""Blob stores: where weight blobs live, behind one small interface.

A blob is written once under a blob id (``[A-Za-z0-9][A-Za-z0-9._-]*``) and referenced from
manifests by a ``BlobRef`` (uri, size, sha256). Every read verifies size and sha256
before returning anything; a mismatch raises ``CorruptBlobError``, a missing blob
``MissingBlobError``.

* ``FileBlobStore`` (``file:///dir``): one file per blob; writes go to a temporary file
  that is fsynced and atomically renamed, so a reader never sees half a blob.
* ``KafkaBlobStore`` (``kafka://topic``, in ``kafka_store``): chunks on a topic.

``open_store(uri)`` picks the right one; ``store_for_ref(ref)`` opens the store a ``BlobRef``
points into.
"""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
import time
import urllib.parse
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, BinaryIO, Protocol, runtime_checkable

from astraflow.records import BlobRef
from astraflow.weights.errors import CorruptBlobError, MissingBlobError, WeightsError

if TYPE_CHECKING:
    from astraflow.kafka.config import KafkaConfig

BlobData = bytes | bytearray | memoryview | Iterable[Any]
_BLOB_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
_READ = 1 << 20


def check_blob_id(blob_id: str) -> str:
    """Return ``blob_id`` if it is a valid blob id, else raise ``ValueError``."""
    if not _BLOB_ID.match(blob_id):
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


class FileBlobStore:
    """Blobs as files in one directory (``file:///dir``); atomic writes, verified reads."""

    def __init__(self, root: str | os.PathLike[str], create: bool = True):
        self.root = Path(root).expanduser().absolute()
        if create:
            self.root.mkdir(parents=True, exist_ok=True)
        elif not self.root.is_dir():
            raise MissingBlobError(f"blob directory {self.root} does not exist")
        self.uri = self.root.as_uri()

    def _path(self, blob_id: str) -> Path:
        return self.root / check_blob_id(blob_id)

    def ref_uri(self, blob_id: str) -> str:
        return f"{self.uri}/{blob_id}"

    def put(self, blob_id: str, data: BlobData) -> BlobRef:
        path = self._path(blob_id)
        h = hashlib.sha256()
        n = 0
        fd, tmp = tempfile.mkstemp(prefix=f".tmp-{blob_id}-", dir=self.root)
        try:
            with os.fdopen(fd, "wb") as f:
                for piece in pieces(data):
                    h.update(piece)
                    f.write(piece)
                    n += len(piece)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
            raise
        _fsync_dir(self.root)
        return BlobRef(uri=self.ref_uri(blob_id), bytes=n, sha256=h.hexdigest())

    def open(self, ref: BlobRef) -> BinaryIO:
        path = self._path(blob_id_of(ref))
        try:
            f = open(path, "rb")  # noqa: SIM115 - handed to the caller
        except FileNotFoundError as e:
            raise MissingBlobError(f"{ref.uri}: no such blob in {self.root}") from e
        try:
            verify_stream(f, ref)
        except BaseException:
            f.close()
            raise
        return f

    def get(self, ref: BlobRef) -> bytes:
        with self.open(ref) as f:
            return f.read()

    def delete(self, ref: BlobRef | StoredBlob) -> bool:
        blob_id = ref.blob_id if isinstance(ref, StoredBlob) else blob_id_of(ref)
        try:
            os.unlink(self._path(blob_id))
        except FileNotFoundError:
            return False
        return True

    def list(self) -> list[StoredBlob]:
        out = []
        for entry in os.scandir(self.root):
            if entry.name.startswith(".") or not entry.is_file():
                continue
            if not _BLOB_ID.match(entry.name):
                continue
            st = entry.stat()
            out.append(
                StoredBlob(
                    entry.name, self.ref_uri(entry.name), st.st_size, int(st.st_mtime * 1000)
                )
            )
        return sorted(out, key=lambda b: b.blob_id)

    def remove_stale_temporaries(self, min_age_s: float) -> list[str]:
        """Delete ``.tmp-*`` files left by writers that died, older than ``min_age_s``."""
        removed = []
        now = time.time()
        for entry in os.scandir(self.root):
            if entry.name.startswith(".tmp-") and now - entry.stat().st_mtime >= min_age_s:
                try:
                    os.unlink(entry.path)
                    removed.append(entry.name)
                except FileNotFoundError:
                    pass
        return removed

    def close(self) -> None:
        pass

    def __repr__(self) -> str:
        return f"FileBlobStore({str(self.root)!r})"


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


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
        from astraflow.weights.kafka_store import KafkaBlobStore

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


def new_blob_id(policy: str, version: int, kind: str) -> str:
    """``<policy>.v<version>.<kind>.<random>``, sanitised to the blob-id alphabet."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", policy) or "policy"
    return check_blob_id(f"{safe[:120]}.v{version:08d}.{kind}.{uuid.uuid4().hex[:12]}")
