"""The processor runtime: a ``Processor``'s decision logic inside the transactional loop.

Every micro-batch is one Kafka transaction holding the processor's output records, any
dead letters, an optional status record, and the consumer offsets of the inputs it
consumed (``astraflow.kafka.loop``). A crash anywhere before the commit aborts all of it
and the inputs are consumed again; ``read_committed`` readers see each output exactly
once. The transactional id is ``<group>.<instance>``: a restarted instance with the same
id fences its dead predecessor and aborts its open transaction at once.
"""

from __future__ import annotations

import logging
import socket

from confluent_kafka import Message

from astraflow.config.topology import Topology, TopologyError
from astraflow.dataflow import PROCESSOR_KINDS, Incoming, InvalidRecord, Outgoing, Processor
from astraflow.dataflow.base import ProcessorContext
from astraflow.dataflow.event_time import StreamClock
from astraflow.kafka.clients import dead_letter, make_codec_for
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.instance import default_instance
from astraflow.kafka.loop import (
    Checkpoint,
    LoopSpec,
    RecordTooLarge,
    RuntimeCounters,
    TransactionalLoop,
)
from astraflow.wire.codec import RecordDecodeError
from astraflow.wire.records import ComponentStatus, DeadLetter, now_ms
from astraflow.wire.validate import problem_finder

log = logging.getLogger("astraflow.runtime")

# how long a processor's transaction stays open while records keep arriving (the loop
# commits sooner when a poll finds nothing more, or at max_batch inputs): Kafka Streams'
# commit.interval.ms under exactly-once
COMMIT_INTERVAL_S = 0.1


