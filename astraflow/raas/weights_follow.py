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
"""

from __future__ import annotations

import logging
import time
from typing import Any

from confluent_kafka import KafkaException

from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.table import TopicTable
from astraflow.raas.engine import Engine
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

    def _key(self, entry: Any) -> Any:
        """The table key of a manifest (its identity); its place is noted when verifying."""
        from astraflow.weights.history import manifest_key

        m = entry.value
        if m is None:
            return None
        if self.follower.verifier is not None:
            self._where[(manifest_key(m), m.signature or b"")] = (entry.partition, entry.offset)
        return manifest_key(m)

    def dead_letters(self, component_id: str) -> list[DeadLetter]:
        """A ``DeadLetter`` for each manifest refused since the last call, with the reason."""
        from astraflow.weights.history import manifest_key

        out = []
        for m, reason in self.follower.take_refused():
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
        return self.manifests.poll(timeout)

    def catch_up(self, timeout_s: float = 10.0) -> None:
        """Read what the topic holds now (bounded by ``timeout_s``), then refresh."""
        self.manifests.catch_up(timeout_s)
        self.refresh(poll=False)

    def refresh(self, poll: bool = True) -> bool:
        """Bring the engine to the newest known version; True if its weights changed."""
        if poll:
            self.poll(0.0)
        target = self.follower.latest_version
        if target is None or target <= self.engine.version or target == self._failed_target:
            return False
        from astraflow.weights import NoPlanError, WeightsError

        t0 = time.perf_counter()
        if not self._offered_own:
            self._offer_own_weights()
        try:
            result = self.follower.update_reachable(target)
        except (NoPlanError, WeightsError) as e:
            log.warning("%s: cannot reach version %s nor an older one after %s: %s",
                        self.topic, target, self.engine.version, e)
            self._failed_target = target
            return False
        except KafkaException as e:  # the broker is away: rollouts go on, retried later
            log.debug("%s: version %s not fetched yet: %s", self.topic, target, e)
            return False
        if result.version is None or result.version <= self.engine.version:
            self._failed_target = target
            return False
        assert self.follower.state is not None
        self.engine.load_state_dict(self.follower.state, result.version or target)
        self.updates += 1
        self.last_update_s = time.perf_counter() - t0
        self.update_s += self.last_update_s
        log.info(
            "%s: engine now at version %s (%d manifests, %d bytes, %.2fs)",
            self.topic,
            self.engine.version,
            len(result.applied),
            result.bytes_fetched,
            self.last_update_s,
        )
        return True

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
