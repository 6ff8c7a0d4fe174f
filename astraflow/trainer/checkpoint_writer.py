"""Trainer states through ``torch.distributed.checkpoint``, written in the background.

``CheckpointWriter`` is a ``TrainerStateWriter`` (``astraflow.trainer.state``: ``start``,
``poll``, ``wait``, ``in_flight``, ``remove``) for states that every process of a trainer
group writes its own shards of (``astraflow.trainer.checkpoint``): ``start(version)`` only
starts the copy on the training thread, the files are written by DCP's background thread, and the
finished write is recorded in a manifest's ``meta`` as ``state_version`` and the directory
(``STATE_DIR_KEY``). Such a state loads into any number of processes (resharded).

The directory must be one that every process reaches at the same path: on one host any
local directory, across hosts a shared filesystem. Or, for states small enough to go
through Kafka (processes on one host), the blob store: the directory is then only where DCP
writes; once the write is complete rank 0 puts its files into the blob store in the
writer's thread, records them in the manifest (``STATE_FILES_KEY``: name, uri, bytes,
sha256 of each) and removes the directory; a resume fetches the files back
(``fetch_state_files``).
"""

from __future__ import annotations

import json
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

from astraflow.trainer import checkpoint
from astraflow.trainer.state import STATE_DIR_KEY, STATE_FILES_KEY, WrittenState
from astraflow.wire.records import BlobRef

_CHUNK = 16 << 20


def state_path(root: Path, policy: str, version: int) -> Path:
    """The directory of ``policy``'s state of ``version`` under ``root``."""
    return root / f"{policy}.v{version:08d}"


class CheckpointWriter:
    """One background state write at a time, of ``trainer``'s shards, under ``root``;
    with ``store`` (given to rank 0 of processes on one host alone) its files then go to
    the blob store. ``owner``: this process removes the directories (``remove``), which
    are the whole group's (rank 0)."""

    def __init__(self, trainer: Any, root: Path, policy: str, store: Any = None,
                 owner: bool = True):
        self.trainer = trainer
        self.root = root
        self.policy = policy
        self.store = store
        self.owner = owner
        self._version: int | None = None
        self._handle: Any = None
        self._upload: Future | None = None
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="state-upload")
        self._t0 = 0.0
        self._start_s = 0.0

    @property
    def in_flight(self) -> int | None:
        """The version being written (or written and not collected yet), None if none."""
        return self._version

    def start(self, version: int) -> float:
        """Start writing the state of ``version`` (the trainer's current state); the
        seconds the start (DCP's copy) took on the training thread."""
        if self._version is not None:
            raise RuntimeError(f"state of version {self._version} is still being written")
        where = state_path(self.root, self.policy, version)
        where.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.perf_counter()
        self._handle = checkpoint.save(self.trainer, where, async_=True, version=version)
        self._start_s = time.perf_counter() - self._t0
        self._version = version
        if self.store is not None:
            self._upload = self._pool.submit(self._put_files, self._handle, where, version)
        return self._start_s

    def _put_files(self, handle: Any, where: Path, version: int) -> list[dict[str, Any]]:
        """Once DCP's write is complete (rank 0's handle: every rank's files): every file
        of ``where`` into the blob store, then the directory goes."""
        handle.result()
        tag = uuid.uuid4().hex[:12]
        files = []
        for f in sorted(p for p in where.iterdir() if p.is_file()):
            ref = self.store.put(f"{self.policy}.v{version:08d}.dcp.{tag}.{f.name.lstrip('.')}",
                                 _chunks(f))
            files.append({"name": f.name, "uri": ref.uri, "bytes": ref.bytes,
                          "sha256": ref.sha256})
        shutil.rmtree(where, ignore_errors=True)
        return files

    def poll(self) -> WrittenState | None:
        if self._version is None or not self._handle.done():
            return None
        if self._upload is not None and not self._upload.done():
            return None
        return self._collect()

    def wait(self) -> WrittenState | None:
        if self._version is None:
            return None
        return self._collect()

    def _collect(self) -> WrittenState:
        version, handle = self._version, self._handle
        self._version = self._handle = None
        assert version is not None
        where = state_path(self.root, self.policy, version)
        upload, self._upload = self._upload, None
        try:
            handle.result()
            files = upload.result() if upload is not None else None
        except Exception as e:
            raise RuntimeError(f"writing the trainer state of version {version} to {where} "
                               f"failed: {type(e).__name__}: {e}") from e
        if files is not None:  # in the blob store
            refs = [BlobRef(uri=f["uri"], bytes=f["bytes"], sha256=f["sha256"]) for f in files]
            meta = {"state_version": str(version), STATE_FILES_KEY: json.dumps(files),
                    "state_bytes": str(sum(f["bytes"] for f in files))}
        else:
            refs = []
            size = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
            meta = {"state_version": str(version), STATE_DIR_KEY: str(where.absolute()),
                    "state_bytes": str(size)}
        return WrittenState(version, refs, meta, snapshot_seconds=self._start_s,
                            write_seconds=time.perf_counter() - self._t0)

    def remove(self, version: int) -> None:
        """Remove the directory of ``version``'s state (no manifest records it, or it is
        superseded), where this process owns it."""
        if self.owner:
            shutil.rmtree(state_path(self.root, self.policy, version), ignore_errors=True)


def _chunks(path: Path) -> Iterator[bytes]:
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            yield chunk


def state_files(meta: dict[str, str]) -> list[tuple[str, BlobRef]]:
    """The files of a state in the blob store, as a manifest's ``meta`` records them."""
    return [(f["name"], BlobRef(uri=f["uri"], bytes=int(f["bytes"]), sha256=f["sha256"]))
            for f in json.loads(meta[STATE_FILES_KEY])]


def fetch_state_files(meta: dict[str, str], into: Path,
                      open_blob: Callable[[BlobRef], Any]) -> Path:
    """Fetch a blob-store state's files (each checked for size and sha256 by
    ``open_blob``) into the directory ``into``, for ``checkpoint.load``."""
    into.mkdir(parents=True, exist_ok=True)
    for name, ref in state_files(meta):
        with open_blob(ref) as src, open(into / name, "wb") as dst:
            shutil.copyfileobj(src, dst, _CHUNK)
    return into


__all__ = ["CheckpointWriter", "fetch_state_files", "state_files", "state_path"]
