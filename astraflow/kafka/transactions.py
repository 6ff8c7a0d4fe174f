"""``Transactions``: the producer side of the transactional loop.

One transactional producer, the transaction open on it, and the commit of a checkpoint:
its records produced, the consumed offsets sent (``send_offsets_to_transaction``), the
commit, either waited for (``attempt``) or left to a helper thread while the loop makes
the next records (``start_commit``, then ``settle`` before anything else touches the
transaction, the group or the offsets). What a failed transaction leaves to do is decided
here too (``failed``): abort on the same producer, start a new producer (which fences the
old one's transaction), learn that a commit whose answer was lost went through, or raise
what cannot be recovered from (a denial, a fenced producer). The loop does the rest: it
rewinds the consumer, or sends the same checkpoint again.

librdkafka's transactional calls can block past their timeout when the broker goes away
in the middle of one (librdkafka #5456, #5511): they run on a helper thread and are given
up after a few call timeouts (``bounded``), their producer abandoned, not closed."""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from confluent_kafka import KafkaError, KafkaException, Message, TopicPartition

from astraflow.kafka.access import AUTHORIZATION, KafkaAccessError, refusal, without_write
from astraflow.kafka.checkpoint import Checkpoint
from astraflow.kafka.clients import RecordProducer
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.outage import Outage, kafka_error, transient
from astraflow.kafka.spec import LoopSpec, RuntimeCounters
from astraflow.wire.codec import Codec

log = logging.getLogger("astraflow.loop")

# the transactional producer's defaults (the config's producer_options win): a transaction
# that begins while the broker still completes the previous one gets CONCURRENT_TRANSACTIONS
# from AddPartitionsToTxn/AddOffsetsToTxn, retried after retry.backoff.ms (100 ms by
# default, doubling up to retry.backoff.max.ms): back-to-back transactions would pay it
# every time. Retries of requests only: reconnecting to a broker that is away keeps its own
# backoff.
TXN_PRODUCER = {"retry.backoff.ms": 1, "retry.backoff.max.ms": 20}


class Worker:
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


@dataclass
class InFlight:
    """A commit running on a helper thread: its checkpoint, offsets and outcome."""

    cp: Checkpoint
    tps: list[TopicPartition]
    meta: object | None  # the consumer's group metadata, taken on the loop's thread
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None


