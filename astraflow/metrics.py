"""Where metrics go: a ``MetricSink`` takes one step's figures, named with a slash
namespace (``eval/accuracy``, ``trainer/loss``, ``rollout/reward_mean``).

* ``StatusSink``: a ``ComponentStatus`` record on the run's status topic, which
  ``astraflow up`` and the dashboards read.
* ``JsonlSink``: one JSON line per step in a local file (benches, offline analysis).
* ``TensorBoardSink``: scalar series in a TensorBoard event file (written here, no
  TensorFlow or tensorboard package needed to write it).
* ``WandbSink``: the same series to Weights & Biases, when ``wandb`` is installed.

And ``PrometheusExporter``: a component's counters, gauges and staleness histogram at
``http://HOST:PORT/metrics``, started by the transactional loop when
``ASTRAFLOW_METRICS_PORT`` is set (``astraflow up`` sets it per process from the topology's
``metrics_port``).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Protocol

from astraflow.errors import AstraflowError
from astraflow.wire.records import ComponentStatus

# the cumulative counts of groups dropped as too stale, by the stage that drops them: one
# definition for `astraflow status`, `up`'s progress line and summary, and Prometheus
STALENESS_DROPS = {"filter": "staleness/dropped", "batcher": "batcher/dropped_stale",
                   "trainer": "trainer/stale_dropped_total"}


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


log = logging.getLogger("astraflow.metrics")


# --- TensorBoard event files -------------------------------------------------------------
def _crc32c_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord framing uses it."""
    c = 0xFFFFFFFF
    for b in data:
        c = _CRC_TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked_crc(data: bytes) -> int:
    c = crc32c(data)
    return (((c >> 15) | (c << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    n &= (1 << 64) - 1
    out = bytearray()
    while True:
        b, n = n & 0x7F, n >> 7
        out.append(b | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int, payload: bytes) -> bytes:
    return _varint(number << 3 | wire) + payload


def _delimited(number: int, payload: bytes) -> bytes:
    return _field(number, 2, _varint(len(payload)) + payload)


def tf_event(wall_time: float, step: int, scalars: Mapping[str, float] | None = None,
             file_version: str | None = None) -> bytes:
    """One ``tensorflow.Event`` protobuf: a file header, or scalar summaries at ``step``."""
    out = _field(1, 1, struct.pack("<d", wall_time)) + _field(2, 0, _varint(step))
    if file_version is not None:
        out += _delimited(3, file_version.encode())
    if scalars:
        values = b"".join(_delimited(1, _delimited(1, tag.encode())
                                     + _field(2, 5, struct.pack("<f", float(v))))
                          for tag, v in scalars.items())
        out += _delimited(5, values)
    return out


def tf_record(data: bytes) -> bytes:
    """``data`` framed as a TFRecord: length, its masked CRC, data, its masked CRC."""
    length = struct.pack("<Q", len(data))
    return (length + struct.pack("<I", _masked_crc(length)) + data
            + struct.pack("<I", _masked_crc(data)))


class TensorBoardSink:
    """Each step's metrics as scalars in a TensorBoard event file under ``log_dir``
    (``tensorboard --logdir`` shows them; the slash namespaces become its groups)."""

    def __init__(self, log_dir: str | Path):
        self.dir = Path(log_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = self.dir / f"events.out.tfevents.{int(now)}.{socket.gethostname()}"
        with self.path.open("ab") as f:
            f.write(tf_record(tf_event(now, 0, file_version="brain.Event:2")))

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        scalars = {k: float(v) for k, v in metrics.items() if v == v}  # NaN: nothing to draw
        if scalars:
            with self.path.open("ab") as f:
                f.write(tf_record(tf_event(time.time(), step, scalars)))


class WandbSink:
    """Each step's metrics logged to a Weights & Biases run (``wandb`` must be installed
    and configured: ``WANDB_API_KEY`` or ``wandb login``, or ``WANDB_MODE=offline``)."""

    def __init__(self, project: str, run_name: str, config: Mapping[str, Any] | None = None):
        try:
            import wandb
        except ImportError:
            raise AstraflowError("metrics to W&B need wandb: python3 -m pip install wandb"
                                 ) from None
        self.run = wandb.init(project=project, name=run_name, config=dict(config or {}))

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        self.run.log({k: float(v) for k, v in metrics.items()}, step=step)


class MultiSink:
    """Several sinks as one."""

    def __init__(self, sinks: list[MetricSink]):
        self.sinks = sinks

    def emit(self, step: int, metrics: Mapping[str, float]) -> None:
        for s in self.sinks:
            s.emit(step, metrics)

METRICS_PORT_ENV = "ASTRAFLOW_METRICS_PORT"
# staleness in weight versions: how old a group's oldest token is when it is judged
STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 12, 16, 32, 64)


def prometheus_name(metric: str) -> str:
    """``trainer/loss`` -> ``astraflow_trainer_loss`` (Prometheus allows [a-zA-Z0-9_:])."""
    return "astraflow_" + re.sub(r"[^a-zA-Z0-9_]", "_", metric).strip("_")


class PrometheusExporter:
    """Serves one component's figures for Prometheus to scrape.

    Counters are read live from ``counters`` (a ``RuntimeCounters``); the weight versions,
    the component's own metrics (``trainer/loss`` becomes ``astraflow_trainer_loss``) and
    the lag per input partition are those of the last ``update`` (each status the loop
    writes). ``observe_staleness`` feeds the staleness histogram."""

    def __init__(self, component_id: str, kind: str | None, counters: Any, port: int,
                 addr: str = "0.0.0.0"):
        from prometheus_client import CollectorRegistry, start_http_server

        self.component_id, self.kind, self.counters = component_id, kind, counters
        self._lock = threading.Lock()
        self._versions: dict[str, int] = {}
        self._metrics: dict[str, float] = {}
        self._lag: dict[tuple[str, int], int] = {}
        self._buckets = [0] * (len(STALENESS_BUCKETS) + 1)
        self._stale_sum = 0.0
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(self)
        self.server, self._thread = start_http_server(port, addr, registry=self.registry)
        self.port = self.server.server_port
        _EXPORTERS.append(self)
        log.info("%s: Prometheus metrics on http://%s:%d/metrics", component_id, addr,
                 self.port)

    def update(self, status: ComponentStatus, lag: Mapping[tuple[str, int], int]) -> None:
        with self._lock:
            self.kind = status.kind
            self._versions = dict(status.weight_versions)
            self._metrics = dict(status.metrics)
            self._lag = dict(lag)

    def observe_staleness(self, value: float) -> None:
        i = next((k for k, b in enumerate(STALENESS_BUCKETS) if value <= b),
                 len(STALENESS_BUCKETS))
        with self._lock:
            self._buckets[i] += 1
            self._stale_sum += value

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import (
            CounterMetricFamily,
            GaugeMetricFamily,
            HistogramMetricFamily,
        )

        if self.kind is None:  # no status yet: the kind label is not known
            return
        labels = ["component", "kind"]
        me = [self.component_id, self.kind]
        c = self.counters
        for name, doc, value in (
                ("records_in", "records consumed", c.consumed),
                ("records_out", "records produced (committed)", c.produced),
                ("dead_lettered", "records sent to the dead-letter topic", c.dead_lettered),
                ("transactions", "transactions committed", c.transactions),
                ("aborted", "transactions aborted", c.aborted),
                ("waiting_seconds", "seconds spent waiting for input", c.waiting_s),
                ("busy_seconds", "seconds spent working on input", c.busy_s)):
            fam = CounterMetricFamily(f"astraflow_{name}", doc, labels=labels)
            fam.add_metric(me, float(value))
            yield fam
        with self._lock:
            versions, metrics, lag = self._versions, self._metrics, self._lag
            buckets, total = list(self._buckets), self._stale_sum
        fam = GaugeMetricFamily("astraflow_weight_version", "newest weight version in use",
                                labels=[*labels, "policy"])
        for policy, v in versions.items():
            fam.add_metric([*me, policy], float(v))
        yield fam
        fam = GaugeMetricFamily("astraflow_consumer_lag", "records behind the end of an "
                                "input partition", labels=[*labels, "topic", "partition"])
        for (topic, part), n in sorted(lag.items()):
            fam.add_metric([*me, topic, str(part)], float(n))
        yield fam
        acc, cumulative = 0, []
        for bound, n in zip([*map(str, STALENESS_BUCKETS), "+Inf"], buckets):
            acc += n
            cumulative.append((bound, float(acc)))
        fam = HistogramMetricFamily("astraflow_staleness", "staleness of the groups judged, "
                                    "in weight versions", labels=labels)
        fam.add_metric(me, cumulative, sum_value=total)
        yield fam
        fam = CounterMetricFamily("astraflow_stale_dropped_groups", "groups dropped as too "
                                  "stale, by the stage that dropped them",
                                  labels=[*labels, "stage"])
        for stage, key in STALENESS_DROPS.items():
            if key in metrics:
                fam.add_metric([*me, stage], float(metrics[key]))
        yield fam
        for key, value in sorted(metrics.items()):
            fam = GaugeMetricFamily(prometheus_name(key), f"the component's {key}",
                                    labels=labels)
            fam.add_metric(me, float(value))
            yield fam

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        if self in _EXPORTERS:
            _EXPORTERS.remove(self)


_EXPORTERS: list[PrometheusExporter] = []


def observe_staleness(value: float) -> None:
    """Count one staleness in this process's Prometheus histogram (if one is served)."""
    for e in _EXPORTERS:
        e.observe_staleness(value)


def exporter_from_env(component_id: str, kind: str | None, counters: Any,
                      env: Callable[[str], str | None] = os.environ.get
                      ) -> PrometheusExporter | None:
    """A ``PrometheusExporter`` on ``$ASTRAFLOW_METRICS_PORT`` (0: any free port), or None
    when it is not set."""
    raw = env(METRICS_PORT_ENV)
    if raw is None or raw == "":
        return None
    try:
        port = int(raw)
    except ValueError:
        raise AstraflowError(f"{METRICS_PORT_ENV}={raw!r}: must be a port number") from None
    try:
        return PrometheusExporter(component_id, kind, counters, port)
    except OSError as e:
        raise AstraflowError(f"{METRICS_PORT_ENV}={port}: cannot serve metrics there: {e}"
                             ) from None


__all__ = ["JsonlSink", "MetricSink", "MultiSink", "PrometheusExporter", "StatusSink",
           "TensorBoardSink", "WandbSink", "crc32c", "exporter_from_env", "observe_staleness",
           "prometheus_name"]
