"""A trainer's weight publishing, apart from its Kafka work.

``Publishing`` turns the trainer's published weights into versions in the blob store:
what changed since the previous version is found on the weights' device and encoded and
written on a thread of its own (``start``; ``finish`` waits for it), a delta or, every
``anchor_interval`` versions, a full checkpoint (``astraflow.weights.publisher``). In a
group of processes each rank writes its own rows and rank 0 merges every rank's manifests
into the version's. It signs manifests (a configured key), names the model's other files
in a full checkpoint's meta, and keeps the committed manifests whose blobs a reader may
still need, removing the older ones' blobs (``keep_versions``). Putting the manifests
into a transaction is the service's work (``astraflow.trainer.service``).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from astraflow.config.lora import LoraSpec
from astraflow.models.lora import META_KEY as LORA_META
from astraflow.wire.records import BlobRef, PartitionOffset, WeightManifest

if TYPE_CHECKING:
    from astraflow.trainer.parallel import Group
    from astraflow.trainer.trainer import Trainer

log = logging.getLogger("astraflow.trainer")


class Publishing:
    """The versions of ``policy``'s weights ``trainer`` publishes into ``store``.

    ``group``: this process is one rank of a trainer group (it publishes its rows; rank
    0's ``finish`` returns the merged manifests, the other ranks' None). ``lora``: the
    trainer trains these adapters (each version then goes whole when that is smaller
    than its delta, and every manifest names the adapter's shape)."""

    def __init__(self, trainer: Trainer, store: Any, policy: str, *, anchor_interval: int,
                 keep_versions: int, model_path: str, lora: LoraSpec | None = None,
                 signer: Any = None, name: str = "trainer"):
        self.trainer = trainer
        self.store = store
        self.policy = policy
        self.anchor_interval = anchor_interval
        self.keep_versions = keep_versions
        self.model_path = model_path
        self.lora = lora
        self.group: Group = trainer.group  # the trainer's processes: each publishes its part
        self.signer = signer
        self.name = name  # for the log
        self.publisher: Any = None  # the WeightPublisher of the current chain of versions
        self.history: list[WeightManifest] = []  # the manifests whose blobs may be kept
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="publish")

    def restart(self, version: int | None = None, state: dict | None = None,
                part: bool = False) -> None:
        """Start a chain of versions: from ``version``, whose published weights are
        ``state`` (cut to this rank's rows in a group; ``part``: they are this rank's part
        already), or with no base (the next version is a full checkpoint)."""
        from astraflow.weights.publisher import WeightPublisher

        rows = None
        if self.trainer.sharded:
            mine, rows = self.trainer.published_part()
            if state is not None and not part:
                state = {k: _rows_of(state[k], rows.get(k)) for k in mine}
        lora = self.lora
        self.publisher = WeightPublisher(
            self.store, self.policy, anchor_interval=self.anchor_interval, rows=rows,
            version=version, state=state, whole_when_smaller=lora is not None,
            meta={LORA_META: lora.to_json()} if lora is not None else None)

    def publish(self, version: int, offsets: list[PartitionOffset] | None = None,
                meta: dict[str, str] | None = None) -> list[WeightManifest] | None:
        """Write this process's blob(s) of ``version``; its manifests (rank 0 of a group:
        every rank's parts merged; the other ranks: None)."""
        return self.finish(self.start(version, offsets, meta))

    def start(self, version: int, offsets: list[PartitionOffset] | None = None,
              meta: dict[str, str] | None = None) -> Future:
        """Find what changed in this process's published weights (on their device) and
        start encoding and writing it on the publishing thread."""
        state = (self.trainer.published_part()[0] if self.trainer.sharded
                 else self.trainer.published_state())
        # trainer_step: the batches these weights have trained (the schedule's count)
        prepared = self.publisher.prepare(state, version=version,
                                          trainer_step=self.trainer.steps,
                                          consumed_offsets=offsets or [], meta=meta)
        return self._pool.submit(prepared.write)

    def finish(self, written: Future) -> list[WeightManifest] | None:
        """The manifests of a started publish once written (rank 0 of a group: every
        rank's parts merged; the other ranks: None)."""
        from astraflow.weights.merge import merge_parts

        mine = written.result()
        if self.group.world == 1:
            return mine
        every = self.group.gather(mine)
        if every is None:
            return None
        merged = merge_parts(every)
        for m in merged:  # rank 0's offsets and meta: the other ranks know none
            m.consumed_offsets = list(mine[0].consumed_offsets)
            m.meta.update(mine[0].meta)
        return merged

    def signed(self, manifests: list[WeightManifest]) -> list[WeightManifest]:
        """``manifests``, signed (in place) when this trainer has a signing key."""
        if self.signer is not None:
            for m in manifests:
                self.signer.sign(m)
        return manifests

    def add_model_files(self, manifests: list[WeightManifest]) -> None:
        """Name the model's other files (config, tokenizer) in a full checkpoint's meta, so
        that a reader needs nothing but Kafka (``astraflow.models.share``)."""
        from astraflow.models.share import model_files_meta

        for m in manifests:
            if m.kind == "full":
                m.meta.update(model_files_meta(self.store, self.policy, m.version,
                                               self.model_path))

    def committed(self, manifests: list[WeightManifest], states: list[BlobRef]) -> None:
        """``manifests`` are committed: kept, and with a new full checkpoint the versions
        no reader needs any more are pruned (``states``: the blobs of the recorded trainer
        states, which stay)."""
        self.history += manifests
        if any(m.kind == "full" for m in manifests):
            self.prune(states)

    def prune(self, states: list[BlobRef]) -> None:
        """Remove the weight blobs no reader needs: those of versions before the newest full
        checkpoint at or below ``newest - keep_versions`` (``states`` stay)."""
        from astraflow.models.share import files_ref
        from astraflow.weights.retention import retained_manifests

        if not self.keep_versions:
            return
        kept = retained_manifests(self.history, keep_last=self.keep_versions)
        if len(kept) == len(self.history):
            return
        start = min(m.version for m in kept)
        dropped = [m for m in self.history if m.version < start]
        truncate = getattr(self.store, "truncate_to", None)
        if truncate is not None:
            moved = truncate([ref for m in kept for ref in m.blobs] + list(states))
            how = f"records deleted up to offsets {moved}" if moved else "nothing to delete yet"
        else:
            refs = [ref for m in dropped for ref in [*m.blobs, files_ref(m)] if ref is not None]
            gone = sum(delete_blob(self.store, ref) for ref in refs)
            how = f"{gone} blobs deleted"
        self.history = kept
        log.info("%s: pruned the weight blobs of versions before %d (%s); versions %d.. stay "
                 "reachable", self.name, start, how, start)

    def close(self) -> None:
        """Wait for a write in flight and stop the publishing thread."""
        self._pool.shutdown(wait=True)


def delete_blob(store: Any, ref: BlobRef) -> bool:
    """Delete ``ref`` from ``store``; False where it cannot (it is kept: harmless)."""
    try:
        return bool(store.delete(ref))
    except Exception as e:  # a store that cannot delete keeps it: harmless
        log.debug("could not delete %s: %s", ref.uri, e)
        return False


def _rows_of(t, rows) -> Any:
    """Rows ``rows.start..rows.stop`` of dim 0 of ``t`` (all of it when ``rows`` is None)."""
    return t if rows is None else t[rows.start:rows.stop]


__all__ = ["Publishing", "delete_blob"]
