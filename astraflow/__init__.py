"""AstraFlow: asynchronous, dataflow-oriented RL for (multi-)agentic LLMs over Apache Kafka.

The public API: typed records and their codec (``astraflow.wire``), topology loading
(``astraflow.config``), the Kafka client config (``astraflow.kafka``), and the processor
interface (``astraflow.dataflow``). Components with heavy dependencies (torch) live in
their own packages: ``astraflow.weights``, ``astraflow.trainer``, ``astraflow.raas``.
docs/architecture.md ("Code layout") gives every package and the layer order.
"""

from astraflow.config.topology import Topology, TopologyError, load_topology
from astraflow.dataflow import Incoming, InvalidRecord, Outgoing, Processor
from astraflow.kafka.config import KafkaConfig
from astraflow.wire.codec import Codec, RecordDecodeError, make_codec
from astraflow.wire.records import (
    Batch,
    BlobChunk,
    ComponentStatus,
    DeadLetter,
    ScalingAdvice,
    Sequence,
    Task,
    TrajectoryGroup,
    WeightManifest,
)

__version__ = "0.1.0"

__all__ = [
    "Batch",
    "BlobChunk",
    "Codec",
    "ComponentStatus",
    "DeadLetter",
    "Incoming",
    "InvalidRecord",
    "KafkaConfig",
    "Outgoing",
    "Processor",
    "RecordDecodeError",
    "ScalingAdvice",
    "Sequence",
    "Task",
    "Topology",
    "TopologyError",
    "TrajectoryGroup",
    "WeightManifest",
    "load_topology",
    "make_codec",
]
