"""The transactional loop's membership of its consumer group (one concern of
``astraflow.kafka.loop.TransactionalLoop``).

``GroupMember`` holds the loop's consumer and everything the group asks of it:

- ``join``: the consumer, subscribed to the spec's inputs, with the loop's handling of
  rebalances (``on_assign``, ``on_revoke``: a revocation waits for the commit in flight,
  so its offsets commit before the partitions move on);
- ``serve``: rejoin the group (rebalance callbacks run inside a poll) without taking
  records;
- ``rewind``: after an abort, every assigned partition back to the group's committed
  offset, the work's held state dropped;
- ``renew``: a consumer that cannot read those offsets while the broker answers is
  replaced by a new member;
- what the consumer alone knows: ``committed_anyway`` (whether a commit whose answer was
  lost went through), ``lag`` and ``read_positions``.

Calls to the broker go through the loop's ``retrying`` (which survives outages and knows
when to stop); the loop settles its commit in flight before it asks for a rewind.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.consuming import Intake
from astraflow.kafka.pausing import Pauses
from astraflow.kafka.spec import LoopSpec
from astraflow.kafka.transactions import Worker

log = logging.getLogger("astraflow.loop")

# reads of the group's committed offsets a rewind tries before it asks whether the broker
# answers at all, and if it does gives the consumer up for a new one (each read waits up to
# the call timeout): a CI run saw a processor's consumer time out on every read for 300 s
# after the broker came back, while its new producer and every other component worked on,
# and the process restarted past the outage limit read them at once
REWIND_TRIES = 3


class NoAnswer(Exception):
    """A call to the broker failed transiently as many times as it was allowed."""


class Revocable(Protocol):
    """What the member asks of the work: to drop what it holds of revoked partitions."""

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None: ...


Retrying = Callable[..., Any]  # the loop's ``_retrying(what, call, tries=None)``


class GroupMember:
    """See the module docstring. ``timeout_s()``: how long one call to the broker may take
    now; ``before_revoke``: waits for the commit in flight; ``on_client_error``: the
    consumer's error callback."""

    def __init__(self, spec: LoopSpec, config: KafkaConfig, work: Revocable, intake: Intake,
                 pauses: Pauses, retrying: Retrying, timeout_s: Callable[[], float],
                 on_client_error: Callable[[KafkaError], None],
                 before_revoke: Callable[[], None]):
        self.spec, self.config, self.work = spec, config, work
        self.intake, self.pauses = intake, pauses
        self._retrying, self._timeout_s = retrying, timeout_s
        self._on_client_error, self._before_revoke = on_client_error, before_revoke
        self.consumer: Consumer | None = None
        self.revoked = False  # partitions were revoked since the loop last cleared it

    # --- the consumer ---------------------------------------------------------------
    def join(self) -> None:
        """Join the group: a consumer of the spec's inputs (``_subscribed``)."""
        self.consumer = self._subscribed()

    def _subscribed(self) -> Consumer:
        """A consumer with the spec's inputs subscribed and rebalances served here."""
        s = self.spec
        consumer = Consumer(self.config.consumer_conf(
            s.group, error_cb=self._on_client_error, **s.consumer_options))
        consumer.subscribe(s.inputs, on_assign=self.on_assign, on_revoke=self.on_revoke,
                           on_lost=self.on_revoke)
        return consumer

    def close(self) -> None:
        """Leave the group."""
        if self.consumer is not None:
            self.consumer.close()

    def renew(self, why: str) -> None:
        """Replace a consumer that cannot read the group's committed offsets, after a
        rewind dropped what it held: the new member starts each partition it is assigned
        at the committed offset, which librdkafka fetches itself for as long as that takes
        (an outage is seen by the clients' error callbacks meanwhile). The old one leaves
        the group on a helper thread, given up after a few call timeouts."""
        log.warning("%s: starting a new consumer (%s)", self.spec.component_id, why)
        old, self.consumer = self.consumer, None
        closer = Worker("kafka-close")
        done, _ = closer.submit(old.close)
        if not done.wait(self._timeout_s() * 3):
            log.warning("%s: the old consumer did not close; left behind",
                        self.spec.component_id)
        closer.close()
        self.intake.positions.clear()  # whatever its revocation left: nothing is consumed yet
        self.join()
        self.pauses.assignment_changed()

    # --- rebalances (run on the loop's thread, inside consume) ----------------------
    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.pauses.assignment_changed()
        if self.spec.keeps_position:
            for tp in partitions:
                pos = self.intake.positions.get((tp.topic, tp.partition))
                if pos is not None:
                    tp.offset = pos
            consumer.assign(partitions)
        log.info("%s: assigned %s", self.spec.component_id,
                 ", ".join(f"{p.topic}[{p.partition}]" + (f"@{p.offset}" if p.offset >= 0 else "")
                           for p in partitions))

    def on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self.pauses.assignment_changed()
        self.revoked = True
        self._before_revoke()  # the commit in flight commits before the partitions move on
        log.info("%s: revoked %s", self.spec.component_id,
                 ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))
        if self.spec.keeps_position:
            return
        self.work.on_revoke([(p.topic, p.partition) for p in partitions])
        self.intake.forget((p.topic, p.partition) for p in partitions)

    def serve(self) -> None:
        """Let the consumer rejoin its group (rebalance callbacks run inside ``consume``)
        without taking records: every partition is paused meanwhile, and a record that
        slips through is sought back to."""
        if self.consumer is None:
            return
        assigned = self.consumer.assignment()
        if assigned:
            self.consumer.pause(assigned)
        first: dict[tuple[str, int], int] = {}
        for m in self.consumer.consume(100, 1.0):
            if m.error() is None:
                first.setdefault((m.topic(), m.partition()), m.offset())
        for (topic, part), off in first.items():
            self.consumer.seek(TopicPartition(topic, part, off))
        self.pauses.assignment_changed()  # the next round resumes what is not paused

    # --- the group's committed offsets ----------------------------------------------
    def rewind(self) -> None:
        """After an abort (the loop settled its commit in flight first): drop held state
        and go back to the committed offsets."""
        assigned = self.consumer.assignment()
        self.work.on_revoke([(tp.topic, tp.partition) for tp in assigned])
        self.intake.positions.clear()
        committed = self.committed(assigned)
        if committed is None:
            return  # a new consumer: its assignment starts at the committed offsets
        for tp in committed:
            if tp.offset < 0:
                tp = TopicPartition(tp.topic, tp.partition, -2)  # earliest
            try:
                self.consumer.seek(tp)
            except KafkaException as e:  # revoked meanwhile: the next owner starts there
                log.debug("%s: no seek on %s[%d]: %s", self.spec.component_id, tp.topic,
                          tp.partition, e)

    def committed(self, tps: list[TopicPartition]) -> list[TopicPartition] | None:
        """The group's committed offsets of ``tps``, read again while Kafka is away; None
        when the broker answers a metadata request, then one read more times out too: the
        consumer was replaced (``renew``)."""
        tries, answers = REWIND_TRIES, False
        while True:
            try:
                return self._retrying("reading committed offsets", lambda: (
                    self.consumer.committed(tps, timeout=self._timeout_s())), tries=tries)
            except NoAnswer as e:
                if answers:  # only the group's offsets do not come
                    self.renew(str(e))
                    return None
                answers = self.broker_answers()
                tries = 1 if answers else REWIND_TRIES

    def broker_answers(self) -> bool:
        """Whether a broker answers the consumer's metadata request for its inputs."""
        try:
            self.consumer.list_topics(self.spec.inputs[0], timeout=self._timeout_s())
        except KafkaException:
            return False
        return True

    def committed_anyway(self, tps: list[TopicPartition]) -> bool:
        """Whether a commit whose answer was lost went through: the group's committed
        offsets are the ones it carried (no one else commits for these partitions)."""
        if not tps:
            return False
        committed = self._retrying("reading committed offsets", lambda: self.consumer.committed(
            [TopicPartition(t.topic, t.partition) for t in tps], timeout=self._timeout_s()))
        mine = {(t.topic, t.partition): t.offset for t in tps}
        done = all(mine.get((t.topic, t.partition)) == t.offset for t in committed)
        if done:
            log.warning("%s: the commit whose answer was lost went through",
                        self.spec.component_id)
        return done

    def group_metadata(self, tps: Iterable[TopicPartition]) -> object | None:
        """The group's metadata for a transaction that commits offsets (None: it commits
        none). On the loop's thread only: elsewhere it would wait for a rebalance callback
        that may itself wait for the commit in flight."""
        return self.consumer.consumer_group_metadata() if tps else None

    # --- what the consumer knows ----------------------------------------------------
    def lag(self) -> dict[tuple[str, int], int]:
        """Records behind the end of each assigned input partition, from the consumer's
        own view (the high watermarks of its last fetches): no call to the broker."""
        if self.consumer is None:
            return {}
        out = {}
        try:
            for tp in self.consumer.position(self.consumer.assignment()):
                low, high = self.consumer.get_watermark_offsets(tp, cached=True)
                if high < 0:  # not fetched yet: the consumer does not know
                    continue
                # nothing consumed from it yet: behind by all it holds
                pos = tp.offset if tp.offset >= 0 else max(low, 0)
                out[(tp.topic, tp.partition)] = max(0, high - pos)
        except (KafkaException, RuntimeError):  # not known right now (or closed meanwhile):
            return {}  # no figure rather than a failed commit
        return out

    def read_positions(self) -> dict[tuple[str, int], int]:
        """Per assigned input partition, the offset the consumer reads next: past the last
        record handed to the work and past the transaction markers after it (-1: nothing
        read yet). Callable from any thread; empty before the first assignment."""
        if self.consumer is None:
            return {}
        try:
            return {(tp.topic, tp.partition): max(tp.offset, -1)
                    for tp in self.consumer.position(self.consumer.assignment())}
        except (KafkaException, RuntimeError):  # closed meanwhile: nothing known
            return {}


__all__ = ["GroupMember", "NoAnswer", "REWIND_TRIES", "Revocable"]
