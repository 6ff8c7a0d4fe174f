"""Data algorithms as stream processors."""

from astraflow.dataflow.base import Incoming, InvalidRecord, Outgoing, Processor
from astraflow.dataflow.passthrough import Passthrough

PROCESSOR_KINDS: dict[str, type[Processor]] = {cls.kind: cls for cls in (Passthrough,)}

__all__ = ["Incoming", "InvalidRecord", "Outgoing", "Processor", "PROCESSOR_KINDS"]
