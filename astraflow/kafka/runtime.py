"""The processor runtime: consume -> transform -> produce, exactly once.

Every micro-batch is one Kafka transaction holding the processor's output records, any
dead letters, an optional status record, and the consumer offsets of the inputs it
consumed (``send_offsets_to_transaction``). A crash anywhere before the commit aborts
all of it and the inputs are consumed again; ``read_committed`` readers see each output
exactly once. The transactional id is ``<group>.<instance>``: a restarted instance with
the same id fences its dead predecessor and aborts its open transaction at once.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import threading
import time
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, KafkaException, TopicPartition

from astraflow.codec import RecordDecodeError
from astraflow.dataflow import PROCESSOR_KINDS, Incoming, InvalidRecord, Outgoing, Processor
from astraflow.dataflow.base import ProcessorContext
from astraflow.kafka.clients import (
    RecordProducer,
    commit_consumed,
    dead_letter,
    make_admin,
    make_codec_for,
)
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import MissingTopicsError, missing_topics
from astraflow.records import ComponentStatus, DeadLetter, now_ms
from astraflow.topology import Topology, TopologyError
from astraflow.validate import check_record

log = logging.getLogger("astraflow.runtime")


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


class ProcessorRuntime:
    """Runs one processor of a topology against Kafka until ``stop()`` (or SIGTERM)."""

    def __init__(
        self,
        topology: Topology,
        name: str,
        instance: str | None = None,
        processor: Processor | None = None,
        config: KafkaConfig | None = None,
        session_timeout_ms: int = 10_000,
    ):
        if name not in topology.processors:
            raise TopologyError(
                f"no processor named {name!r} in {topology.source} "
                f"(have: {sorted(topology.processors)})"
            )
        self.topology = topology
        self.name = name
        self.spec = topology.processors[name]
        self.config = (config or topology.kafka).effective()
        cls = PROCESSOR_KINDS[self.spec.kind]
        self.processor = processor or cls(
            name, self.spec.inputs, self.spec.outputs, cls.Options(**self.spec.options)
        )
        self.instance = instance or os.environ.get("ASTRAFLOW_INSTANCE") or socket.gethostname()
        self.component_id = f"{name}/{self.instance}"
        self.group = topology.group_of(name)
        self.transactional_id = f"{self.group}.{self.instance}"
        self.session_timeout_ms = session_timeout_ms
        self.codec = make_codec_for(self.config)
        self.counters = RuntimeCounters()
        self._inputs = {topology.full_name(t): t for t in self.spec.inputs}
        self._expect = {full: topology.topic(t).schema_type for full, t in self._inputs.items()}
        self._out_types = {t: topology.topic(t).schema_type for t in self.spec.outputs}
        self._dlq = topology.full_name("dlq")
        self._status_topic = topology.full_name("status")
        self._stop = threading.Event()
        self._requests: queue.Queue[tuple[str, str, list[int] | None]] = queue.Queue()
        self._paused: dict[str, set[int] | None] = {}  # logical topic -> partitions (None: all)
        self._positions: dict[tuple[str, int], int] = {}  # next offset to commit, full names
        self._raw: dict[int, tuple[object, bytes]] = {}
        self._assignment_changed = True
        self.running = threading.Event()

    # --- control, callable from any thread -------------------------------------------
    def stop(self) -> None:
        """Finish the open transaction, leave the group and return from ``run``."""
        self._stop.set()

    def pause(self, topic: str, partitions: list[int] | None = None) -> None:
        """Stop fetching from ``topic`` (logical name), all or some partitions."""
        self._requests.put(("pause", topic, partitions))

    def resume(self, topic: str, partitions: list[int] | None = None) -> None:
        self._requests.put(("resume", topic, partitions))

    # --- the loop ----------------------------------------------------------------------
    def run(self) -> RuntimeCounters:
        admin = make_admin(self.config)
        needed = [
            *self._inputs,
            *(self.topology.full_name(t) for t in self.spec.outputs),
            self._dlq,
            self._status_topic,
        ]
        missing = missing_topics(admin, needed)
        if missing:
            raise MissingTopicsError(
                f"topics missing on {self.config.bootstrap_servers}: {', '.join(missing)}; "
                f"create them with `astraflow topics apply {self.topology.source}`"
            )
        consumer = Consumer(
            self.config.consumer_conf(self.group, **{"session.timeout.ms": self.session_timeout_ms})
        )
        producer = RecordProducer(
            self.config,
            self.codec,
            transactional_id=self.transactional_id,
            **{"transaction.timeout.ms": 60_000},
        )
        self.processor.open(
            ProcessorContext(self.topology, self.config, self.codec, self.component_id,
                             control=self)
        )
        consumer.subscribe(
            list(self._inputs),
            on_assign=self._on_assign,
            on_revoke=self._on_revoke,
            on_lost=self._on_revoke,
        )
        log.info(
            "%s: consuming %s as group %s, transactional id %s",
            self.component_id,
            ", ".join(self._inputs),
            self.group,
            self.transactional_id,
        )
        self.running.set()
        last_status = 0.0
        try:
            while not self._stop.is_set():
                self._apply_pauses(consumer)
                t0 = time.monotonic()
                msgs = consumer.consume(self.spec.max_batch, self.spec.poll_timeout_s)
                t1 = time.monotonic()
                outputs, dead = self._transform(msgs)
                outputs += list(self.processor.flush(now_ms()))
                status_due = time.monotonic() - last_status >= self.topology.status_interval_s
                if not msgs and not outputs and not status_due:
                    self.counters.waiting_s += t1 - t0
                    continue
                self._commit(producer, consumer, outputs, dead, status_due)
                if status_due:
                    last_status = time.monotonic()
                self.counters.busy_s += time.monotonic() - t1
        finally:
            self.running.clear()
            log.info("%s: leaving group %s", self.component_id, self.group)
            consumer.close()
            self.processor.close()
        return self.counters

    def _transform(self, msgs) -> tuple[list[Outgoing], list[DeadLetter]]:
        # records forwarded unchanged are re-sent as the bytes they arrived in; the record is
        # kept alive here so its id cannot be reused by a new record within the batch
        self._raw: dict[int, tuple[object, bytes]] = {}
        outputs: list[Outgoing] = []
        dead: list[DeadLetter] = []
        for m in msgs:
            err = m.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                if err.fatal():
                    raise KafkaException(err)
                log.warning("%s: consumer error: %s", self.component_id, err)
                continue
            topic, part, off = m.topic(), m.partition(), m.offset()
            self._positions[(topic, part)] = off + 1
            self.counters.consumed += 1
            try:
                record = self.codec.decode(m.value(), topic, part, off, expect=self._expect[topic])
                check_record(record)
                incoming = Incoming(
                    self._inputs[topic], part, off, m.key(), record, m.timestamp()[1]
                )
                produced = list(self.processor.process(incoming))
            except (RecordDecodeError, InvalidRecord) as e:
                reason = f"{type(e).__name__}: {e}"
                log.warning(
                    "%s: dead-lettering %s[%d]@%d: %s", self.component_id, topic, part, off, reason
                )
                dead.append(dead_letter(m, self.component_id, reason))
                continue
            outputs += produced
            self._raw[id(record)] = (record, m.value())
        return outputs, dead

    def _commit(self, producer, consumer, outputs, dead, status_due) -> None:
        def produce() -> None:
            for o in outputs:
                expected = self._out_types.get(o.topic)
                if expected is None:
                    raise RuntimeError(
                        f"{self.name} produced to {o.topic!r}, not one of its outputs "
                        f"{self.spec.outputs}"
                    )
                if not isinstance(o.record, expected):
                    raise TypeError(f"{self.name} produced a {type(o.record).__name__} to "
                                    f"{o.topic}, which carries {expected.__name__}")
                topic = self.topology.full_name(o.topic)
                kept = self._raw.get(id(o.record))
                if kept is not None and kept[0] is o.record:
                    producer.produce_raw(topic, kept[1], o.key, o.partition)
                else:
                    producer.produce(topic, o.record, o.key, o.partition)
            for d in dead:
                producer.produce(self._dlq, d, d.raw_key)
            if status_due:
                producer.produce(self._status_topic, self.status(), self.component_id)

        committed = commit_consumed(producer, consumer, produce, self._offsets_to_commit(),
                                    self.component_id)
        if not committed:
            self.counters.aborted += 1
            self._rewind(consumer)
            return
        self.counters.transactions += 1
        self.counters.produced += len(outputs)
        self.counters.dead_lettered += len(dead)

    def _offsets_to_commit(self) -> list[TopicPartition]:
        held = self.processor.held_offsets()
        out = []
        for (topic, part), pos in self._positions.items():
            h = held.get((self._inputs[topic], part))
            out.append(TopicPartition(topic, part, min(pos, h) if h is not None else pos))
        return out

    def _rewind(self, consumer: Consumer) -> None:
        """After an abort: drop held state and go back to the committed offsets."""
        assigned = consumer.assignment()
        self.processor.on_revoke([(self._inputs[tp.topic], tp.partition) for tp in assigned])
        for tp in consumer.committed(assigned, timeout=30):
            if tp.offset >= 0:
                consumer.seek(tp)
            else:
                consumer.seek(TopicPartition(tp.topic, tp.partition, -2))  # earliest
        self._positions.clear()

    # --- rebalance and pause bookkeeping (run on the loop's thread, inside consume) ------
    def _on_assign(self, consumer, partitions) -> None:
        self._assignment_changed = True
        log.info(
            "%s: assigned %s",
            self.component_id,
            ", ".join(f"{p.topic}[{p.partition}]" for p in partitions),
        )

    def _on_revoke(self, consumer, partitions) -> None:
        revoked = [(self._inputs[p.topic], p.partition) for p in partitions]
        self.processor.on_revoke(revoked)
        for p in partitions:
            self._positions.pop((p.topic, p.partition), None)
        self._assignment_changed = True

    def _apply_pauses(self, consumer: Consumer) -> None:
        changed = self._assignment_changed
        while True:
            try:
                op, topic, parts = self._requests.get_nowait()
            except queue.Empty:
                break
            changed = True
            if op == "pause":
                if parts is None:
                    self._paused[topic] = None
                else:
                    current = self._paused.get(topic, set())
                    if current is not None:
                        self._paused[topic] = current | set(parts)
            else:
                if parts is None:
                    self._paused.pop(topic, None)
                elif self._paused.get(topic) is not None:
                    self._paused[topic] -= set(parts)
                else:
                    # resume some of an all-partitions pause: keep the rest paused
                    all_parts = {
                        tp.partition
                        for tp in consumer.assignment()
                        if self._inputs.get(tp.topic) == topic
                    }
                    self._paused[topic] = all_parts - set(parts)
        if not changed:
            return
        self._paused = {t: p for t, p in self._paused.items() if p is None or p}
        self._assignment_changed = False
        to_pause, to_resume = [], []
        for tp in consumer.assignment():
            paused = self._paused.get(self._inputs[tp.topic], set())
            (to_pause if paused is None or tp.partition in paused else to_resume).append(tp)
        if to_pause:
            consumer.pause(to_pause)
        if to_resume:
            consumer.resume(to_resume)

    @property
    def paused_topics(self) -> dict[str, set[int] | None]:
        return dict(self._paused)

    def status(self) -> ComponentStatus:
        c = self.counters
        state = "paused" if self._paused else ("stopping" if self._stop.is_set() else "running")
        own = self.processor.state()
        if own and not self._stop.is_set():
            state = own
        metrics = {
            "runtime/transactions": float(c.transactions),
            "runtime/aborted": float(c.aborted),
            **self.processor.metrics(),
        }
        return ComponentStatus(
            component_id=self.component_id,
            kind="processor",
            host=socket.gethostname(),
            state=state,
            produced=c.produced,
            consumed=c.consumed,
            dead_lettered=c.dead_lettered,
            waiting_s=c.waiting_s,
            busy_s=c.busy_s,
            started_at_ms=c.started_at_ms,
            metrics=metrics,
        )
