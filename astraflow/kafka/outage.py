"""Broker outages as the loop lives through them: which Kafka errors are transient, and
``Outage``, which counts how long the broker has been away and gives up (with
``BrokerUnreachable``) past the limit."""

from __future__ import annotations

import logging
import time

from confluent_kafka import KafkaError

from astraflow.errors import AstraflowError

log = logging.getLogger("astraflow.loop")

# errors that say "the broker (or its coordinator) is not answering right now"
_TRANSIENT = {
    KafkaError._TRANSPORT,
    KafkaError._ALL_BROKERS_DOWN,
    KafkaError._TIMED_OUT,
    KafkaError._MSG_TIMED_OUT,
    KafkaError._RESOLVE,
    KafkaError.REQUEST_TIMED_OUT,
    KafkaError.COORDINATOR_NOT_AVAILABLE,
    KafkaError.NOT_COORDINATOR,
    KafkaError.COORDINATOR_LOAD_IN_PROGRESS,
    KafkaError.NOT_ENOUGH_REPLICAS,
    KafkaError.LEADER_NOT_AVAILABLE,
    KafkaError.NOT_LEADER_FOR_PARTITION,
    # a request in flight to a broker that left the cluster's metadata (a node of a
    # cluster shut down): asked again, it goes to the partition's new leader
    KafkaError._DESTROY_BROKER,
}


class BrokerUnreachable(AstraflowError):
    """Kafka did not answer for longer than the outage limit."""


# While Kafka is away a component fails at least every few seconds: its calls time out
# within their call timeout (10 s), a processor commits its status every few seconds, and
# librdkafka reports each reconnect attempt (at most 10 s apart). A failure after a longer
# quiet spell is a new outage: the previous one ended without a call seeing it end.
QUIET_S = 60.0


class Outage:
    """Tracks how long Kafka has not answered; logs once per interval, gives up past the
    limit."""

    def __init__(self, component_id: str, bootstrap: str, limit_s: float, interval_s: float,
                 quiet_s: float = QUIET_S):
        self.component_id = component_id
        self.bootstrap = bootstrap
        self.limit_s = limit_s
        self.interval_s = interval_s
        self.quiet_s = quiet_s
        self.since: float | None = None
        self.last_failed = 0.0
        self.last_log = 0.0
        self.ended_at = 0.0
        self.longest_s = 0.0

    def failed(self, what: str) -> None:
        now = time.monotonic()
        if self.since is not None and now - self.last_failed > self.quiet_s:
            # e.g. a stale "connection refused" reported just after the broker came back,
            # then a long rebalance whose transactions the broker answered with aborts
            log.info("%s: no failure for %.0fs: Kafka answered meanwhile", self.component_id,
                     now - self.last_failed)
            self.ok(at=self.last_failed)
        self.last_failed = now
        if self.since is None:
            self.since = self.last_log = now
            log.warning("%s: Kafka at %s is not answering (%s); retrying for up to %.0fs "
                        "(kafka.outage_limit_s)", self.component_id, self.bootstrap, what,
                        self.limit_s)
            return
        down = now - self.since
        if down > self.limit_s:
            raise BrokerUnreachable(
                f"{self.component_id}: Kafka at {self.bootstrap} has not answered for "
                f"{down:.0f}s, over kafka.outage_limit_s={self.limit_s:.0f} (last: {what}); "
                f"nothing uncommitted was kept, a restart resumes from the committed offsets"
            )
        if now - self.last_log >= self.interval_s:
            self.last_log = now
            log.warning("%s: Kafka at %s not answering for %.0fs (%s); giving up after %.0fs",
                        self.component_id, self.bootstrap, down, what, self.limit_s)

    def ok(self, at: float | None = None) -> None:
        """Kafka answered (at ``at``, default now): the outage, if any, is over."""
        if self.since is None:
            return
        self.ended_at = time.monotonic() if at is None else at
        down = self.ended_at - self.since
        self.longest_s = max(self.longest_s, down)
        log.warning("%s: Kafka at %s answers again after %.1fs", self.component_id,
                    self.bootstrap, down)
        self.since = None

    def recent(self, within_s: float = 600.0) -> bool:
        """Whether Kafka is away now or was within ``within_s``."""
        return self.since is not None or time.monotonic() - self.ended_at < within_s


def kafka_error(e: BaseException) -> KafkaError | None:
    arg = e.args[0] if e.args else None
    return arg if isinstance(arg, KafkaError) else None


def transient(err: KafkaError | None) -> bool:
    """Whether ``err`` says to wait for the broker and retry."""
    return err is not None and (err.code() in _TRANSIENT or bool(err.retriable()))
