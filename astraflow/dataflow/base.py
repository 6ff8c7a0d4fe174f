"""What a stream processor is: decision logic between topics, free of Kafka.

A processor gets decoded records (``Incoming``) and returns records to produce
(``Outgoing``). The runtime (``astraflow.dataflow.runtime``) does the consuming, producing,
transactions and dead-lettering, so a processor's logic is tested by calling its methods.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

from pydantic import BaseModel

from astraflow.config.processors import NoOptions
from astraflow.wire.records import Record


@dataclass(slots=True)  # one per input record: slots make it cheaper to build and read
class Incoming:
    topic: str  # logical topic name (no run prefix)
    partition: int
    offset: int
    key: bytes | None
    record: Record
    timestamp_ms: int = 0


@dataclass(slots=True)
class Outgoing:
    topic: str  # logical topic name
    record: Record
    key: str | bytes | None = None
    partition: int | None = None


class ProcessorControl(Protocol):
    """What a processor may ask of its runtime: stop or restart fetching an input topic."""

    def pause(self, topic: str, partitions: list[int] | None = None) -> None: ...

    def resume(self, topic: str, partitions: list[int] | None = None) -> None: ...


@dataclass
class ProcessorContext:
    """What the runtime hands a processor when it opens: for side readers of other topics."""

    topology: Any  # astraflow.config.topology.Topology
    config: Any  # astraflow.kafka.config.KafkaConfig
    codec: Any  # astraflow.wire.codec.Codec
    component_id: str
    control: ProcessorControl | None = None  # pause/resume of the inputs (logical names)


@dataclass(frozen=True)
class SideAccess:
    """What a processor reaches beside consuming its inputs and producing its outputs, for
    least-privilege ACLs (``astraflow.security.acls``): topics it reads without a consumer group
    (logical names), consumer groups whose committed offsets it reads (full ids: lag), and
    the assign-only reader groups its readers name (``astraflow.kafka.config``)."""

    reads: tuple[str, ...] = ()
    lag_groups: tuple[str, ...] = ()
    reader_groups: tuple[str, ...] = ()


class Processor:
    """Base class of every processor kind.

    Subclasses set ``kind`` and optionally an ``Options`` model (validated from the
    topology's ``options:``), and implement ``process``. Stateful processors that hold
    records back across transactions report the oldest held offset per partition in
    ``held_offsets`` so the runtime never commits past them, and drop what they hold for
    revoked partitions in ``on_revoke``.
    """

    kind: ClassVar[str]
    Options: ClassVar[type[BaseModel]] = NoOptions

    def __init__(self, name: str, inputs: list[str], outputs: list[str], options: Any = None):
        self.name = name
        self.inputs = inputs
        self.outputs = outputs
        self.options = options if options is not None else self.Options()

    def open(self, context: ProcessorContext) -> None:
        """Called once before consuming; open side readers (e.g. weight versions) here."""

    def close(self) -> None:
        """Called once after the last transaction."""

    def process(self, msg: Incoming) -> Iterable[Outgoing]:
        raise NotImplementedError

    def flush(self, now_ms: int) -> Iterable[Outgoing]:
        """Called after every micro-batch and when idle: emit what is due."""
        return ()

    def held_offsets(self) -> dict[tuple[str, int], int]:
        """(logical topic, partition) -> oldest offset still held in memory."""
        return {}

    def on_revoke(self, partitions: list[tuple[str, int]]) -> None:
        """Partitions were taken away: forget what is held for them (it will be redelivered)."""

    def metrics(self) -> dict[str, float]:
        """Slash-namespaced figures reported on ``status``."""
        return {}

    def state(self) -> str | None:
        """A word for ``ComponentStatus.state`` (e.g. "holding"); None keeps the runtime's."""
        return None

    def weight_versions(self) -> dict[str, int]:
        """Policy -> the newest weight version this processor judges by (reported on
        ``status`` and as ``astraflow_weight_version``); none by default."""
        return {}

    def side_access(self, topology: Any) -> SideAccess:
        """What ``open`` and the side readers reach beside the inputs and outputs (a
        subclass that reads another topic, or a group's lag, says so here); none by
        default."""
        return SideAccess()
