"""Data algorithms as stream processors."""

from astraflow.dataflow.base import Incoming, InvalidRecord, Outgoing, Processor
from astraflow.dataflow.batcher import Batcher
from astraflow.dataflow.passthrough import Passthrough
from astraflow.dataflow.router import PolicyRouter
from astraflow.dataflow.staleness import StalenessFilter

PROCESSOR_KINDS: dict[str, type[Processor]] = {
    cls.kind: cls for cls in (Passthrough, StalenessFilter, PolicyRouter, Batcher)
}

__all__ = ["Incoming", "InvalidRecord", "Outgoing", "Processor", "PROCESSOR_KINDS"]
