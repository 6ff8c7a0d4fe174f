"""``FileBlobStore`` (``file:///dir``): one file per blob; writes go to a temporary file
that is fsynced and atomically renamed, so a reader never sees half a blob."""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
from pathlib import Path
from typing import BinaryIO

from astraflow.weights.errors import MissingBlobError
from astraflow.weights.stores.base import (
    BLOB_ID,
    BlobData,
    StoredBlob,
    blob_id_of,
    check_blob_id,
    pieces,
    verify_stream,
)
from astraflow.wire.records import BlobRef


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
            if not BLOB_ID.match(entry.name):
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
