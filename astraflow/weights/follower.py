"""Following versions: ``WeightFollower`` keeps a state dict at the newest (or a chosen)
version of one policy from the manifests it is shown, planning (``weights.planning``),
fetching and verifying every blob of a plan before applying any (``weights.apply``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, BinaryIO

import torch

from astraflow.weights.apply import apply_blob, apply_parts, empty_state
from astraflow.weights.bits import StateDict, dtype_name
from astraflow.weights.digest import STATE_DIGEST, own_copy, state_digest
from astraflow.weights.errors import (
    BaseMismatchError,
    BlobError,
    ManifestSignatureError,
    NoPlanError,
)
from astraflow.weights.manifests import ManifestKey, manifest_key
from astraflow.weights.pipeline import default_threads
from astraflow.weights.planning import plan_update
from astraflow.weights.stores import StoreResolver
from astraflow.weights.stores.base import BlobStore
from astraflow.wire.records import TensorInfo, WeightManifest

if TYPE_CHECKING:
    from astraflow.kafka.config import KafkaConfig
    from astraflow.weights.signing import ManifestVerifier

log = logging.getLogger(__name__)


@dataclass
class UpdateResult:
    """What ``WeightFollower.update`` did."""

    from_version: int | None
    version: int | None
    applied: list[WeightManifest] = field(default_factory=list)
    bytes_fetched: int = 0
    failures: list[tuple[WeightManifest, str]] = field(default_factory=list)
    seconds: float = 0.0


class WeightFollower:
    """Keeps a state dict at the newest (or a chosen) version of one policy.

    Feed it every manifest seen on ``weights.<policy>`` with ``observe``; ``update`` plans
    from the held version, fetches and verifies all blobs of the plan, then applies them.
    A blob that is missing or corrupt excludes its manifest and the plan is recomputed; a
    delta that does not match the held state (``BaseMismatchError``) makes the follower
    forget its version and continue from a full checkpoint. Nothing unverified is applied.

    ``inplace`` updates the tensors of ``state`` (the engine's weights, if they live on
    the CPU); otherwise each step produces new tensors.

    With a ``verifier`` (``astraflow.weights.signing.ManifestVerifier``) a manifest that is
    not signed by a trusted key is refused by ``observe``: it is never planned with, so the
    held version stays in use; ``take_refused`` hands each refusal over once (to be
    dead-lettered).

    ``part=(index, count)``: follow only process ``index``'s part of versions published by
    ``count`` processes (``merge_parts``: ``meta["parts"]``, one blob per process, in
    process order), as a rank of a group of ``count`` holds its rows of a sharded model.
    The state then holds that part alone, each tensor in the part's shape (a tensor the
    process holds no row of is absent); only that blob of each version is fetched, and
    manifests made otherwise are never planned with (``NoPlanError`` when no chain of
    such manifests reaches the target).
    """

    def __init__(
        self,
        *,
        state: StateDict | None = None,
        version: int | None = None,
        policy: str | None = None,
        stores: Iterable[BlobStore] = (),
        kafka_config: KafkaConfig | None = None,
        threads: int | None = None,
        inplace: bool = True,
        verifier: ManifestVerifier | None = None,
        part: tuple[int, int] | None = None,
    ):
        if (state is None) != (version is None):
            raise ValueError("pass both state and version, or neither")
        if part is not None and not 0 <= part[0] < part[1]:
            raise ValueError(f"part (index, count) needs 0 <= index < count, got {part}")
        self.part = part
        self.verifier = verifier
        # every refusal: (manifest key, its signature) -> reason
        self.refused: dict[tuple[ManifestKey, bytes], str] = {}
        self._unreported: list[tuple[WeightManifest, str]] = []
        self.state: dict[str, torch.Tensor] | None = dict(state) if state is not None else None
        self.version = version
        self.policy = policy
        self.resolver = StoreResolver(stores, kafka_config)
        self.threads = threads or default_threads()
        self.inplace = inplace
        self._manifests: dict[ManifestKey, WeightManifest] = {}
        self._bad: dict[ManifestKey, str] = {}

    def observe(self, manifests: WeightManifest | Iterable[WeightManifest]) -> None:
        """Remember manifest(s); those of another policy are ignored once one is set."""
        if isinstance(manifests, WeightManifest):
            manifests = [manifests]
        for m in manifests:
            if self.policy is None:
                self.policy = m.policy
            if m.policy == self.policy and self._in_parts(m) and self._trusted(m):
                self._manifests[manifest_key(m)] = m

    def _in_parts(self, m: WeightManifest) -> bool:
        """Whether ``m`` is made as ``part`` needs (always, without one)."""
        return self.part is None or made_of_parts(m, self.part[1])

    def _trusted(self, m: WeightManifest) -> bool:
        """Whether ``m`` passes the verifier (always, without one); a refusal is logged
        and kept for ``take_refused``."""
        if self.verifier is None:
            return True
        try:  # every time: a forged copy of a key must not shadow the signed one
            self.verifier.verify(m)
        except ManifestSignatureError as e:
            seen = (manifest_key(m), m.signature or b"")
            if seen not in self.refused:
                log.warning("weights: refused: %s; the held version stays in use", e)
                self.refused[seen] = str(e)
                self._unreported.append((m, str(e)))
            return False
        return True

    def take_refused(self) -> list[tuple[WeightManifest, str]]:
        """The manifests refused since the last call, with the reason."""
        out, self._unreported = self._unreported, []
        return out

    @property
    def manifests(self) -> list[WeightManifest]:
        return sorted(self._manifests.values(), key=lambda m: (m.version, m.kind))

    @property
    def latest_version(self) -> int | None:
        """Newest version seen (None if none)."""
        return max((m.version for m in self._manifests.values()), default=None)

    def plan(self, target: int | None = None) -> list[WeightManifest]:
        """The plan ``update`` would follow now."""
        t = self.latest_version if target is None else target
        if t is None:
            raise NoPlanError("no manifest seen yet")
        return plan_update(self.version, t, self._manifests.values(), exclude=self._bad)

    def adopt(self, state: StateDict, version: int = 0) -> bool:
        """Hold a copy of ``state`` (an engine's weights loaded from disk) as ``version``
        when that version's full checkpoint manifest carries a digest
        (``weights.digest``) that the copy, cast to the manifest's dtypes, matches: the
        next update then fetches only what follows ``version``. Otherwise, or when a
        version is held already, nothing changes and it returns False."""
        if self.version is not None:
            return False
        vouching = [m for m in self._manifests.values()
                    if m.version == version and m.kind == "full" and STATE_DIGEST in m.meta]
        if not vouching:
            return False
        m = vouching[0]
        copy = own_copy(state, m.tensors)
        if copy is None or state_digest(copy, m.tensors) != m.meta[STATE_DIGEST]:
            return False
        self.state, self.version = copy, version
        return True

    def forget_failures(self) -> None:
        """Let manifests that failed before be tried again (e.g. after a store recovered)."""
        self._bad.clear()

    def _fetch(self, plan: list[WeightManifest]) -> list[tuple[WeightManifest, list[BinaryIO]]]:
        """Open (fetch and verify) every blob of the plan, or raise ``_FetchError``."""
        opened: list[tuple[WeightManifest, list[BinaryIO]]] = []
        try:
            for m in plan:
                files: list[BinaryIO] = []
                opened.append((m, files))
                for ref in (m.blobs if self.part is None else [m.blobs[self.part[0]]]):
                    try:
                        files.append(self.resolver.open(ref))
                    except BlobError as e:
                        raise _FetchError(m, e) from e
        except BaseException:
            _close(opened)
            raise
        return opened

    def update_reachable(self, target: int | None = None, max_versions: int = 50
                         ) -> UpdateResult:
        """``update`` to ``target`` (default: the newest seen) or, when no usable chain
        reaches it (a blob missing or corrupt), to the newest older version one reaches;
        ``NoPlanError`` only when none of the ``max_versions`` newest does."""
        t = self.latest_version if target is None else target
        if t is None:
            raise NoPlanError("no manifest seen yet")
        if t == self.version:
            return self.update(t)
        floor = self.version if self.version is not None else -1
        candidates = sorted({m.version for m in self._manifests.values()
                             if floor < m.version <= t}, reverse=True)[:max_versions]
        error: NoPlanError | None = None
        for v in candidates:
            try:
                result = self.update(v)
            except NoPlanError as e:
                error = error or e
                continue
            if v != t:
                log.warning("weights: v%s is unreachable (%s); now at v%s, the newest "
                            "reachable version", t, error, v)
            return result
        raise error or NoPlanError(f"no version after v{floor} up to v{t} is known")

    def update(self, target: int | None = None, max_attempts: int = 100) -> UpdateResult:
        """Bring the state to ``target`` (default: the newest version seen).

        Raises ``NoPlanError`` when no usable chain of manifests is left.
        """
        t0 = time.perf_counter()
        t = self.latest_version if target is None else target
        result = UpdateResult(self.version, self.version)
        if t is None:
            raise NoPlanError("no manifest seen yet")
        attempts = 0
        while self.version != t:
            attempts += 1
            if attempts > max_attempts:
                raise NoPlanError(f"gave up after {max_attempts} plans: {result.failures[-3:]}")
            plan = plan_update(self.version, t, self._manifests.values(), exclude=self._bad)
            try:
                opened = self._fetch(plan)
            except _FetchError as e:
                self._fail(e.manifest, e.error, result)
                continue
            try:
                for m, files in opened:
                    try:
                        state = self._apply(m, files)
                    except BlobError as e:
                        self._fail(m, e, result)
                        break
                    except BaseMismatchError as e:
                        if m.kind == "full":  # does not fit the engine's tensors at all
                            self._fail(m, e, result)
                        else:
                            log.warning(
                                "weights: delta v%s does not fit held v%s (%s); "
                                "continuing from a full checkpoint",
                                m.version,
                                self.version,
                                e,
                            )
                            result.failures.append((m, f"base mismatch: {e}"))
                            self.version = None
                        break
                    self.state = state
                    self.version = m.version
                    result.applied.append(m)
                    result.bytes_fetched += sum(b.bytes for b in m.blobs)
            finally:
                _close(opened)
        result.version = self.version
        result.seconds = time.perf_counter() - t0
        return result

    def _apply(self, m: WeightManifest, files: list[BinaryIO]) -> dict[str, torch.Tensor]:
        """The held state with manifest ``m``'s verified blobs applied. Several blobs (a
        merged manifest, ``merge_parts``) are one version's parts, applied together: a
        full checkpoint's parts go into the held tensors (``inplace``, when they match) or
        a new state, and must cover every element once. Following a ``part``: its one
        blob, applied to the part alone."""
        if self.part is not None:
            return apply_blob(self.state, files[0], inplace=self.inplace, threads=self.threads,
                              part_alone=True)
        if len(files) == 1 and "parts" not in m.meta:
            return apply_blob(self.state, files[0], inplace=self.inplace, threads=self.threads)
        state = self.state
        if m.kind == "full" and (state is None or not self.inplace
                                 or not _matches(state, m.tensors)):
            state = empty_state(m.tensors)
            return apply_parts(state, files, inplace=True, threads=self.threads)
        return apply_parts(state, files, inplace=self.inplace, threads=self.threads)

    def _fail(self, m: WeightManifest, e: Exception, result: UpdateResult) -> None:
        log.warning("weights: %s manifest v%s unusable: %s", m.kind, m.version, e)
        self._bad[manifest_key(m)] = str(e)
        result.failures.append((m, str(e)))

    def close(self) -> None:
        self.resolver.close()


def made_of_parts(m: WeightManifest, count: int) -> bool:
    """Whether ``m`` is one version's parts from ``count`` processes, one blob each, in
    process order (``merge_parts``): what ``WeightFollower(part=(i, count))`` follows."""
    return parts_count(m) == count


def parts_count(m: WeightManifest) -> int | None:
    """The count of processes whose parts make ``m`` (``merge_parts``: one blob each, in
    process order), None when it is one process's whole tensors."""
    n = m.meta.get("parts")
    if n is None or not n.isdigit() or int(n) != len(m.blobs):
        return None
    return int(n)


def _matches(state: StateDict, tensors: Sequence[TensorInfo]) -> bool:
    """Whether ``state`` has exactly the manifest's tensors (names, shapes, dtypes)."""
    if len(state) != len(tensors):
        return False
    for t in tensors:
        u = state.get(t.name)
        if u is None or list(u.shape) != list(t.shape) or dtype_name(u.dtype) != t.dtype:
            return False
    return True


def _close(opened: list[tuple[WeightManifest, list[BinaryIO]]]) -> None:
    for _, files in opened:
        for f in files:
            try:
                f.close()
            except Exception:  # pragma: no cover
                pass


class _FetchError(Exception):
    def __init__(self, manifest: WeightManifest, error: BlobError):
        super().__init__(str(error))
        self.manifest = manifest
        self.error = error
