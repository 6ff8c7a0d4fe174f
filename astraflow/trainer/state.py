"""Trainer state (optimizer and fp32 master weights) written to the blob store in the
background, every N versions.

At 1.5B parameters the fp32 master weights and the two Adam moments are about 18 GB:
writing them with every version would cost more than the step. The trainer instead takes a
``StateSnapshot`` every ``state_interval`` versions: CPU copies of the tensors (training
then goes on and changes the originals), which a ``StateWriter`` thread serializes
(``torch.save``, streamed: never held serialized as a whole) into the blob store, at
most one write at a time.

A finished write is *recorded* in the ``meta`` of the next manifest the trainer commits
(``state_version`` and, as before, ``optimizer_uri/_sha256/_bytes`` and
``master_uri/_sha256/_bytes``): a manifest of version v records the state of a version
k < v. A resume loads the newest recorded state and recomputes the versions after it from
their batches (``astraflow.trainer.service``); a write that was never recorded (the
trainer died or stopped first) is garbage.
"""

from __future__ import annotations

import copy
import logging
import queue
import re
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from astraflow.wire.records import BlobRef

log = logging.getLogger("astraflow.trainer")


def _cpu_copies(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Detached CPU copies; tensors that are views of the same memory (tied embeddings)
    share one copy, as ``torch.save`` would have stored them."""
    seen: dict[tuple, torch.Tensor] = {}
    out = {}
    for k, v in tensors.items():
        key = (v.device, v.data_ptr(), v.dtype, tuple(v.shape), tuple(v.stride()))
        if key not in seen:
            seen[key] = v.detach().to("cpu", copy=True)
        out[k] = seen[key]
    return out


def _copy_optimizer_state(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer ``state_dict()`` with every tensor copied to the CPU (the optimizer
    updates its own tensors in place on the next step)."""
    return {
        "state": {
            i: {k: v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor)
                else copy.deepcopy(v) for k, v in s.items()}
            for i, s in state["state"].items()
        },
        "param_groups": copy.deepcopy(state["param_groups"]),
    }


_CHUNK = 16 << 20
_END = object()


class _QueueWriter:
    """A write-only file for ``torch.save`` that hands copies of what it is given, in
    chunks, to a bounded queue; raises once the reader is gone."""

    def __init__(self, q: queue.Queue, stop: threading.Event):
        self.q = q
        self.stop = stop

    def put(self, item: Any) -> None:
        while not self.stop.is_set():
            try:
                self.q.put(item, timeout=0.2)
                return
            except queue.Full:
                continue
        raise OSError("the reader of the serialized state stopped")

    def write(self, data: Any) -> int:
        mv = memoryview(data).cast("B")  # torch hands views of tensor memory: copy now
        for i in range(0, len(mv), _CHUNK):
            self.put(bytes(mv[i : i + _CHUNK]))
        return len(mv)

    def flush(self) -> None:
        pass


def stream_saved(obj: Any, depth: int = 4) -> Iterator[bytes]:
    """``torch.save(obj)`` as a stream of byte chunks (the same bytes as into a file),
    serialized by a helper thread at most ``depth`` chunks ahead of the reader: a multi-GB
    state is never held serialized in memory as a whole."""
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    writer = _QueueWriter(q, stop)

    def run() -> None:
        try:
            torch.save(obj, writer)  # type: ignore[arg-type]
            writer.put(_END)
        except BaseException as e:  # handed to the reader
            if not stop.is_set():
                writer.put(e)

    t = threading.Thread(target=run, name="state-serializer", daemon=True)
    t.start()
    try:
        while True:
            item = q.get()
            if item is _END:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()
        t.join()


@dataclass
class StateSnapshot:
    """The trainer's state after version ``version``, as CPU copies."""

    version: int
    optimizer: dict[str, Any]
    master: dict[str, torch.Tensor] | None = None  # None: the published weights are it
    seconds: float = 0.0  # the time the copies took

    @classmethod
    def of(
        cls,
        version: int,
        optimizer_state: dict[str, Any],
        master: dict[str, torch.Tensor] | None,
    ) -> StateSnapshot:
        t0 = time.perf_counter()
        opt = _copy_optimizer_state(optimizer_state)
        weights = _cpu_copies(master) if master is not None else None
        return cls(version, opt, weights, time.perf_counter() - t0)

    def optimizer_bytes(self) -> Iterator[bytes]:
        """The optimizer state as ``torch.save`` writes it, streamed in chunks."""
        return stream_saved(self.optimizer)

    def master_bytes(self) -> Iterator[bytes]:
        """The master weights as ``torch.save`` writes them, streamed in chunks."""
        assert self.master is not None
        return stream_saved(self.master)


@dataclass
class WrittenState:
    """A snapshot in the blob store: its blobs and the manifest ``meta`` that records it."""

    version: int
    refs: list[BlobRef]
    meta: dict[str, str]
    snapshot_seconds: float = 0.0
    write_seconds: float = 0.0

    @property
    def bytes(self) -> int:
        return sum(r.bytes for r in self.refs)


def state_meta(version: int, optimizer: BlobRef, master: BlobRef | None) -> dict[str, str]:
    """The manifest ``meta`` entries that record the state of ``version``."""
    meta = {"state_version": str(version)}
    for kind, ref in (("optimizer", optimizer), ("master", master)):
        if ref is not None:
            meta[f"{kind}_uri"] = ref.uri
            meta[f"{kind}_sha256"] = ref.sha256
            meta[f"{kind}_bytes"] = str(ref.bytes)
    return meta