class Transactions:
    """The loop's transactional producer and the transaction on it (see the module)."""

    def __init__(self, spec: LoopSpec, config: KafkaConfig, codec: Codec,
                 counters: RuntimeCounters, outage: Outage,
                 retrying: Callable[[str, Callable[[], object]], object],
                 on_client_error: Callable[[KafkaError], None],
                 went_through: Callable[[list[TopicPartition]], bool],
                 before_commit: Callable[[Checkpoint], None] | None = None):
        """``retrying(what, call)``: the loop's retry while Kafka is away; ``went_through
        (tps)``: whether a commit whose answer was lost committed these offsets;
        ``before_commit(cp)``: called after the offsets are sent, before the commit."""
        self.spec = spec
        self.config = config
        self.codec = codec
        self.counters = counters
        self.outage = outage
        self._retrying = retrying
        self._on_client_error = on_client_error
        self._went_through = went_through
        self.before_commit = before_commit
        self.call_timeout_s = 10.0
        self.producer: RecordProducer | None = None
        self.tainted = False  # the producer saw the broker go away
        self.stuck = False  # a call on the producer never returned
        self.open = False  # a transaction is begun on the producer (commit_interval_s)
        self.inflight: InFlight | None = None  # a commit the loop does not wait for
        self.stage = "producing"  # how far the last transaction got
        self.abandoned: list[RecordProducer] = []
        self.refused_writes: list[tuple[str, KafkaError]] = []  # topic, error
        self._caller: Worker | None = None  # runs bounded's calls
        self._committer: Worker | None = None  # runs the commits in flight

    # --- the producer ------------------------------------------------------------------
    def start(self) -> None:
        """The producer, its transactions initialised (fencing a predecessor's)."""
        self.producer = self._new_producer()

    def close(self) -> None:
        """End the helper threads (the producer is left to the garbage collector)."""
        for worker in (self._caller, self._committer):
            if worker is not None:
                worker.close()
        self._caller = self._committer = None

    def serve(self) -> None:
        """Serve the producer's events unless a commit in flight does (its flush): its
        error_cb is how an idle producer learns that the broker went away (and must be
        replaced before its next transaction)."""
        if self.inflight is None:
            self.producer.producer.poll(0)

    def _new_producer(self) -> RecordProducer:
        tuned = {k: v for k, v in TXN_PRODUCER.items() if k not in self.config.producer_options}
        producer = RecordProducer(
            self.config, self.codec, transactional_id=self.spec.transactional_id, init=False,
            error_cb=self._on_client_error, on_delivery=self._on_refused_delivery,
            **{**tuned, "transaction.timeout.ms": self.config.transaction_timeout_ms,
               "delivery.report.only.error": True, **self.spec.producer_options})
        try:
            self._retrying("initialising transactions",
                           lambda: producer.producer.init_transactions(self.call_timeout_s))
        except KafkaException as e:
            denied = refusal(kafka_error(e), self.config.principal(), "WRITE",
                             f"transactional id {self.spec.transactional_id}")
            if denied is not None:
                raise denied from None
            raise
        self.tainted = False
        self.outage.ok()
        return producer

    def replace_producer(self, why: str) -> None:
        """A new producer (same transactional id: it aborts what the old one left open)."""
        log.warning("%s: starting a new producer (%s)", self.spec.component_id, why)
        old, self.producer = self.producer, None
        stuck, self.stuck = self.stuck, False
        self.open = False
        self.producer = self._new_producer()
        if old is not None and not stuck:  # a stuck one would block here too
            old.producer.purge()  # its records belong to the aborted transaction
        elif old is not None:
            self.abandoned.append(old)  # never closed: its call never returns

    def _on_refused_delivery(self, err: KafkaError | None, msg: Message) -> None:
        """Delivery reports of errors only: remember the topics that refused a record."""
        if err is not None and err.code() == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            self.refused_writes.append((msg.topic(), err))

    # --- one transaction -----------------------------------------------------------------
    def _begin(self, tps: Callable[[], list[TopicPartition]]) -> list[TopicPartition]:
        """A transaction's start: a fresh producer where Kafka went away since the last
        one, and the offsets it will commit."""
        if self.tainted:
            # a producer that lost the broker can hang in send_offsets_to_transaction on a
            # stale coordinator (librdkafka #5456, #5511): start from a fresh one
            self.replace_producer("Kafka went away since the last transaction")
        offsets = tps()
        self.stage = "producing"
        return offsets

    def attempt(self, cp: Checkpoint, tps: Callable[[], list[TopicPartition]],
                status: Callable[[], None] | None,
                metadata: Callable[[list[TopicPartition]], object | None]) -> bool:
        """One try of a transaction carrying ``cp``, a status record (``status()``
        produces it) and the offsets ``tps()``, waited for; False when it was aborted."""
        offsets = self._begin(tps)
        try:
            self.send(cp)
            if status is not None:
                status()
            self._finish(cp, offsets, metadata(offsets))
        except KafkaException as e:
            self.open = False
            return self.failed(e, self.stage, offsets)
        except BaseException:
            self.open = False
            self.abort_quietly()
            raise
        self.open = False
        self.producer.errors.clear()
        self.outage.ok()
        self.committed(cp)
        return True

    def committed(self, cp: Checkpoint) -> None:
        """Count what ``cp`` committed and run what waited for it."""
        self.counters.transactions += 1
        self.counters.produced += cp.outputs
        self.counters.dead_lettered += cp.dead
        for done in cp.after_commit:
            done()

    def _finish(self, cp: Checkpoint, tps: list[TopicPartition], meta: object | None) -> None:
        """Send the offsets and commit: the part of a transaction that waits on the broker
        (on a helper thread for a commit in flight)."""
        p = self.producer.producer
        if tps:
            self.stage = "sending offsets"
            self.bounded(lambda: p.send_offsets_to_transaction(
                tps, meta, self.call_timeout_s))
        if self.before_commit is not None:
            self.before_commit(cp)
        self.stage = "committing"
        self._retrying("committing", lambda: self.bounded(
            lambda: p.commit_transaction(self.call_timeout_s)))

    def send(self, cp: Checkpoint) -> None:
        """Begin a transaction unless one is open, and hand the producer the records of
        ``cp`` it does not hold yet (a new transaction gets them all)."""
        if not self.open:
            self.producer.producer.begin_transaction()
            self.open = True
            cp.sent = 0
        # the hot path (every output passes here): no delivery callback per record (the
        # commit fails if a record does), and the common case (no partition, no
        # timestamp) in one call with positional arguments
        produce, records, sent = self.producer.producer.produce, cp.records, cp.sent
        try:
            for topic, value, key, partition, ts in itertools.islice(records, sent, None):
                try:
                    if partition is None and not ts:
                        produce(topic, value, key)
                    elif ts:
                        produce(topic, value, key, -1 if partition is None else partition,
                                timestamp=ts)
                    else:
                        produce(topic, value, key, partition)
                except BufferError:  # the local queue is full: this one waits for room
                    self.producer.produce_raw(topic, value, key, partition, ts)
                sent += 1
        finally:
            cp.sent = sent

    def send_early(self, cp: Checkpoint) -> None:
        """``send`` while the transaction stays open, so that the broker takes its records
        while the next ones are made; a failure is left for the commit to meet again."""
        if self.tainted or self.inflight is not None:
            return  # the commit replaces the producer first / one transaction at a time
        try:
            self.send(cp)
        except KafkaException as e:
            log.debug("%s: sending ahead of the commit failed: %s", self.spec.component_id, e)

    # --- a commit in flight ----------------------------------------------------------------
    def start_commit(self, cp: Checkpoint, tps: Callable[[], list[TopicPartition]],
                     metadata: Callable[[list[TopicPartition]], object | None]) -> bool:
        """Commit ``cp`` (with the offsets ``tps()``) while the loop goes on: its records
        are sent here, the offsets and the commit wait on a helper thread, and ``settle``
        takes the outcome. Meanwhile the next records are made but not sent: a producer
        has one transaction at a time. False when sending failed and it was aborted. The
        commit before it must be settled."""
        offsets = self._begin(tps)
        try:
            self.send(cp)
        except KafkaException as e:
            self.open = False
            return self.failed(e, self.stage, offsets)
        flight = InFlight(cp, offsets, metadata(offsets))
        if self._committer is None:
            self._committer = Worker("kafka-commit")
        self.inflight = flight
        self._committer.submit(lambda: self._finish_in_flight(flight))
        return True

    def _finish_in_flight(self, flight: InFlight) -> None:
        try:
            self._finish(flight.cp, flight.tps, flight.meta)
        except BaseException as e:  # noqa: BLE001 - taken by settle on the loop's thread
            flight.error = e
        finally:
            flight.done.set()

    def finished(self) -> bool:
        """Whether a commit is in flight and done (``settle`` then waits for nothing)."""
        flight = self.inflight
        return flight is not None and flight.done.is_set()

    def wait(self) -> None:
        """Wait until the commit in flight, if any, is done (its outcome left to
        ``settle``): a rebalance lets its offsets commit before the partitions move on."""
        flight = self.inflight
        if flight is not None:
            flight.done.wait()

    def settle(self) -> bool:
        """Wait for the commit in flight, if any, and take its outcome; False when it was
        aborted (what was consumed since its offsets comes again)."""
        flight, self.inflight = self.inflight, None
        if flight is None:
            return True
        flight.done.wait()  # _finish's calls are bounded: it ends
        self.open = False
        e = flight.error
        if e is None:
            self.producer.errors.clear()
            self.outage.ok()
            self.committed(flight.cp)
            return True
        if not isinstance(e, KafkaException):
            self.abort_quietly()
            raise e
        if self.failed(e, self.stage, flight.tps):
            self.committed(flight.cp)
            return True
        return False

    # --- aborts and failures ---------------------------------------------------------------
    def abort_open(self) -> None:
        """Abort the open transaction, if any (what was sent of it); an abort that fails
        leaves the next producer to fence it."""
        if not self.open:
            return
        self.open = False
        try:
            self.bounded(lambda: self.producer.producer.abort_transaction(
                self.call_timeout_s))
        except KafkaException as e:
            log.warning("%s: abort failed (%s); a new producer fences the transaction",
                        self.spec.component_id, e)
            self.tainted = True

    def forsake_open(self) -> None:
        """Leave the open transaction, if any, to the next producer, which fences it."""
        if self.open:
            self.open, self.tainted = False, True

    def abort_quietly(self) -> None:
        """Abort after an error, which the caller raises: a failing abort is logged only."""
        try:
            self.producer.producer.abort_transaction(self.call_timeout_s)
        except KafkaException as e:
            log.debug("%s: abort after an error failed too: %s", self.spec.component_id, e)

    def failed(self, e: KafkaException, stage: str, tps: list[TopicPartition]) -> bool:
        """After a failed transaction: True if it committed after all, False once it is
        aborted; raises what cannot be recovered from."""
        err = kafka_error(e)
        cid = self.spec.component_id
        denied = self._denied(err, stage)
        if denied is not None:  # aborted, its offsets not committed: nothing is lost
            log.debug("%s: aborting the transaction (%s) after a denial", cid, stage)
            self.abort_quietly()
            raise denied
        if err is not None and err.txn_requires_abort() and not transient(err):
            self.outage.ok()  # the broker answered, if with an abort (e.g. a rebalance)
            log.warning("%s: aborting the transaction (%s): %s", cid, stage, err.str())
            try:
                self.producer.producer.abort_transaction(self.call_timeout_s)
                self.producer.errors.clear()
            except KafkaException:
                self.replace_producer("the abort failed")
            return False
        if err is not None and (transient(err) or err.txn_requires_abort()
                                or (err.fatal() and self.outage.recent())):
            if transient(err):
                self.outage.failed(f"{stage}: {err.str()}")
            # a new producer (same transactional id) aborts what the old one left open
            self.replace_producer(f"{stage} failed: {err.str()}")
            return stage == "committing" and self._went_through(tps)
        if err is not None and err.fatal():
            raise RuntimeError(
                f"{cid}: fatal producer error ({err.str()}); if it says fenced, another copy "
                f"runs with transactional id {self.spec.transactional_id}: give each copy "
                f"its own --instance") from e
        self.abort_quietly()
        raise e

    def _denied(self, err: KafkaError | None, stage: str) -> KafkaAccessError | None:
        """The refusal behind a failed transaction, if it was one: a record refused by a
        topic (from the delivery reports), the transactional id, the group's offsets."""
        code = err.code() if err is not None else None
        if code not in AUTHORIZATION and code != KafkaError._INCONSISTENT:
            return None  # not a denial (a refused record makes the commit inconsistent)
        deadline = time.monotonic() + 2.0  # serve the delivery reports that name the topic
        while not self.refused_writes and time.monotonic() < deadline:
            self.producer.producer.poll(0.1)
        principal = self.config.principal()
        if self.refused_writes:
            topic, topic_err = self.refused_writes[0]
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

    def bounded(self, call: Callable[[], object]) -> object:
        """``call()`` on a helper thread, given up after a few call timeouts: librdkafka's
        transactional calls can block past their timeout when the broker goes away in the
        middle of one (librdkafka #5456, #5511). A call given up on leaves its producer
        stuck: it is abandoned, not closed, and replaced."""
        if self._caller is None:
            self._caller = Worker("kafka-call")
        done, box = self._caller.submit(call)
        if not done.wait(self.call_timeout_s * 3):
            self.stuck = True
            self._caller.close()  # it ends if the call ever returns; the next call gets a new one
            self._caller = None
            raise KafkaException(KafkaError(KafkaError._TIMED_OUT,
                                            "no answer from the transactional call"))
        if "error" in box:
            raise box["error"]  # type: ignore[misc]
        return box.get("value")


__all__ = ["InFlight", "Transactions", "Worker"]
