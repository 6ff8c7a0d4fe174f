"""Copies every input record to every output topic, key kept."""

from __future__ import annotations

from collections.abc import Iterable

from astraflow.dataflow.base import Incoming, Outgoing, Processor


class Passthrough(Processor):
    """Forwards records unchanged: topic bridging, mirroring, and the runtime's test bed."""

    kind = "passthrough"

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        record, key, outputs = msg.record, msg.key, self.outputs
        if len(outputs) == 1:
            return [Outgoing(outputs[0], record, key)]
        return [Outgoing(topic, record, key) for topic in outputs]