def loop_spec(topology: Topology, component_id: str, group: str, transactional_id: str,
              inputs: list[str], outputs: list[str], **extra) -> LoopSpec:
    """The ``LoopSpec`` of a component of ``topology`` (logical topic names in), with
    record-size limits from the topics' ``max.message.bytes``."""
    full = topology.full_name
    produced = [*outputs, "dlq", "status"]
    max_bytes = {full(t): topology.max_message_bytes(t) for t in produced}
    # max.partition.fetch.bytes stays at its 1 MiB default, even for inputs that accept
    # larger records: the broker returns a first record batch over the limit whole, and
    # larger per-partition fetches arrive in bursts the loop waits for (0.7x the records/s
    # of 1 MiB fetches in bench/processor_throughput.py)
    big = max(max(topology.max_message_bytes(t) for t in inputs), 52_428_800)
    extra["consumer_options"] = {
        "fetch.max.bytes": big, "receive.message.max.bytes": big + 1_048_576,
        **extra.get("consumer_options", {})}
    extra["producer_options"] = {"message.max.bytes": max(max_bytes.values()) + 65_536,
                                 **extra.get("producer_options", {})}
    return LoopSpec(
        component_id=component_id, group=group, transactional_id=transactional_id,
        inputs=[full(t) for t in inputs], outputs=[full(t) for t in outputs],
        dlq=full("dlq"), status_topic=full("status"),
        status_interval_s=topology.status_interval_s, max_bytes=max_bytes,
        topology_source=str(topology.source), **extra)


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
        clock: StreamClock | None = None,
    ):
        if name not in topology.processors:
            raise TopologyError(
                f"no processor named {name!r} in {topology.source} "
                f"(have: {sorted(topology.processors)})"
            )
        self.topology = topology
        self.name = name
        self.spec = topology.processors[name]
        self.config = (config or topology.kafka).effective().for_component(
            f"processor.{name}", topology.run)
        cls = PROCESSOR_KINDS[self.spec.kind]
        self.processor = processor or cls(
            name, self.spec.inputs, self.spec.outputs, cls.Options(**self.spec.options)
        )
        self.instance = instance or default_instance()
        self.component_id = f"{name}/{self.instance}"
        self.group = topology.group_of(name)
        self.transactional_id = f"{self.group}.{self.instance}"
        self.codec = make_codec_for(self.config)
        # event time (replays): set from each input's timestamp, which its outputs keep
        self.clock = clock
        self.counters = RuntimeCounters()
        self._inputs = {topology.full_name(t): t for t in self.spec.inputs}
        # full input topic -> (logical name, record type, its semantic check)
        self._input_of = {full: (t, topology.topic(t).schema_type,
                                 problem_finder(topology.topic(t).schema_type))
                          for full, t in self._inputs.items()}
        # logical output topic -> (full name, record type)
        self._out = {t: (topology.full_name(t), topology.topic(t).schema_type)
                     for t in self.spec.outputs}
        self._decode = self.codec.decode
        self._run = self.processor.process
        self.loop = TransactionalLoop(
            loop_spec(topology, self.component_id, self.group, self.transactional_id,
                      self.spec.inputs, self.spec.outputs, max_batch=self.spec.max_batch,
                      poll_timeout_s=self.spec.poll_timeout_s,
                      commit_interval_s=COMMIT_INTERVAL_S,
                      consumer_options={"session.timeout.ms": session_timeout_ms}),
            self, self.config, self.codec)
        self.running = self.loop.running

    # --- control, callable from any thread -------------------------------------------
    def stop(self) -> None:
        """Finish the open transaction, leave the group and return from ``run``."""
        self.loop.stop()

    def pause(self, topic: str, partitions: list[int] | None = None) -> None:
        """Stop fetching from ``topic`` (logical name), all or some partitions."""
        self.loop.pause(self.topology.full_name(topic), partitions)

    def resume(self, topic: str, partitions: list[int] | None = None) -> None:
        self.loop.resume(self.topology.full_name(topic), partitions)

    @property
    def paused_topics(self) -> dict[str, set[int] | None]:
        return {self._inputs[t]: p for t, p in self.loop.paused.items()}

    def run(self) -> RuntimeCounters:
        self.loop.run()
        return self.counters

    # --- the Work the loop runs ----------------------------------------------------------
    def start(self, loop: TransactionalLoop) -> None:
        self.processor.open(ProcessorContext(self.topology, self.config, self.codec,
                                             self.component_id, control=self))

    def handle(self, msgs: list[Message], cp: Checkpoint) -> None:
        if self.clock is None:
            for m in msgs:
                self._process(m, cp)
            self._flush(cp, 0)
            return
        # event time: the records in time order, and what is due emitted as each arrives,
        # judged at its time, as when they arrived one by one (a backlog judged at its
        # newest record's time would make a batcher drop as stale what it batched live)
        for m in sorted(msgs, key=lambda m: m.timestamp()[1]):
            ts = m.timestamp()[1]
            self.clock.at_record(ts)
            self._process(m, cp, ts)
            self._flush(cp, ts)
        if not msgs:
            self._flush(cp, self.clock.at_stream())

    def _flush(self, cp: Checkpoint, stamp: int) -> None:
        """Add what the processor emits now (at ``stamp`` in event time, else now)."""
        for o in self.processor.flush(stamp or now_ms()):
            try:
                self._add(cp, o, None, stamp)
            except RecordTooLarge as e:  # emitted later than its input: no input to name
                log.warning("%s: dead-lettering an output: %s", self.component_id, e)
                cp.dead_letter(DeadLetter(
                    source_topic=self.topology.full_name(o.topic), partition=-1, offset=-1,
                    component_id=self.component_id, error=f"RecordTooLarge: {e}", raw=b""))

    def _process(self, m: Message, cp: Checkpoint, stamp: int = 0) -> None:
        """One input: decode, check, process, add the outputs (stamped ``stamp``; 0: when
        produced)."""
        # the hot path: every input passes here, so it does each thing once, in place
        topic, part, off, value = m.topic(), m.partition(), m.offset(), m.value()
        name, expect, problem = self._input_of[topic]
        ts = m.timestamp()[1]
        try:
            record = self._decode(value, topic, part, off, expect)
            if problem is not None and (why := problem(record)):
                raise InvalidRecord(f"{expect.__name__}: {why}")
            produced = self._run(Incoming(name, part, off, m.key(), record, ts))
            if type(produced) is not list:  # a generator runs to its end before anything
                produced = list(produced)  # is added: its errors dead-letter the input alone
            mark = len(cp.records)
            try:
                for o in produced:
                    out = self._out.get(o.topic)
                    if out is None or type(o.record) is not out[1]:
                        out = self._check_output(o)
                    # records forwarded unchanged go out as the bytes they arrived in
                    cp.add(out[0], o.record, o.key, o.partition,
                           value if o.record is record else None, stamp)
            except RecordTooLarge:
                cp.rollback(mark)  # none of this input's outputs; the input goes to dlq
                raise
        except (RecordDecodeError, InvalidRecord, RecordTooLarge) as e:
            reason = f"{type(e).__name__}: {e}"
            log.warning("%s: dead-lettering %s[%d]@%d: %s", self.component_id, topic, part, off,
                        reason)
            cp.dead_letter(dead_letter(m, self.component_id, reason))

    def _check_output(self, o: Outgoing) -> tuple[str, type]:
        """Where ``o`` goes (full topic name and record type), or why it may not."""
        out = self._out.get(o.topic)
        if out is None:
            raise RuntimeError(f"{self.name} produced to {o.topic!r}, not one of its outputs "
                               f"{self.spec.outputs}")
        if not isinstance(o.record, out[1]):
            raise TypeError(f"{self.name} produced a {type(o.record).__name__} to {o.topic}, "
                            f"which carries {out[1].__name__}")
        return out

    def _add(self, cp: Checkpoint, o: Outgoing, raw: bytes | None, stamp: int = 0) -> None:
        cp.add(self._check_output(o)[0], o.record, o.key, o.partition, raw, stamp)

    def held_offsets(self) -> dict[tuple[str, int], int]:
        full = self.topology.full_name
        return {(full(t), p): o for (t, p), o in self.processor.held_offsets().items()}

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        self.processor.on_revoke([(self._inputs[t], p) for t, p in partitions])

    def close(self) -> None:
        self.processor.close()

    def status(self) -> ComponentStatus:
        c = self.counters
        stopping = self.loop.stopping
        state = "paused" if self.loop.paused else ("stopping" if stopping else "running")
        own = self.processor.state()
        if own and not stopping:
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
            weight_versions=self.processor.weight_versions(),
            metrics=metrics,
        )


__all__ = ["ProcessorRuntime", "RuntimeCounters", "loop_spec"]
