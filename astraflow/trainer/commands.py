"""What rank 0 of a trainer group tells the other ranks, over the control channel.

Rank 0 alone talks to Kafka; the others do what it says, in the same order
(``TrainerService``'s rank protocol): train a batch (``TrainStep``), commit the version
whose blobs are being written (``Flush``), or leave (``Stop``). Each is a typed record,
pickled by ``Group.command``; a rank that gets anything else fails at once.
"""

from __future__ import annotations

from dataclasses import dataclass

from astraflow.wire.records import Batch


@dataclass(frozen=True)
class TrainStep:
    """Train on ``batch``, read from ``topic`` partition ``partition`` at ``offset``;
    ``final``: the last step before a clean stop (it records its own state)."""

    batch: Batch
    topic: str
    partition: int
    offset: int
    final: bool = False


@dataclass(frozen=True)
class Flush:
    """Commit the version whose blobs are being written (every rank hands its part)."""


@dataclass(frozen=True)
class Stop:
    """Leave: rank 0 stopped cleanly."""


RankCommand = TrainStep | Flush | Stop

__all__ = ["Flush", "RankCommand", "Stop", "TrainStep"]
