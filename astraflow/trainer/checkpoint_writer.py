"""Trainer states through ``torch.distributed.checkpoint``, written in the background.

``CheckpointWriter`` has ``StateWriter``'s interface (``astraflow.trainer.state``: ``start``,
``poll``, ``wait``, ``in_flight``) for states that every process of a trainer group writes
its own shards of (``astraflow.trainer.checkpoint``): ``start(version)`` only starts the
copy on the training thread, the files are written by DCP's background thread, and the
finished write is recorded in a manifest's ``meta`` as ``state_version`` and the directory
(``STATE_DIR_KEY``). Such a state loads into any number of processes (resharded).

The directory must be one that every process reaches at the same path: on one host any
local directory, across hosts a shared filesystem.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from astraflow.trainer import checkpoint
from astraflow.trainer.state import STATE_DIR_KEY, WrittenState


def state_path(root: Path, policy: str, version: int) -> Path:
    """The directory of ``policy``'s state of ``version`` under ``root``."""
    return root / f"{policy}.v{version:08d}"


class CheckpointWriter:
    """One background state write at a time, of ``trainer``'s shards, under ``root``."""

    def __init__(self, trainer: Any, root: Path, policy: str):
        self.trainer = trainer
        self.root = root
        self.policy = policy
        self._version: int | None = None
        self._handle: Any = None
        self._t0 = 0.0
        self._start_s = 0.0

    @property
    def in_flight(self) -> int | None:
        """The version being written (or written and not collected yet), None if none."""
        return self._version

    def start(self, version: int) -> None:
        """Start writing the state of ``version`` (the trainer's current state)."""
        if self._version is not None:
            raise RuntimeError(f"state of version {self._version} is still being written")
        where = state_path(self.root, self.policy, version)
        where.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.perf_counter()
        self._handle = checkpoint.save(self.trainer, where, async_=True, version=version)
        self._start_s = time.perf_counter() - self._t0
        self._version = version

    def poll(self) -> WrittenState | None:
        if self._version is None or not self._handle.done():
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
        try:
            handle.result()
        except Exception as e:
            raise RuntimeError(f"writing the trainer state of version {version} to {where} "
                               f"failed: {type(e).__name__}: {e}") from e
        size = sum(f.stat().st_size for f in where.rglob("*") if f.is_file())
        meta = {"state_version": str(version), STATE_DIR_KEY: str(where.absolute()),
                "state_bytes": str(size)}
        return WrittenState(version, [], meta, snapshot_seconds=self._start_s,
                            write_seconds=time.perf_counter() - self._t0)

    def delete(self, version: int) -> None:
        """Remove the state of ``version`` (no manifest records it, or it is superseded)."""
        shutil.rmtree(state_path(self.root, self.policy, version), ignore_errors=True)


__all__ = ["CheckpointWriter", "state_path"]
