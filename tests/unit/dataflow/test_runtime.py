"""The processor runtime without a broker: the runtime is built, never run, and handed messages
(on a real broker: tests/integration/dataflow/test_runtime.py)."""

from __future__ import annotations

from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.wire.records import Task


def task(i: int) -> Task:
    return Task(task_id=f"t{i}", prompt_id=f"p{i}", workflow="single_turn",
                payload=f'{{"i": {i}}}', source="test")


def test_a_generator_processor_that_fails_midway_dead_letters_its_input_alone():
    """The hot path runs a processor's outputs to their end before adding any: a process()
    generator that yields one output and then raises leaves only the dead letter (no
    broker: the runtime is built, never run)."""
    from confluent_kafka import Message

    from astraflow.config.topology import parse_topology
    from astraflow.dataflow.base import Outgoing
    from astraflow.wire.codec import SingleObjectCodec
    from astraflow.wire.validate import InvalidRecord

    topo = parse_topology({
        "run": "gen", "kafka": {"bootstrap_servers": "127.0.0.1:1"},
        "topics": {"tasks.source": {}, "tasks": {}},
        "processors": {"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                               "outputs": ["tasks"]}}})
    runtime = ProcessorRuntime(topo, "fwd", instance="x")

    def half_then_fail(msg):
        yield Outgoing("tasks", msg.record, key=msg.key)
        raise InvalidRecord("no second half")

    runtime._run = half_then_fail
    value = SingleObjectCodec().encode(task(1))
    msgs = [Message(topic="gen.tasks.source", partition=0, offset=i, key=b"k", value=value,
                    timestamp=(1, 5)) for i in range(2)]
    cp = runtime.loop.checkpoint()
    runtime.handle(msgs, cp)
    assert [r[0] for r in cp.records] == ["gen.dlq", "gen.dlq"]
    assert (cp.outputs, cp.dead) == (0, 2)

