"""The one transactional loop every component runs: consume -> work -> produce + commit.

Processors, RaaS nodes and trainers differ only in their ``Work``: what they make of the
records they consumed. The loop owns everything else, once: the clients, the consumer
group, pause/resume, the ``Checkpoint`` (the records of one transaction and the consumer
offsets committed with them, ``send_offsets_to_transaction``), the status record, a
graceful stop, and surviving broker outages.

Records become one transaction per poll, or (``LoopSpec.commit_interval_s``, processors) a
transaction stays open over several polls and commits when it is full, old enough, or a poll
finds nothing more; its records go to the broker as they are made, and the next ones are
made while the broker completes the commit (``_commit_in_flight``, settled before anything
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
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition

from astraflow.kafka.access import AUTHORIZATION, KafkaAccessError, refusal, without_write
from astraflow.kafka.checkpoint import Checkpoint, RecordTooLarge
from astraflow.kafka.clients import RecordProducer, make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.outage import BrokerUnreachable, Outage, kafka_error, transient
from astraflow.kafka.topics import MissingTopicsError, missing_topics
from astraflow.metrics import PrometheusExporter, exporter_from_env
from astraflow.wire.codec import Codec
from astraflow.wire.records import ComponentStatus, now_ms

log = logging.getLogger("astraflow.loop")


# the transactional producer's defaults (the config's producer_options win): a transaction
# that begins while the broker still completes the previous one gets CONCURRENT_TRANSACTIONS
# from AddPartitionsToTxn/AddOffsetsToTxn, retried after retry.backoff.ms (100 ms by
# default, doubling up to retry.backoff.max.ms): back-to-back transactions would pay it
# every time. Retries of requests only: reconnecting to a broker that is away keeps its own
# backoff.
_TXN_PRODUCER = {"retry.backoff.ms": 1, "retry.backoff.max.ms": 20}
# records handed to the work at a time while a transaction stays open: each such round's
# outputs go to the broker while the next round is made (commit_interval_s)
_CHUNK = 500
# reads of the group's committed offsets a rewind tries before it asks whether the broker
# answers at all, and if it does gives the consumer up for a new one (each read waits up to
# the call timeout): a CI run saw a processor's consumer time out on every read for 300 s
# after the broker came back, while its new producer and every other component worked on,
# and the process restarted past the outage limit read them at once
_REWIND_TRIES = 3


class _Stopping(Exception):
    """A stop was requested while a call waited for the broker."""


class _NoAnswer(Exception):
    """A call retried ``tries`` times without an answer (``_retrying``)."""


@dataclass
class RuntimeCounters:
    consumed: int = 0
    produced: int = 0
    dead_lettered: int = 0
    transactions: int = 0
    aborted: int = 0
    busy_s: float = 0.0
    waiting_s: float = 0.0
    started_at_ms: int = field(default_factory=now_ms)


@dataclass
class LoopSpec:
    """Who the loop runs as and what it reads and writes (full topic names)."""

    component_id: str
    group: str
    transactional_id: str
    inputs: list[str]
    outputs: list[str]
    dlq: str
    status_topic: str
    max_batch: int = 1  # inputs per transaction, at most
    poll_timeout_s: float = 0.5
    # None: each poll waits up to poll_timeout_s for max_batch records, and each poll's
    # records make one transaction. A number (in seconds): a poll returns as soon as records
    # arrive, and the transaction stays open across polls (its records sent to the broker
    # meanwhile) until it holds max_batch inputs, its first input is this old, or a poll
    # finds nothing more: low latency at light load, the commit's cost shared at high load.
    # Unless keeps_position, the next records are made while the broker completes a commit.
    commit_interval_s: float | None = None
    status_interval_s: float = 5.0
    consumer_options: dict[str, object] = field(default_factory=dict)
    producer_options: dict[str, object] = field(default_factory=dict)
    # the work's state has consumed up to its positions and cannot be rolled back: after an
    # abort the same checkpoint is sent again; after a rebalance it resumes at its positions
    keeps_position: bool = False
    max_bytes: dict[str, int] = field(default_factory=dict)  # topic -> max.message.bytes
    topology_source: str = "<topology>"


@dataclass
class _InFlight:
    """A commit running on a helper thread: its checkpoint, offsets and outcome."""

    cp: Checkpoint
    tps: list[TopicPartition]
    meta: object | None  # the consumer's group metadata, taken on the loop's thread
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class _Worker:
    """One long-lived thread that runs the calls handed to it, in turn: a transaction's
    calls leave the loop's thread without a thread started per call."""

    def __init__(self, name: str):
        self._calls: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._serve, daemon=True, name=name).start()

    def _serve(self) -> None:
        while (item := self._calls.get()) is not None:
            call, box, done = item
            try:
                box["value"] = call()
            except BaseException as e:  # noqa: BLE001 - handed to the caller's thread
                box["error"] = e
            done.set()

    def submit(self, call: Callable[[], object]) -> tuple[threading.Event, dict[str, object]]:
        """Run ``call`` after those before it; set the event once it returned or raised."""
        box: dict[str, object] = {}
        done = threading.Event()
        self._calls.put((call, box, done))
        return done, box

    def close(self) -> None:
        """End the thread once it is done with what it was handed."""
        self._calls.put(None)


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
        self.before_commit = before_commit
        self.counters = work.counters
        self.positions: dict[tuple[str, int], int] = {}  # next offset to commit
        self.outage = Outage(spec.component_id, config.bootstrap_servers or "?",
                             config.outage_limit_s, config.outage_log_interval_s)
        self.running = threading.Event()
        self._stop = threading.Event()
        self._requests: queue.Queue[tuple[str, str, list[int] | None]] = queue.Queue()
        self.paused: dict[str, set[int] | None] = {}  # full topic -> partitions (None: all)
        self._assignment_changed = True
        self._call_timeout_s = 10.0
        self.producer: RecordProducer | None = None
        self.consumer: Consumer | None = None
        self._tainted = False  # the producer saw the broker go away
        self._stuck = False  # a call on the producer never returned
        self._open = False  # a transaction is begun on the producer (commit_interval_s)
        self._revoked = False  # partitions were revoked during this round's poll
        self._inflight: _InFlight | None = None  # a commit the loop does not wait for
        self._caller: _Worker | None = None  # runs _bounded's calls
        self._committer: _Worker | None = None  # runs the commits in flight
        self._stage = "producing"  # how far the last transaction got
        # a work that starts over after an abort may have its next records made while the
        # broker completes a commit (a work that keeps its position waits for each one)
        self._pipelined = spec.commit_interval_s is not None and not spec.keeps_position
        self._abandoned: list[RecordProducer] = []
        self._refused_writes: list[tuple[str, KafkaError]] = []  # topic, error
        self.exporter: PrometheusExporter | None = None  # $ASTRAFLOW_METRICS_PORT

    # --- control, callable from any thread -------------------------------------------
    def stop(self) -> None:
        """Finish the open transaction, leave the group and return from ``run``."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def pause(self, topic: str, partitions: list[int] | None = None) -> None:
        """Stop fetching from ``topic`` (full name), all or some partitions."""
        self._requests.put(("pause", topic, partitions))

    def resume(self, topic: str, partitions: list[int] | None = None) -> None:
        self._requests.put(("resume", topic, partitions))

    def checkpoint(self) -> Checkpoint:
        return Checkpoint(self.codec, self.spec.dlq, self.spec.max_bytes)

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> None:
        s = self.spec
        self._check_topics()
        self.producer = self._new_producer()
        # a bad or busy $ASTRAFLOW_METRICS_PORT fails here, at start; the series appear
        # with the first status (which names the component's kind)
        self.exporter = exporter_from_env(s.component_id, None, self.counters)
        try:
            self.work.start(self)
            self.consumer = self._new_consumer()
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
            if self.consumer is not None:
                self.consumer.close()
            for worker in (self._caller, self._committer):
                if worker is not None:
                    worker.close()
            self._caller = self._committer = None
            if self.exporter is not None:
                self.exporter.close()
            self.work.close()

    def _rounds(self) -> None:
        last_status = 0.0
        cp, first, inputs = self.checkpoint(), None, 0  # open checkpoint, its first input
        while not self._stop.is_set():
            self._apply_pauses()
            t0 = time.monotonic()
            self._revoked = False
            if self._committed_meanwhile() is False:  # aborted: the inputs come again
                cp, first, inputs = self.checkpoint(), None, 0
            msgs = self._consume(self.spec.max_batch - inputs, wait=first is None)
            t1 = time.monotonic()
            if self._revoked and self._pipelined and (first is not None or msgs):
                # the open checkpoint, or records polled before the revocation in this
                # round, may be of partitions that went to another member: none of it may
                # commit, and every partition goes back to its committed offset
                self._drop_open()
                cp, first, inputs = self.checkpoint(), None, 0
                continue
            if not self._handle(msgs, cp):
                cp, first, inputs = self.checkpoint(), None, 0
                continue
            now = time.monotonic()
            if msgs:
                self.counters.busy_s += now - t1
                first = t1 if first is None else first
                inputs += len(msgs)
            else:
                self.counters.waiting_s += t1 - t0
            status_due = now - last_status >= self.spec.status_interval_s
            if not status_due and not self._commit_due(cp, bool(msgs), first, inputs, now):
                if cp:
                    self._send_early(cp)
                continue
            if self._pipelined and not status_due:
                self._commit_in_flight(cp)
            else:
                self.commit(cp, status=status_due)
            cp, first, inputs = self.checkpoint(), None, 0
            if status_due:
                last_status = time.monotonic()
        self.commit(cp, status=True)  # what is open, and a last status: the final state

    def _commit_due(self, cp: Checkpoint, got: bool, first: float | None, inputs: int,
                    now: float) -> bool:
        """Whether to commit the open checkpoint now (see ``LoopSpec.commit_interval_s``)."""
        interval = self.spec.commit_interval_s
        if first is None:  # no input: commit what timers made, if anything
            return bool(cp)
        return (interval is None or not got or inputs >= self.spec.max_batch
                or now - first >= interval)

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
            if self._open:  # its records go with the round: the next producer fences it
                self._open, self._tainted = False, True
            self._rewind()
            return False

    def _consume(self, limit: int, wait: bool) -> list[Message]:
        """Up to ``limit`` records: waiting for them up to the poll timeout when ``wait``,
        else only those already fetched."""
        # serve the producer's events too: its error_cb is how an idle producer learns that
        # the broker went away (and must be replaced before its next transaction)
        if self._inflight is None:  # else the commit's own flush serves them
            self.producer.producer.poll(0)
        s = self.spec
        if s.commit_interval_s is None:
            got = self.consumer.consume(s.max_batch, s.poll_timeout_s)
        elif not wait:
            got = self.consumer.consume(min(limit, _CHUNK), 0)
        else:
            got = self.consumer.consume(min(limit, _CHUNK), 0) if self._inflight else []
            if not got:
                self._settle()  # nothing to make meanwhile: take the commit's outcome now
                # consume(n, t) waits for all n: take the first record as soon as it comes
                got = self.consumer.consume(1, s.poll_timeout_s)
                if got and limit > 1:
                    got += self.consumer.consume(min(limit, _CHUNK) - 1, 0)
        out = []
        positions = self.positions
        for m in got:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise KafkaException(err)
                self._refuse_read(err, m.topic())
                self._on_client_error(err)
                continue
            positions[(m.topic(), m.partition())] = m.offset() + 1
            out.append(m)
        self.counters.consumed += len(out)
        return out

    def _refuse_read(self, err: KafkaError, topic: str | None) -> None:
        """Stop on a denied read (no retrying): one line naming the principal, the
        operation and the resource."""
        group = err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED
        resource = f"group {self.spec.group}" if group else (
            f"topic {topic}" if topic else f"one of topics {', '.join(self.spec.inputs)}")
        denied = refusal(err, self.config.principal(), "READ", resource)
        if denied is not None:
            raise denied

    def _denied(self, err: KafkaError | None, stage: str) -> KafkaAccessError | None:
        """The refusal behind a failed transaction, if it was one: a record refused by a
        topic (from the delivery reports), the transactional id, the group's offsets."""
        code = err.code() if err is not None else None
        if code not in AUTHORIZATION and code != KafkaError._INCONSISTENT:
            return None  # not a denial (a refused record makes the commit inconsistent)
        deadline = time.monotonic() + 2.0  # serve the delivery reports that name the topic
        while not self._refused_writes and time.monotonic() < deadline:
            self.producer.producer.poll(0.1)
        principal = self.config.principal()
        if self._refused_writes:
            topic, topic_err = self._refused_writes[0]
            return refusal(topic_err, principal, "WRITE", f"topic {topic}")
        if code == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
            return refusal(err, principal, "WRITE",
                           f"transactional id {self.spec.transactional_id}")
        if code == KafkaError.GROUP_AUTHORIZATION_FAILED:
            return refusal(err, principal, "READ", f"group {self.spec.group}")
        produced = [*self.spec.outputs, self.spec.dlq, self.spec.status_topic]
        if code == KafkaError.TOPIC_AUTHORIZATION_FAILED:  # which topic: ask the broker
            refused = without_write(self.config.admin_conf(), produced)
            if refused:
                return refusal(err, principal, "WRITE", f"topic {refused[0]}")
        return refusal(err, principal, "WRITE", f"one of topics {', '.join(produced)}")

    def _on_refused_delivery(self, err: KafkaError | None, msg: Message) -> None:
        """Delivery reports of errors only: remember the topics that refused a record."""
        if err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            self._refused_writes.append((msg.topic(), err))

    def _on_client_error(self, err: KafkaError) -> None:
        if err.code() == KafkaError.GROUP_AUTHORIZATION_FAILED:
            self._refuse_read(err, None)  # raises out of the consume that served it
        if transient(err):
            self._tainted = True
            self.outage.failed(err.str())
        else:
            log.warning("%s: Kafka client error: %s", self.spec.component_id, err)

    # --- transactions ------------------------------------------------------------------
    def commit(self, cp: Checkpoint, status: bool = False, offsets: bool = True) -> None:
        """Commit ``cp`` (plus a status record, plus the consumed offsets) in one
        transaction; after an abort, rewind (or, ``keeps_position``, send it again)."""
        if not self._settle():  # the commit in flight was aborted: cp's inputs come again
            cp = self.checkpoint()
        while True:
            if self._transaction(cp, status, offsets):
                self._committed(cp)
                return
            self.counters.aborted += 1
            if not self.spec.keeps_position:
                self._rewind()
                return
            self._serve_group()  # e.g. "unknown member": rejoin before sending it again

    def _committed(self, cp: Checkpoint) -> None:
        self.counters.transactions += 1
        self.counters.produced += cp.outputs
        self.counters.dead_lettered += cp.dead
        for done in cp.after_commit:
            done()

    def _transaction(self, cp: Checkpoint, status: bool, offsets: bool) -> bool:
        """One try; False when it was aborted."""
        if self._tainted:
            # a producer that lost the broker can hang in send_offsets_to_transaction on a
            # stale coordinator (librdkafka #5456, #5511): start from a fresh one
            self._replace_producer("Kafka went away since the last transaction")
        tps = self._offsets() if offsets and self.consumer is not None else []
        self._stage = "producing"
        try:
            self._send(cp)
            if status:
                st = self.work.status()
                self.producer.produce(self.spec.status_topic, st, st.component_id)
                self._export(st)
            self._finish(cp, tps, self._group_metadata(tps))
        except KafkaException as e:
            self._open = False
            return self._failed(e, self._stage, tps)
        except BaseException:
            self._open = False
            self._abort_quietly()
            raise
        self._open = False
        self.producer.errors.clear()
        self.outage.ok()
        return True

    def _group_metadata(self, tps: list[TopicPartition]) -> object | None:
        """On the loop's thread only: elsewhere it would wait for a rebalance callback that
        may itself wait for the commit in flight."""
        return self.consumer.consumer_group_metadata() if tps else None

    def _finish(self, cp: Checkpoint, tps: list[TopicPartition], meta: object | None) -> None:
        """Send the offsets and commit: the part of a transaction that waits on the broker
        (on a helper thread for a commit in flight)."""
        p = self.producer.producer
        if tps:
            self._stage = "sending offsets"
            self._bounded(lambda: p.send_offsets_to_transaction(
                tps, meta, self._call_timeout_s))
        if self.before_commit is not None:
            self.before_commit(cp)
        self._stage = "committing"
        self._retrying("committing", lambda: self._bounded(
            lambda: p.commit_transaction(self._call_timeout_s)))

    def _commit_in_flight(self, cp: Checkpoint) -> None:
        """Commit ``cp`` while the loop goes on: its records are sent here, the offsets and
        the commit wait on a helper thread, and ``_settle`` (before anything else touches
        the transaction) takes the outcome. Meanwhile the next records are made but not
        sent: a producer has one transaction at a time."""
        if not self._settle():
            return  # the previous one was aborted: cp's inputs come again
        if self._tainted:
            self._replace_producer("Kafka went away since the last transaction")
        tps = self._offsets()
        self._stage = "producing"
        try:
            self._send(cp)
        except KafkaException as e:
            self._open = False
            if not self._failed(e, self._stage, tps):
                self.counters.aborted += 1
                self._rewind()
            return
        flight = _InFlight(cp, tps, self._group_metadata(tps))
        if self._committer is None:
            self._committer = _Worker("kafka-commit")
        self._inflight = flight
        self._committer.submit(lambda: self._finish_in_flight(flight))

    def _finish_in_flight(self, flight: _InFlight) -> None:
        try:
            self._finish(flight.cp, flight.tps, flight.meta)
        except BaseException as e:  # noqa: BLE001 - taken by _settle on the loop's thread
            flight.error = e
        finally:
            flight.done.set()

    def _committed_meanwhile(self) -> bool | None:
        """``_settle`` if the commit in flight is done (None while it is not)."""
        flight = self._inflight
        if flight is None or not flight.done.is_set():
            return None
        return self._settle()

    def _settle(self) -> bool:
        """Wait for the commit in flight, if any, and take its outcome; False when it was
        aborted (the loop then rewound: what was consumed since comes again)."""
        flight, self._inflight = self._inflight, None
        if flight is None:
            return True
        flight.done.wait()  # _finish's calls are _bounded: it ends
        self._open = False
        e = flight.error
        if e is None:
            self.producer.errors.clear()
            self.outage.ok()
            self._committed(flight.cp)
            return True
        if not isinstance(e, KafkaException):
            self._abort_quietly()
            raise e
        if self._failed(e, self._stage, flight.tps):
            self._committed(flight.cp)
            return True
        self.counters.aborted += 1
        self._rewind()
        return False

    def _send(self, cp: Checkpoint) -> None:
        """Begin a transaction unless one is open, and hand the producer the records of
        ``cp`` it does not hold yet (a new transaction gets them all)."""
        if not self._open:
            self.producer.producer.begin_transaction()
            self._open = True
            cp.sent = 0
        # no delivery callback per record: the commit fails if a record does
        produce, records, sent = self.producer.producer.produce, cp.records, cp.sent
        try:
            for topic, value, key, partition, ts in itertools.islice(records, sent, None):
                try:
                    if ts:
                        produce(topic, value, key, -1 if partition is None else partition,
                                timestamp=ts)
                    else:
                        produce(topic, value, key, -1 if partition is None else partition)
                except BufferError:  # the local queue is full: this one waits for room
                    self.producer.produce_raw(topic, value, key, partition, ts)
                sent += 1
        finally:
            cp.sent = sent

    def _send_early(self, cp: Checkpoint) -> None:
        """``_send`` while the transaction stays open, so that the broker takes its records
        while the next ones are made; a failure is left for the commit to meet again."""
        if self._tainted or self._inflight is not None:
            return  # the commit replaces the producer first / one transaction at a time
        try:
            self._send(cp)
        except KafkaException as e:
            log.debug("%s: sending ahead of the commit failed: %s", self.spec.component_id, e)

    def _drop_open(self) -> None:
        """Abort the open transaction (what was sent of it) and go back to the committed
        offsets of every partition: the round's records and held state are dropped."""
        log.info("%s: dropping what is uncommitted after a rebalance",
                 self.spec.component_id)
        self._settle()
        if self._open:
            self._open = False
            try:
                self._bounded(lambda: self.producer.producer.abort_transaction(
                    self._call_timeout_s))
            except KafkaException as e:
                log.warning("%s: abort failed (%s); a new producer fences the transaction",
                            self.spec.component_id, e)
                self._tainted = True
        self._rewind()

    def _failed(self, e: KafkaException, stage: str, tps: list[TopicPartition]) -> bool:
        """After a failed transaction: True if it committed after all, False once it is
        aborted; raises what cannot be recovered from."""
        err = kafka_error(e)
        cid = self.spec.component_id
        denied = self._denied(err, stage)
        if denied is not None:  # aborted, its offsets not committed: nothing is lost
            log.debug("%s: aborting the transaction (%s) after a denial", cid, stage)
            self._abort_quietly()
            raise denied
        if err is not None and err.txn_requires_abort() and not transient(err):
            self.outage.ok()  # the broker answered, if with an abort (e.g. a rebalance)
            log.warning("%s: aborting the transaction (%s): %s", cid, stage, err.str())
            try:
                self.producer.producer.abort_transaction(self._call_timeout_s)
                self.producer.errors.clear()
            except KafkaException:
                self._replace_producer("the abort failed")
            return False
        if err is not None and (transient(err) or err.txn_requires_abort()
                                or (err.fatal() and self.outage.recent())):
            if transient(err):
                self.outage.failed(f"{stage}: {err.str()}")
            # a new producer (same transactional id) aborts what the old one left open
            self._replace_producer(f"{stage} failed: {err.str()}")
            return stage == "committing" and self._committed_anyway(tps)
        if err is not None and err.fatal():
            raise RuntimeError(
                f"{cid}: fatal producer error ({err.str()}); if it says fenced, another copy "
                f"runs with transactional id {self.spec.transactional_id}: give each copy "
                f"its own --instance") from e
        self._abort_quietly()
        raise e

    def _bounded(self, call: Callable[[], object]) -> object:
        """``call()`` on a helper thread, given up after a few call timeouts: librdkafka's
        transactional calls can block past their timeout when the broker goes away in the
        middle of one (librdkafka #5456, #5511). A call given up on leaves its producer
        stuck: it is abandoned, not closed, and replaced."""
        if self._caller is None:
            self._caller = _Worker("kafka-call")
        done, box = self._caller.submit(call)
        if not done.wait(self._call_timeout_s * 3):
            self._stuck = True
            self._caller.close()  # it ends if the call ever returns; the next call gets a new one
            self._caller = None
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            "no answer from the transactional call"))
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")

    def _serve_group(self) -> None:
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
        self._assignment_changed = True  # the next round resumes what is not paused

    def _committed_anyway(self, tps: list[TopicPartition]) -> bool:
        """Whether a commit whose answer was lost went through: the group's committed
        offsets are the ones it carried (no one else commits for these partitions)."""
        if not tps:
            return False
        committed = self._retrying("reading committed offsets", lambda: self.consumer.committed(
            [TopicPartition(t.topic, t.partition) for t in tps], timeout=self._call_timeout_s))
        mine = {(t.topic, t.partition): t.offset for t in tps}
        done = all(mine.get((t.topic, t.partition)) == t.offset for t in committed)
        if done:
            log.warning("%s: the commit whose answer was lost went through",
                        self.spec.component_id)
        return done

    def _replace_producer(self, why: str) -> None:
        log.warning("%s: starting a new producer (%s)", self.spec.component_id, why)
        old, self.producer = self.producer, None
        stuck, self._stuck = self._stuck, False
        self._open = False
        self.producer = self._new_producer()
        if old is not None and not stuck:  # a stuck one would block here too
            old.producer.purge()  # its records belong to the aborted transaction
        elif old is not None:
            self._abandoned.append(old)  # never closed: its call never returns

    def _abort_quietly(self) -> None:
        try:
            self.producer.producer.abort_transaction(self._call_timeout_s)
        except KafkaException as e:
            log.debug("%s: abort after an error failed too: %s", self.spec.component_id, e)

    def _export(self, status: ComponentStatus) -> None:
        """Hand ``status`` and the lag to the Prometheus exporter; never fails the caller."""
        if self.exporter is None:
            return
        try:
            self.exporter.update(status, self.lag())
        except Exception as e:  # noqa: BLE001 - metrics must not fail a transaction
            log.warning("%s: metrics not updated: %s", self.spec.component_id, e)

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

    def _offsets(self) -> list[TopicPartition]:
        held = self.work.held_offsets()
        out = []
        for (topic, part), pos in sorted(self.positions.items()):
            h = held.get((topic, part))
            out.append(TopicPartition(topic, part, min(pos, h) if h is not None else pos))
        return out

    def _rewind(self) -> None:
        """After an abort: drop held state and go back to the committed offsets."""
        self._settle()  # those offsets must be final: no commit in flight
        assigned = self.consumer.assignment()
        self.work.on_revoke([(tp.topic, tp.partition) for tp in assigned])
        self.positions.clear()
        committed = self._committed_offsets(assigned)
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

    def _retrying(self, what: str, call: Callable[[], object], tries: int | None = None):
        """``call()``, again while Kafka is away (up to the outage limit); with ``tries``,
        ``_NoAnswer`` after that many transient failures."""
        for attempt in itertools.count(1):
            try:
                return call()
            except KafkaException as e:
                err = kafka_error(e)
                if not transient(err) or err.txn_requires_abort() or self._stuck:
                    raise
                self.outage.failed(f"{what}: {err.str()}")
                if self._stop.is_set():
                    raise _Stopping() from e
                if tries is not None and attempt >= tries:
                    raise _NoAnswer(f"{what}: {err.str()}") from e

    def _committed_offsets(self, tps: list[TopicPartition]) -> list[TopicPartition] | None:
        """The group's committed offsets of ``tps``, read again while Kafka is away; None
        when the broker answers a metadata request, then one read more times out too: the
        consumer was replaced (``_renew_consumer``)."""
        tries, answers = _REWIND_TRIES, False
        while True:
            try:
                return self._retrying("reading committed offsets", lambda: (
                    self.consumer.committed(tps, timeout=self._call_timeout_s)), tries=tries)
            except _NoAnswer as e:
                if answers:  # only the group's offsets do not come
                    self._renew_consumer(str(e))
                    return None
                answers = self._broker_answers()
                tries = 1 if answers else _REWIND_TRIES

    def _broker_answers(self) -> bool:
        """Whether a broker answers the consumer's metadata request for its inputs."""
        try:
            self.consumer.list_topics(self.spec.inputs[0], timeout=self._call_timeout_s)
        except KafkaException:
            return False
        return True

    def _new_consumer(self) -> Consumer:
        """The group member: the spec's inputs subscribed, rebalances served by the loop."""
        s = self.spec
        consumer = Consumer(self.config.consumer_conf(
            s.group, error_cb=self._on_client_error, **s.consumer_options))
        consumer.subscribe(s.inputs, on_assign=self._on_assign, on_revoke=self._on_revoke,
                           on_lost=self._on_revoke)
        return consumer

    def _renew_consumer(self, why: str) -> None:
        """Replace a consumer that cannot read the group's committed offsets, after a
        rewind dropped what it held: the new member starts each partition it is assigned
        at the committed offset, which librdkafka fetches itself for as long as that takes
        (an outage is seen by the clients' error callbacks meanwhile). The old one leaves
        the group on a helper thread, given up after a few call timeouts."""
        log.warning("%s: starting a new consumer (%s)", self.spec.component_id, why)
        old, self.consumer = self.consumer, None
        closer = _Worker("kafka-close")
        done, _ = closer.submit(old.close)
        if not done.wait(self._call_timeout_s * 3):
            log.warning("%s: the old consumer did not close; left behind",
                        self.spec.component_id)
        closer.close()
        self.positions.clear()  # whatever its revocation left: nothing is consumed yet
        self.consumer = self._new_consumer()
        self._assignment_changed = True

    def _new_producer(self) -> RecordProducer:
        tuned = {k: v for k, v in _TXN_PRODUCER.items() if k not in self.config.producer_options}
        producer = RecordProducer(
            self.config, self.codec, transactional_id=self.spec.transactional_id, init=False,
            error_cb=self._on_client_error, on_delivery=self._on_refused_delivery,
            **{**tuned, "transaction.timeout.ms": self.config.transaction_timeout_ms,
               "delivery.report.only.error": True, **self.spec.producer_options})
        try:
            self._retrying("initialising transactions",
                           lambda: producer.producer.init_transactions(self._call_timeout_s))
        except KafkaException as e:
            denied = refusal(kafka_error(e), self.config.principal(), "WRITE",
                             f"transactional id {self.spec.transactional_id}")
            if denied is not None:
                raise denied from None
            raise
        self._tainted = False
        self.outage.ok()
        return producer

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

    # --- rebalance and pause bookkeeping (run on the loop's thread, inside consume) ------
    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assignment_changed = True
        if self.spec.keeps_position:
            for tp in partitions:
                pos = self.positions.get((tp.topic, tp.partition))
                if pos is not None:
                    tp.offset = pos
            consumer.assign(partitions)
        log.info("%s: assigned %s", self.spec.component_id,
                 ", ".join(f"{p.topic}[{p.partition}]" + (f"@{p.offset}" if p.offset >= 0 else "")
                           for p in partitions))

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._assignment_changed = True
        self._revoked = True
        if self._inflight is not None:  # its offsets commit before the partitions move on
            self._inflight.done.wait()
        log.info("%s: revoked %s", self.spec.component_id,
                 ", ".join(f"{p.topic}[{p.partition}]" for p in partitions))
        if self.spec.keeps_position:
            return
        self.work.on_revoke([(p.topic, p.partition) for p in partitions])
        for p in partitions:
            self.positions.pop((p.topic, p.partition), None)

    def _apply_pauses(self) -> None:
        changed = self._assignment_changed
        while True:
            try:
                op, topic, parts = self._requests.get_nowait()
            except queue.Empty:
                break
            changed = True
            self._note_request(op, topic, parts)
        if not changed:
            return
        self.paused = {t: p for t, p in self.paused.items() if p is None or p}
        self._assignment_changed = False
        to_pause, to_resume = [], []
        for tp in self.consumer.assignment():
            paused = self.paused.get(tp.topic, set())
            (to_pause if paused is None or tp.partition in paused else to_resume).append(tp)
        if to_pause:
            self.consumer.pause(to_pause)
        if to_resume:
            self.consumer.resume(to_resume)

    def _note_request(self, op: str, topic: str, parts: list[int] | None) -> None:
        if op == "pause":
            if parts is None:
                self.paused[topic] = None
            elif (current := self.paused.get(topic, set())) is not None:
                self.paused[topic] = current | set(parts)
        elif parts is None:
            self.paused.pop(topic, None)
        elif self.paused.get(topic) is not None:
            self.paused[topic] -= set(parts)
        else:  # resume some of an all-partitions pause: keep the rest paused
            assigned = {tp.partition for tp in self.consumer.assignment() if tp.topic == topic}
            self.paused[topic] = assigned - set(parts)


__all__ = [
    "BrokerUnreachable",
    "Checkpoint",
    "LoopSpec",
    "Outage",
    "RecordTooLarge",
    "RuntimeCounters",
    "TransactionalLoop",
    "Work",
]