# the manifest meta key of a state written through torch.distributed.checkpoint: its
# directory (astraflow.trainer.checkpoint_writer)
STATE_DIR_KEY = "state_dcp"
# ... and of such a state whose files went to the blob store: a JSON list of them
STATE_FILES_KEY = "state_dcp_files"


def recorded_state_version(manifest_version: int, meta: dict[str, str]) -> int | None:
    """The version whose state a manifest's ``meta`` records (None: none). Manifests
    written before states were asynchronous name their own version implicitly."""
    if "optimizer_uri" not in meta and STATE_DIR_KEY not in meta and STATE_FILES_KEY not in meta:
        return None
    return int(meta.get("state_version", manifest_version))


def write_state(store: Any, policy: str, snap: StateSnapshot) -> WrittenState:
    """Serialize ``snap`` into ``store`` (blocking): optimizer, then master weights."""
    t0 = time.perf_counter()
    stem = f"{re.sub(r'[^A-Za-z0-9._-]', '_', policy)[:120] or 'policy'}.v{snap.version:08d}"
    tag = uuid.uuid4().hex[:12]
    opt = store.put(f"{stem}.optim.{tag}", snap.optimizer_bytes())
    refs = [opt]
    master = None
    if snap.master is not None:
        master = store.put(f"{stem}.master.{tag}", snap.master_bytes())
        refs.append(master)
    return WrittenState(snap.version, refs, state_meta(snap.version, opt, master),
                        snapshot_seconds=snap.seconds, write_seconds=time.perf_counter() - t0)


class TrainerStateWriter(Protocol):
    """What the trainer service needs of a state writer, whatever its format: one write
    of the trainer's state at a time, in the background.

    ``start(version)`` begins writing the trainer's current state as ``version``'s (the
    previous write must have been collected) and returns the seconds the training thread
    spent on it (the snapshot or the copy it starts); ``poll`` returns a finished write
    once (None while it runs or when none was started); ``wait`` blocks until the write
    in flight is done and returns it; a failed write raises its error (``RuntimeError``)
    from ``poll``/``wait``. ``remove(version)`` drops what the writer keeps of a state
    beyond the blobs its ``WrittenState.refs`` name (those the service deletes from the
    blob store itself): a state no manifest records, or one superseded.
    ``StateWriter`` (the blob format) and ``astraflow.trainer.checkpoint_writer.
    CheckpointWriter`` (``torch.distributed.checkpoint``) are the two."""

    @property
    def in_flight(self) -> int | None:
        """The version being written (or written and not collected yet), None if none."""
        ...

    def start(self, version: int) -> float: ...

    def poll(self) -> WrittenState | None: ...

    def wait(self) -> WrittenState | None: ...

    def remove(self, version: int) -> None: ...


@dataclass
class StateWriter:
    """The blob format's ``TrainerStateWriter``: snapshots of ``trainer`` (``Trainer.
    snapshot``, CPU copies on the training thread) serialized into ``store`` by one
    background thread, one at a time."""

    store: Any
    policy: str
    trainer: Any
    _thread: threading.Thread | None = None
    _result: WrittenState | None = None
    _error: BaseException | None = None
    _version: int | None = None
    _done: threading.Event = field(default_factory=threading.Event)

    @property
    def in_flight(self) -> int | None:
        """The version being written (or written and not collected yet), None if none."""
        return self._version

    def start(self, version: int) -> float:
        """Snapshot the trainer's state as ``version``'s and write it in the background;
        the seconds the snapshot took."""
        if self._version is not None:
            raise RuntimeError(f"state of version {self._version} is still being written")
        snap = self.trainer.snapshot(version)
        self._version, self._result, self._error = snap.version, None, None
        self._done.clear()
        self._thread = threading.Thread(
            target=self._run, args=(snap,), name=f"state-writer-v{snap.version}", daemon=True
        )
        self._thread.start()
        return snap.seconds

    def remove(self, version: int) -> None:
        """Nothing: a state in the blob format is only its blobs (``WrittenState.refs``)."""

    def _run(self, snap: StateSnapshot) -> None:
        try:
            self._result = write_state(self.store, self.policy, snap)
        except BaseException as e:  # handed to the training thread by poll/wait
            self._error = e
        finally:
            self._done.set()

    def poll(self) -> WrittenState | None:
        if self._version is None or not self._done.is_set():
            return None
        return self._collect()

    def wait(self) -> WrittenState | None:
        if self._version is None:
            return None
        self._done.wait()
        return self._collect()

    def _collect(self) -> WrittenState:
        assert self._thread is not None
        self._thread.join()
        version, self._version, self._thread = self._version, None, None
        if self._error is not None:
            err, self._error = self._error, None
            raise RuntimeError(f"writing the trainer state of version {version} failed: "
                               f"{type(err).__name__}: {err}") from err
        assert self._result is not None
        result, self._result = self._result, None
        return result


__all__ = [
    "STATE_DIR_KEY",
    "STATE_FILES_KEY",
    "StateSnapshot",
    "StateWriter",
    "TrainerStateWriter",
    "WrittenState",
    "recorded_state_version",
    "state_meta",
    "stream_saved",
    "write_state",
]
