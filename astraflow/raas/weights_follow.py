"""Keeping an engine at the newest published weights of its policy.

``WeightWatcher`` reads ``<run>.weights.<policy>`` as a ``TopicTable`` (no group: every
partition from the beginning, ``read_committed``), feeds every new manifest to a
``WeightFollower``, and on ``refresh()`` — called between generations — brings the
engine to the newest version if one is newer than what it holds. The check polls with
timeout 0, so it costs next to nothing when nothing changed, and it never waits for a
trainer: without a newer version the engine keeps generating with what it has.

The engine's initial weights (loaded from disk) count as version 0. Before the first
update the follower is offered a copy of them, and keeps it as version 0 when version 0's
manifest carries their digest (``astraflow.weights.digest``): the first update then
fetches deltas only. Otherwise the follower starts holding nothing and the first update
takes a full checkpoint plus deltas. Later ones are deltas from the follower's own copy
(one extra CPU copy of the weights).

With a ``verifier`` (signed weights, ``astraflow.weights.signing``) a manifest not signed by
a trusted key is refused: the engine keeps its version, and ``dead_letters`` hands the
refusals to the node, which dead-letters them in its next transaction.

In-flight updates (the pool's ``update_every_tokens``): ``start_prefetch`` runs a thread
that polls the manifests and fetches the newest version into the follower's copy while
the engine generates; between two chunks of a generation the engine calls ``take_ready``,
which hands it that copy when it is newer than the engine's weights and not being written
(it never waits: a fetch in progress means the next chunk asks again). One lock guards the
manifest table and the follower, so the prefetch thread, ``refresh`` between calls and
``take_ready`` take turns; ``refresh`` waits for a fetch in progress, as it would have
fetched itself.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from confluent_kafka import KafkaException

from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.table import TopicTable
from astraflow.raas.engine import Engine, LoadWeights
from astraflow.wire.codec import Codec
from astraflow.wire.records import DeadLetter, WeightManifest

log = logging.getLogger("astraflow.raas.weights")


class WeightWatcher:
    """Follows ``weights.<policy>`` (a ``TopicTable`` of its manifests, keyed by manifest
    identity) and brings ``engine`` to the newest version on ``refresh``."""

    def __init__(
        self,
        config: KafkaConfig,
        topic: str,
        engine: Engine,
        codec: Codec,
        stores: tuple[Any, ...] = (),
        verifier: Any = None,
    ):
        from astraflow.weights import WeightFollower

        self.topic = topic
        self.engine = engine
        self.codec = codec
        self.follower = WeightFollower(policy=engine.policy, stores=stores, kafka_config=config,
                                       verifier=verifier)
        # where each manifest was read (partition, offset), to name it in a dead letter
        self._where: dict[tuple[Any, bytes], tuple[int, int]] = {}
        self.manifests: TopicTable[Any, WeightManifest] = TopicTable.open(
            config, topic, WeightManifest, codec=codec, key=self._key,
            client_id=f"raas-weights-{engine.policy}")
        self.manifests.on_change(self._observe)
        self._failed_target: int | None = None
        self._offered_own = False  # the engine's weights from disk, offered as version 0
        self.updates = 0
        self.manifests_seen = 0
        self.last_update_s = 0.0
        self.update_s = 0.0  # seconds of every update: fetch, apply and load
        self.inflight_updates = 0  # versions handed to the engine inside a generation
        self.prefetches = 0  # versions fetched by the prefetch thread
        # the manifest table and the follower: one thread at a time (see the module doc)
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._prefetcher: threading.Thread | None = None
        self._refused_inflight: int | None = None  # a version the engine refused mid-call

    def _key(self, entry: Any) -> Any:
        """The table key of a manifest (its identity); its place is noted when verifying."""
        from astraflow.weights.manifests import manifest_key

        m = entry.value
        if m is None:
            return None
        if self.follower.verifier is not None:
            self._where[(manifest_key(m), m.signature or b"")] = (entry.partition, entry.offset)
        return manifest_key(m)

    def dead_letters(self, component_id: str) -> list[DeadLetter]:
        """A ``DeadLetter`` for each manifest refused since the last call, with the reason."""
        from astraflow.weights.manifests import manifest_key

        out = []
        with self._lock:
            refused = self.follower.take_refused()
        for m, reason in refused:
            where = self._where.get((manifest_key(m), m.signature or b""), (-1, -1))
            out.append(DeadLetter(source_topic=self.topic, partition=where[0], offset=where[1],
                                  component_id=component_id, error=f"refused: {reason}",
                                  raw=self.codec.encode(m, self.topic)))
        return out

    def _observe(self, _key: Any, _old: WeightManifest | None, new: WeightManifest | None) -> None:
        if new is not None:
            self.follower.observe(new)
            self.manifests_seen += 1
            self._failed_target = None  # new manifests: a failed target may be reachable

    def poll(self, timeout: float = 0.0) -> int:
        """Read manifests that arrived; returns how many were new."""
        with self._lock:
            return self.manifests.poll(timeout)

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Read what the topic holds now (bounded by ``timeout_s``), then refresh."""
        with self._lock:
            self.manifests.catch_up(timeout_s)
            self.refresh(poll=False)

    def _fetch(self, floor: int) -> Any:
        """With the lock held: bring the follower to the newest known version if that is
        above ``floor``; its ``UpdateResult`` (None: nothing newer, or not reachable now)."""
        target = self.follower.latest_version
        if target is None or target <= floor or target == self._failed_target:
            return None
        from astraflow.weights import NoPlanError, WeightsError

        if not self._offered_own:
            self._offer_own_weights()
        try:
            result = self.follower.update_reachable(target)
        except (NoPlanError, WeightsError) as e:
            log.warning("%s: cannot reach version %s nor an older one after %s: %s",
                        self.topic, target, floor, e)
            self._failed_target = target
            return None
        except KafkaException as e:  # the broker is away: rollouts go on, retried later
            log.debug("%s: version %s not fetched yet: %s", self.topic, target, e)
            return None
        if result.version is None or result.version <= floor:
            self._failed_target = target
            return None
        return result

    def refresh(self, poll: bool = True) -> bool:
        """Bring the engine to the newest known version; True if its weights changed."""
        with self._lock:
            if poll:
                self.manifests.poll(0.0)
            t0 = time.perf_counter()
            result = self._fetch(self.engine.version)
            # the follower may hold a newer version than the engine without this call
            # having fetched it (the prefetch thread did)
            held = self.follower.version
            if held is None or held <= self.engine.version or self.follower.state is None:
                return False
            self.engine.load_state_dict(self.follower.state, held)
            self.updates += 1
            self.last_update_s = time.perf_counter() - t0
            self.update_s += self.last_update_s
            log.info(
                "%s: engine now at version %s (%d manifests, %d bytes, %.2fs)",
                self.topic,
                self.engine.version,
                len(result.applied) if result is not None else 0,
                result.bytes_fetched if result is not None else 0,
                self.last_update_s,
            )
            return True

    # --- in-flight updates -------------------------------------------------------------
    def start_prefetch(self, interval_s: float = 0.05) -> None:
        """Fetch new versions in a thread every ``interval_s`` while the engine generates
        (``take_ready`` hands them over); idempotent."""
        if self._prefetcher is not None:
            return
        self._prefetcher = threading.Thread(target=self._prefetch_loop, args=(interval_s,),
                                            name=f"prefetch-{self.engine.policy}", daemon=True)
        self._prefetcher.start()

    def _prefetch_loop(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.prefetch()
            except Exception:  # noqa: BLE001 - the thread lives on; refresh reports it too
                log.exception("%s: prefetch failed", self.topic)

    def prefetch(self) -> bool:
        """Read new manifests and fetch the newest version into the follower (not into
        the engine); True if the follower moved."""
        with self._lock:
            self.manifests.poll(0.0)
            held = self.follower.version
            t0 = time.perf_counter()
            result = self._fetch(max(self.engine.version,
                                     held if held is not None else -1))
            if result is None:
                return False
            self.prefetches += 1
            self.update_s += time.perf_counter() - t0
            log.debug("%s: version %s fetched ahead (%d manifests, %d bytes)", self.topic,
                      result.version, len(result.applied), result.bytes_fetched)
            return True

    def take_ready(self, current: int, load: LoadWeights) -> int | None:
        """``InflightWeights.take_ready``: the fetched version, if newer than ``current``
        and no fetch is writing it now, through ``load``; never waits."""
        if not self._lock.acquire(blocking=False):
            return None  # a fetch is writing the follower's copy: the next chunk asks again
        try:
            v = self.follower.version
            if (v is None or v <= current or self.follower.state is None
                    or v == self._refused_inflight):
                return None
            t0 = time.perf_counter()
            try:
                load(self.follower.state, v)
            except ValueError as e:  # the engine kept its weights; not offered again here
                log.warning("%s: version %s refused by the engine mid-generation: %s",
                            self.topic, v, e)
                self._refused_inflight = v
                return None
            self.updates += 1
            self.inflight_updates += 1
            self.last_update_s = time.perf_counter() - t0
            self.update_s += self.last_update_s
            log.info("%s: engine now at version %s inside a generation (%.3fs)", self.topic,
                     v, self.last_update_s)
            return v
        finally:
            self._lock.release()

    def _offer_own_weights(self) -> None:
        """Before the first update: an engine still on the weights it loaded from disk
        (version 0) gives the follower a copy, which it keeps as version 0 if version 0's
        manifest vouches for it (``WeightFollower.adopt``): no full checkpoint fetched."""
        self._offered_own = True
        own = getattr(self.engine, "state_dict", None)  # engines holding torch weights
        if own is None or self.engine.version != 0 or self.follower.version is not None:
            return
        t0 = time.perf_counter()
        if self.follower.adopt(own(), 0):
            log.info("%s: the engine's own weights are version 0 (its digest matches, "
                     "%.2fs): only deltas are fetched", self.topic, time.perf_counter() - t0)
        else:
            log.info("%s: version 0 does not vouch for the engine's own weights (no digest "
                     "or another one): fetching a full checkpoint", self.topic)

    def close(self) -> None:
        self._stop.set()
        if self._prefetcher is not None:
            self._prefetcher.join(30)
        with self._lock:
            self.manifests.close()
            self.follower.close()


class FollowingEngine:
    """An engine that refreshes its weights (``WeightWatcher.refresh``) before each
    generation; everything else is delegated."""

    def __init__(self, engine: Engine, watcher: WeightWatcher):
        self._engine = engine
        self._watcher = watcher

    def generate(self, prompts, params):
        self._watcher.refresh()
        return self._engine.generate(prompts, params)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


__all__ = ["FollowingEngine", "WeightWatcher"]
