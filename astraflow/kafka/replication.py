"""How many replicas a topic gets, and how many must be in sync, from the cluster's size.

A topic whose replication factor nothing sets gets ``min(3, brokers)``; from three
replicas on, ``min.insync.replicas`` is 2, so that an ``acks=all`` write (every AstraFlow
producer's) survives the loss of one broker and is refused rather than kept by one
replica alone. Below three replicas it is 1: a single broker or two must stay writable.
"""

from __future__ import annotations

from astraflow.errors import AstraflowError

MAX_DEFAULT_REPLICAS = 3
MIN_ISR = "min.insync.replicas"


class ReplicationError(AstraflowError, ValueError):
    """A replication setting the cluster cannot meet (the message names the key)."""


def default_min_isr(replicas: int) -> int:
    """``min.insync.replicas`` for a topic of ``replicas`` replicas: 2 from 3 on, else 1."""
    return 2 if replicas >= 3 else 1


def replication(brokers: int, explicit: int | None = None, key: str = "replication_factor",
                configs: dict[str, str] | None = None, min_isr_key: str = MIN_ISR,
                ) -> tuple[int, dict[str, str]]:
    """The replication factor for a cluster of ``brokers`` brokers (``explicit`` when
    given, else ``min(3, brokers)``) and ``configs`` with ``min.insync.replicas`` added
    unless they set it. A ``ReplicationError`` naming ``key`` (or ``min_isr_key``) when the
    cluster is too small for them."""
    if brokers < 1:
        raise ReplicationError("the cluster lists no broker: is it up?")
    if explicit is not None and explicit > brokers:
        raise ReplicationError(
            f"{key}: replication factor {explicit} needs {explicit} brokers, the cluster "
            f"has {brokers} (leave it unset: the default is min(3, brokers))")
    replicas = explicit if explicit is not None else min(MAX_DEFAULT_REPLICAS, brokers)
    out = dict(configs or {})
    if MIN_ISR in out:
        if not out[MIN_ISR].isdigit() or int(out[MIN_ISR]) > replicas:
            raise ReplicationError(
                f"{min_isr_key}: {out[MIN_ISR]} is more than the topic's {replicas} "
                "replicas (no write would ever be acknowledged)")
    else:
        out[MIN_ISR] = str(default_min_isr(replicas))
    return replicas, out
