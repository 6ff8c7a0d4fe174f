"""What a transactional loop runs as (``LoopSpec``) and what it counts (``RuntimeCounters``):
shared by the loop and the objects it is made of (intake, pauses, transactions)."""

from __future__ import annotations

from dataclasses import dataclass, field

from astraflow.wire.records import now_ms


@dataclass
class RuntimeCounters:
    """What a component's loop has done since it started (the status record's figures)."""

    consumed: int = 0
    produced: int = 0
    dead_lettered: int = 0
    transactions: int = 0
    aborted: int = 0
    busy_s: float = 0.0
    waiting_s: float = 0.0
    started_at_ms: int = field(default_factory=now_ms)


@dataclass
class LoopSpec:
    """Who the loop runs as and what it reads and writes (full topic names)."""

    component_id: str
    group: str
    transactional_id: str
    inputs: list[str]
    outputs: list[str]
    dlq: str
    status_topic: str
    max_batch: int = 1  # inputs per transaction, at most
    poll_timeout_s: float = 0.5
    # None: each poll waits up to poll_timeout_s for max_batch records, and each poll's
    # records make one transaction. A number (in seconds): a poll returns as soon as records
    # arrive, and the transaction stays open across polls (its records sent to the broker
    # meanwhile) until it holds max_batch inputs, its first input is this old, or a poll
    # finds nothing more: low latency at light load, the commit's cost shared at high load.
    # Unless keeps_position, the next records are made while the broker completes a commit.
    commit_interval_s: float | None = None
    status_interval_s: float = 5.0
    consumer_options: dict[str, object] = field(default_factory=dict)
    producer_options: dict[str, object] = field(default_factory=dict)
    # the work's state has consumed up to its positions and cannot be rolled back: after an
    # abort the same checkpoint is sent again; after a rebalance it resumes at its positions
    keeps_position: bool = False
    max_bytes: dict[str, int] = field(default_factory=dict)  # topic -> max.message.bytes
    topology_source: str = "<topology>"


__all__ = ["LoopSpec", "RuntimeCounters"]
