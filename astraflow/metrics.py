"""Where metrics go: a ``MetricSink`` takes one step's figures, named with a slash
namespace (``eval/accuracy``, ``trainer/loss``, ``rollout/reward_mean``).

* ``StatusSink``: a ``ComponentStatus`` record on the run's status topic, which
  ``astraflow up`` and the dashboards read.
* ``JsonlSink``: one JSON line per step in a local file (benches, offline analysis).
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol

from astraflow.records import ComponentStatus


class MetricSink(Protocol):
    """Something that records the metrics of one step (a weight version, a batch...)."""

    def emit(self, step: int, metrics: Mapping[str, float]) -> None: ...


class StatusSink:
    """Each step's metrics as a ``ComponentStatus`` of ``component`` on ``topic``, the step
    being ``policy``'s weight version; flushed at once (a status is rare and small)."""

    def __init__(self, producer: Any, topic: str, component: str, kind: str, policy: str):
        self.producer = producer
        self.topic = topic
        self.component = component
        self.kind = kind
        self.policy = policy

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        status = ComponentStatus(
            component_id=self.component, kind=self.kind, host=socket.gethostname(),
            policy=self.policy, weight_versions={self.policy: step},
            metrics={k: float(v) for k, v in metrics.items()})
        self.producer.produce(self.topic, status, key=self.component)
        self.producer.flush()


class JsonlSink:
    """Each step as one line ``{"step", "time", "metrics"}`` appended to ``path``."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        line = {"step": step, "time": time.time(),
                "metrics": {k: float(v) for k, v in metrics.items()}}
        with self.path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(line, sort_keys=True) + "\n")


__all__ = ["JsonlSink", "MetricSink", "StatusSink"]
