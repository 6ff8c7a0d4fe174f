"""The one transactional loop every component runs: consume -> work -> produce + commit.

Processors, RaaS nodes and trainers differ only in their ``Work``: what they make of the
records they consumed. The loop owns everything else, once: the clients, the consumer
group, a graceful stop, the status record, and surviving broker outages. It is made of
objects of one concern each, which it drives round by round:

- ``Intake`` (``consuming.py``): how many records a round takes and whether it waits for
  them, and the positions (next offsets to commit) of the partitions read;
- ``Pauses`` (``pausing.py``): the paused topics and partitions, asked for from any thread
  and applied to the consumer before each poll and after each rebalance;
- ``Checkpoint`` and ``CommitPolicy`` (``checkpoint.py``): the records of one transaction
  and the inputs they were made of, and when it is due to commit;
- ``Transactions`` (``transactions.py``): the transactional producer, the open transaction,
  its commit (waited for or in flight) with the consumer offsets
  (``send_offsets_to_transaction``), and what a failed one leaves to do;
- ``GroupMember`` (``membership.py``): the consumer and its group: joining, rebalances,
  rewinding to the committed offsets, a new member when those cannot be read.

Records become one transaction per poll, or (``LoopSpec.commit_interval_s``, processors) a
transaction stays open over several polls and commits when it is full, old enough, or a poll
finds nothing more; its records go to the broker as they are made, and the next ones are
made while the broker completes the commit (a commit in flight, settled before anything
else touches the transaction, the group or the offsets).

A transaction that fails is aborted. A work that can start over (processors, RaaS nodes)
drops what it holds and rewinds to the group's committed offsets; a work whose state has
moved on and cannot be undone (the trainer, ``keeps_position``) sends the same checkpoint
again in a new transaction. Either way each input is committed once with its outputs.

While the broker is away every call is retried; the loop logs one line per
``outage_log_interval_s`` and gives up with ``BrokerUnreachable`` after ``outage_limit_s``
(both in ``KafkaConfig``). A stop requested during an outage ends the loop without a
commit: the open transaction is aborted by the broker or by the next instance.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from astraflow.kafka.access import refusal
from astraflow.kafka.checkpoint import Checkpoint, CommitPolicy, RecordTooLarge
from astraflow.kafka.clients import RecordProducer, make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.consuming import Intake
from astraflow.kafka.membership import GroupMember, NoAnswer
from astraflow.kafka.outage import BrokerUnreachable, Outage, kafka_error, transient
from astraflow.kafka.pausing import Pauses
from astraflow.kafka.spec import LoopSpec, RuntimeCounters
from astraflow.kafka.topics import MissingTopicsError, missing_topics
from astraflow.kafka.transactions import Transactions
from astraflow.metrics import PrometheusExporter, exporter_from_env
from astraflow.wire.codec import Codec
from astraflow.wire.records import ComponentStatus

log = logging.getLogger("astraflow.loop")


class _Stopping(Exception):
    """A stop was requested while a call waited for the broker."""


class Work(Protocol):
    """What a component does inside the loop."""

    counters: RuntimeCounters

    def start(self, loop: TransactionalLoop) -> None:
        """After the producer fenced predecessors, before the consumer joins the group."""

    def handle(self, msgs: list[Message], cp: Checkpoint) -> None:
        """Make outputs (and dead letters) of ``msgs`` (may be empty: timers) into ``cp``."""

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        """Drop what is held for these partitions: their records will be consumed again."""

    def held_offsets(self) -> dict[tuple[str, int], int]:
        """Per partition, the first offset still held (not to be committed past)."""

    def status(self) -> ComponentStatus: ...

    def close(self) -> None: ...


class TransactionalLoop:
    """Runs ``work`` against Kafka until ``stop()``: one transaction per non-empty round."""

    def __init__(self, spec: LoopSpec, work: Work, config: KafkaConfig, codec: Codec,
                 before_commit: Callable[[Checkpoint], None] | None = None):
        self.spec = spec
        self.work = work
        self.config = config
        self.codec = codec
        self.counters = work.counters
        self.outage = Outage(spec.component_id, config.bootstrap_servers or "?",
                             config.outage_limit_s, config.outage_log_interval_s)
        self.running = threading.Event()
        self._stop = threading.Event()
        self.intake = Intake(spec, self._on_read_error)
        self.pauses = Pauses()
        self.policy = CommitPolicy(spec.max_batch, spec.commit_interval_s)
        self.txn = Transactions(spec, config, codec, self.counters, self.outage,
                                self._retrying, self._on_client_error,
                                lambda tps: self.member.committed_anyway(tps), before_commit)
        self.member = GroupMember(spec, config, work, self.intake, self.pauses, self._retrying,
                                  lambda: self._call_timeout_s, self._on_client_error,
                                  self.txn.wait)
        # a work that starts over after an abort may have its next records made while the
        # broker completes a commit (a work that keeps its position waits for each one)
        self._pipelined = spec.commit_interval_s is not None and not spec.keeps_position
        self.exporter: PrometheusExporter | None = None  # $ASTRAFLOW_METRICS_PORT

    @property
    def positions(self) -> dict[tuple[str, int], int]:
        """Per input partition, the next offset to commit (``Intake.positions``)."""
        return self.intake.positions

    @property
    def consumer(self) -> Consumer | None:
        """The group member's consumer (``GroupMember.consumer``)."""
        return self.member.consumer

    @property
    def producer(self) -> RecordProducer | None:
        """The transactional producer (``Transactions.producer``)."""
        return self.txn.producer

    @property
    def paused(self) -> dict[str, set[int] | None]:
        """Paused input topics (full names) -> partitions (None: all)."""
        return self.pauses.paused

    @property
    def _call_timeout_s(self) -> float:
        """How long one call to the broker may take (producer and consumer alike)."""
        return self.txn.call_timeout_s

    @_call_timeout_s.setter
    def _call_timeout_s(self, seconds: float) -> None:
        self.txn.call_timeout_s = seconds

    # --- control, callable from any thread -------------------------------------------
    def stop(self) -> None:
        """Finish the open transaction, leave the group and return from ``run``."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self, topic: str, partitions: list[int] | None = None) -> None:
        """Stop fetching from ``topic`` (full name), all or some partitions."""
        self.pauses.pause(topic, partitions)

    def resume(self, topic: str, partitions: list[int] | None = None) -> None:
        self.pauses.resume(topic, partitions)

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.codec, self.spec.dlq, self.spec.max_bytes)

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        s = self.spec
        self._check_topics()
        self.txn.start()
        # a bad or busy $ASTRAFLOW_METRICS_PORT fails here, at start; the series appear
        # with the first status (which names the component's kind)
        self.exporter = exporter_from_env(s.component_id, None, self.counters)
        try:
            self.work.start(self)
            self.member.join()
            log.info("%s: consuming %s as group %s, transactional id %s", s.component_id,
                     ", ".join(s.inputs), s.group, s.transactional_id)
            self.running.set()
            self._rounds()
        except _Stopping:
            log.warning("%s: stopped while Kafka was away; nothing uncommitted was kept",
                        s.component_id)
        finally:
            self.running.clear()
            log.info("%s: leaving group %s", s.component_id, s.group)
            self.member.close()
            self.txn.close()
            if self.exporter is not None:
                self.exporter.close()
            self.work.close()

    def _rounds(self) -> None:
        last_status = 0.0
        cp = self.checkpoint()  # the open checkpoint
        while not self._stop.is_set():
            self.pauses.apply(self.consumer)
            t0 = time.monotonic()
            self.member.revoked = False  # set by a revocation during this round's poll
            if self.txn.finished() and not self._settle():  # aborted: the inputs come again
                cp = self.checkpoint()
            msgs = self._consume(self.spec.max_batch - cp.inputs, wait=cp.first_at is None)
            t1 = time.monotonic()
            if self.member.revoked and self._pipelined and (cp.first_at is not None or msgs):
                # the open checkpoint, or records polled before the revocation in this
                # round, may be of partitions that went to another member: none of it may
                # commit, and every partition goes back to its committed offset
                self._drop_open()
                cp = self.checkpoint()
                continue
            if not self._handle(msgs, cp):
                cp = self.checkpoint()
                continue
            now = time.monotonic()
            if msgs:
                self.counters.busy_s += now - t1
                cp.took(len(msgs), t1)
            else:
                self.counters.waiting_s += t1 - t0
            status_due = now - last_status >= self.spec.status_interval_s
            if not status_due and not self.policy.due(cp, bool(msgs), now):
                if cp:
                    self.txn.send_early(cp)
                continue
            if self._pipelined and not status_due:
                self._commit_in_flight(cp)
            else:
                self.commit(cp, status=status_due)
            cp = self.checkpoint()
            if status_due:
                last_status = time.monotonic()
        self.commit(cp, status=True)  # what is open, and a last status: the final state

    def _handle(self, msgs: list[Message], cp: Checkpoint) -> bool:
        """``work.handle``; False when a side read of a work that can start over hit a
        broker outage (the round is dropped and the inputs consumed again)."""
        try:
            self.work.handle(msgs, cp)
            return True
        except KafkaException as e:
            err = kafka_error(e)
            if self.spec.keeps_position or not transient(err):
                raise
            self.outage.failed(f"handling records: {err.str()}")
            self._settle()
            self.txn.forsake_open()  # its records go with the round: the next producer fences it
            self._rewind()
            return False

    def _consume(self, limit: int, wait: bool) -> list[Message]:
        """Up to ``limit`` records (``Intake.take``), the producer's events served first."""
        self.txn.serve()
        got = self.intake.take(self.consumer, limit, wait, self.txn.inflight is not None,
                               self._settle)
        self.counters.consumed += len(got)
        return got

    def _on_read_error(self, err: KafkaError, topic: str | None) -> None:
        """An error the consumer handed out in place of a record."""
        self._refuse_read(err, topic)
        self._on_client_error(err)

    def _refuse_read(self, err: KafkaError, topic: str | None) -> None:
        """Stop on a denied read (no retrying): one line naming the principal, the
        operation and the resource."""
        group = err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED
        resource = f"group {self.spec.group}" if group else (
            f"topic {topic}" if topic else f"one of topics {', '.join(self.spec.inputs)}")
        denied = refusal(err, self.config.principal(), "READ", resource)
        if denied is not None:
            raise denied

    def _on_client_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
            self._refuse_read(err, None)  # raises out of the consume that served it
        if transient(err):
            self.txn.tainted = True
            self.outage.failed(err.str())
        else:
            log.warning("%s: Kafka client error: %s", self.spec.component_id, err)

    # --- transactions ------------------------------------------------------------------
    def commit(self, cp: Checkpoint, status: bool = False, offsets: bool = True) -> None:
        """Commit ``cp`` (plus a status record, plus the consumed offsets) in one
        transaction; after an abort, rewind (or, ``keeps_position``, send it again)."""
        if not self._settle():  # the commit in flight was aborted: cp's inputs come again
            cp = self.checkpoint()

        def tps() -> list[TopicPartition]:
            return self._offsets() if offsets and self.consumer is not None else []

        while True:
            if self.txn.attempt(cp, tps, self._produce_status if status else None,
                                self.member.group_metadata):
                return
            self.counters.aborted += 1
            if not self.spec.keeps_position:
                self._rewind()
                return
            self.member.serve()  # e.g. "unknown member": rejoin before sending it again

    def _produce_status(self) -> None:
        """The work's status record, into the open transaction (and to the exporter)."""
        st = self.work.status()
        self.txn.producer.produce(self.spec.status_topic, st, st.component_id)
        self._export(st)

    def _commit_in_flight(self, cp: Checkpoint) -> None:
        """Commit ``cp`` while the loop goes on (``Transactions.start_commit``), once the
        commit before it is settled; rewind if it was aborted."""
        if not self._settle():
            return  # the previous one was aborted: cp's inputs come again
        if not self.txn.start_commit(cp, self._offsets, self.member.group_metadata):
            self.counters.aborted += 1
            self._rewind()

    def _settle(self) -> bool:
        """Wait for the commit in flight, if any, and take its outcome; False when it was
        aborted (the loop then rewound: what was consumed since comes again)."""
        if self.txn.settle():
            return True
        self.counters.aborted += 1
        self._rewind()
        return False

    def _drop_open(self) -> None:
        """Abort the open transaction (what was sent of it) and go back to the committed
        offsets of every partition: the round's records and held state are dropped."""
        log.info("%s: dropping what is uncommitted after a rebalance",
                 self.spec.component_id)
        self._settle()
        self.txn.abort_open()
        self._rewind()

    def _export(self, status: ComponentStatus) -> None:
        """Hand ``status`` and the lag to the Prometheus exporter; never fails the caller."""
        if self.exporter is None:
            return
        try:
            self.exporter.update(status, self.lag())
        except Exception as e:  # noqa: BLE001 - metrics must not fail a transaction
            log.warning("%s: metrics not updated: %s", self.spec.component_id, e)

    def lag(self) -> dict[tuple[str, int], int]:
        """Records behind the end of each assigned input partition (``GroupMember.lag``)."""
        return self.member.lag()

    def read_positions(self) -> dict[tuple[str, int], int]:
        """Per assigned input partition, the offset the consumer reads next
        (``GroupMember.read_positions``); callable from any thread."""
        return self.member.read_positions()

    def _offsets(self) -> list[TopicPartition]:
        return self.intake.offsets(self.work.held_offsets())

    def _rewind(self) -> None:
        """After an abort: the commit in flight settled (the offsets must be final), then
        held state dropped and back to the committed offsets (``GroupMember.rewind``)."""
        self._settle()
        self.member.rewind()

    def _retrying(self, what: str, call: Callable[[], object], tries: int | None = None):
        """``call()``, again while Kafka is away (up to the outage limit); with ``tries``,
        ``NoAnswer`` after that many transient failures."""
        for attempt in itertools.count(1):
            try:
                return call()
            except KafkaException as e:
                err = kafka_error(e)
                if not transient(err) or err.txn_requires_abort() or self.txn.stuck:
                    raise
                self.outage.failed(f"{what}: {err.str()}")
                if self._stop.is_set():
                    raise _Stopping() from e
                if tries is not None and attempt >= tries:
                    raise NoAnswer(f"{what}: {err.str()}") from e

    def _check_topics(self) -> None:
        s = self.spec
        needed = list(dict.fromkeys([*s.inputs, *s.outputs, s.dlq, s.status_topic]))
        admin = make_admin(self.config)
        missing = self._retrying("listing topics", lambda: missing_topics(admin, needed))
        if missing:
            self._refuse_unseen(admin, missing)
            raise MissingTopicsError(
                f"topics missing on {self.config.bootstrap_servers}: "
                f"{', '.join(missing)}; create them with `astraflow topics apply "
                f"{s.topology_source}`")

    def _refuse_unseen(self, admin, topics: list[str]) -> None:
        """A topic the principal may not even DESCRIBE is hidden from the topic list:
        asked for by name, the broker says so, and the loop stops naming it."""
        if not self.config.security.with_env().enabled:
            return
        for topic in topics:
            md = admin.list_topics(topic, timeout=10).topics.get(topic)
            denied = refusal(md.error if md is not None else None, self.config.principal(),
                             "DESCRIBE", f"topic {topic}")
            if denied is not None:
                raise denied


__all__ = [
    "BrokerUnreachable",
    "Checkpoint",
    "LoopSpec",
    "Outage",
    "RecordTooLarge",
    "RuntimeCounters",
    "TransactionalLoop",
    "Work",
    "kafka_error",
    "transient",
]
