"""``replay process``: a processor chain run again over a run's recorded trajectories.

The chain is every processor downstream of ``trajectories.raw`` in a topology (the run's
own, or another file with ``--chain``, with ``--set`` overrides such as another staleness
bound). The recorded range of ``trajectories.raw`` is copied into a new run (resumably, as
``replay train`` copies batches), and each processor of the chain runs in this process in
the ordinary transactional runtime, writing the new run's topics exactly once.

The processors run in event time: each record is judged as of its recorded timestamp, which
its outputs keep, and the weight versions come from the source run's ``weights.<policy>``
as they stood at that time (``astraflow.dataflow.event_time``; with a public key, only the
manifests signed by its key: see ``astraflow.replay.ranges``). A processor stops once every
processor upstream of it has stopped and it has read its inputs to their end; what it holds
then (a batcher's unfinished batch) stays uncommitted, as it would in a live run.
"""

from __future__ import annotations

import inspect
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from astraflow.config.topology import Topology, TopologyError, parse_topology
from astraflow.dataflow import PROCESSOR_KINDS
from astraflow.dataflow.event_time import StreamClock, VersionsAtTime
from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.lag import LagReader
from astraflow.kafka.offsets import Offsets
from astraflow.replay.ranges import ReplayError, report_refused

ROOT = "trajectories.raw"


# --- the chain: plain logic ---------------------------------------------------------------
def apply_sets(doc: dict[str, Any], sets: list[str]) -> dict[str, Any]:
    """``doc`` with each ``KEY.PATH=VALUE`` set (VALUE read as YAML: 8, 0.5, [a, b], x)."""
    for item in sets:
        path, sep, text = item.partition("=")
        keys = [k for k in path.strip().split(".") if k]
        if not sep or not keys:
            raise ReplayError(f"--set {item!r}: write KEY.PATH=VALUE, e.g. "
                              "policies.actor.max_staleness=8")
        node = doc
        for k in keys[:-1]:
            child = node.get(k) if isinstance(node, dict) else None
            if child is None:
                child = node[k] = {}
            if not isinstance(child, dict):
                raise ReplayError(f"--set {item!r}: {k} is not a mapping in the topology")
            node = child
        node[keys[-1]] = yaml.safe_load(text)
    return doc


def load_chain_topology(path: str | Path, sets: list[str], run: str) -> Topology:
    """The topology of the chain: ``path`` with ``sets`` applied, as run ``run``."""
    try:
        doc = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise TopologyError(f"{path}: cannot read the chain's topology: {e}") from None
    if not isinstance(doc, dict):
        raise TopologyError(f"{path}: expected a mapping at the top level")
    doc = apply_sets(doc, sets)
    doc["run"] = run
    return parse_topology(doc, source=f"{path} (with --set)" if sets else str(path))


def chain_of(topo: Topology, root: str = ROOT) -> list[str]:
    """The processors downstream of ``root``, each after every processor that writes one
    of its inputs (the topology's order among equals)."""
    reached, chain = {root}, []
    grew = True
    while grew:
        grew = False
        for name, spec in topo.processors.items():
            if name not in chain and any(t in reached for t in spec.inputs):
                chain.append(name)
                reached.update(spec.outputs)
                grew = True
    if not chain:
        raise ReplayError(f"{topo.source}: no processor reads {root} (nothing to replay)")
    writers = {t: n for n in chain for t in topo.processors[n].outputs}
    ordered: list[str] = []

    def visit(name: str, seen: tuple[str, ...]) -> None:
        if name in ordered or name in seen:
            return
        for t in topo.processors[name].inputs:
            if t in writers and writers[t] != name:
                visit(writers[t], (*seen, name))
        ordered.append(name)

    for name in chain:
        visit(name, ())
    return ordered


def upstream_of(topo: Topology, chain: list[str]) -> dict[str, set[str]]:
    """Per processor of ``chain``, the processors of ``chain`` that write its inputs."""
    return {n: {m for m in chain if m != n and
                set(topo.processors[m].outputs) & set(topo.processors[n].inputs)}
            for n in chain}


def caught_up(positions: dict[tuple[str, int], int],
              watermarks: dict[str, dict[int, tuple[int, int]]]) -> bool:
    """Whether a consumer at ``positions`` (``(topic, partition) -> next offset``, -1:
    none read) has read every input partition to its end (an empty one counts as read)."""
    for topic, marks in watermarks.items():
        for p, (low, high) in marks.items():
            if high > low and positions.get((topic, p), -1) < high:
                return False
    return True


# --- running it -----------------------------------------------------------------------------
@dataclass
class Figures:
    """What one processor did: its runtime's counters and its own metrics."""

    consumed: int = 0
    produced: int = 0
    dead_lettered: int = 0
    metrics: dict[str, float] = field(default_factory=dict)


def version_history(config: KafkaConfig, src: Topology, policies: list[str],
                    verifier: Any = None, dlq: str | None = None
                    ) -> dict[str, list[tuple[int, int]]]:
    """Per policy, ``(timestamp_ms, version)`` of each manifest the source run recorded.
    With a ``verifier`` (signed weights) a manifest it refuses is left out: printed with
    the reason and, given a ``dlq`` topic, dead-lettered there with where it was read."""
    from astraflow.kafka.table import TopicReader
    from astraflow.weights.signing import refusal
    from astraflow.wire.records import WeightManifest

    out: dict[str, list[tuple[int, int]]] = {}
    offsets = Offsets(config)
    for policy in policies:
        topic = src.full_name(f"weights.{policy}")
        try:
            offsets.partitions(topic)
        except Exception:  # noqa: BLE001 - a policy the source run never trained
            continue
        reader = TopicReader(config, topic, WeightManifest, client_id="replay-versions")
        try:
            entries = [e for e in reader.catch_up(60.0)
                       if e.value is not None and e.value.policy == policy]
        finally:
            reader.close()
        refused = {id(e): why for e in entries if (why := refusal(verifier, e.value))}
        report_refused(config, topic, [(e.value, refused[id(e)], (e.partition, e.offset))
                                       for e in entries if id(e) in refused], dlq)
        out[policy] = [(e.timestamp_ms, e.value.version) for e in entries
                       if id(e) not in refused]
    return out


def make_processor(topo: Topology, name: str, versions: VersionsAtTime):
    """Processor ``name`` of ``topo``, judging weight versions by ``versions``."""
    spec = topo.processors[name]
    cls = PROCESSOR_KINDS[spec.kind]
    options = cls.Options(**spec.options)
    if "versions" in inspect.signature(cls.__init__).parameters:
        return cls(name, spec.inputs, spec.outputs, options, versions=versions)
    return cls(name, spec.inputs, spec.outputs, options)


class ChainRun:
    """The chain's runtimes, one thread each, stopped in order once each is done."""

    def __init__(self, topo: Topology, chain: list[str], config: KafkaConfig,
                 history: dict[str, list[tuple[int, int]]]):
        self.topo, self.chain = topo, chain
        self.upstream = upstream_of(topo, chain)
        self.runtimes: dict[str, ProcessorRuntime] = {}
        for name in chain:
            clock = StreamClock()
            self.runtimes[name] = ProcessorRuntime(
                topo, name, instance="replay", config=config, clock=clock,
                processor=make_processor(topo, name, VersionsAtTime(clock, history)))
        self.threads: dict[str, threading.Thread] = {}
        self.errors: dict[str, BaseException] = {}
        self.lag = LagReader(config)

    def run(self, progress: Callable[[str], None] | None = None,
            poll_s: float = 0.5) -> dict[str, Figures]:
        """Run the chain to its end; what each processor did."""
        for name, rt in self.runtimes.items():
            t = threading.Thread(target=self._run_one, args=(name, rt),
                                 name=f"replay-{name}", daemon=True)
            self.threads[name] = t
            t.start()
        stopped: set[str] = set()
        last = 0.0
        try:
            while len(stopped) < len(self.chain):
                for name in self.chain:
                    if name not in stopped and self._done(name, stopped):
                        self._stop(name)
                        stopped.add(name)
                if self.errors:
                    name, e = next(iter(self.errors.items()))
                    raise ReplayError(f"processor {name} failed: {type(e).__name__}: {e}")
                if progress is not None and time.monotonic() - last >= 2.0:
                    progress(self.progress_line(stopped))
                    last = time.monotonic()
                time.sleep(poll_s)
        finally:
            for name in self.chain:
                if name not in stopped:
                    self._stop(name)
            self.lag.close()
        return {n: self.figures(n) for n in self.chain}

    def _run_one(self, name: str, rt: ProcessorRuntime) -> None:
        try:
            rt.run()
        except BaseException as e:  # noqa: BLE001 - reported by run() on the main thread
            self.errors[name] = e

    def _done(self, name: str, stopped: set[str]) -> bool:
        if not self.upstream[name] <= stopped:
            return False
        rt = self.runtimes[name]
        rows = self.lag.lag(rt.group, [self.topo.full_name(t) for t in rt.spec.inputs])
        marks: dict[str, dict[int, tuple[int, int]]] = {}
        for r in rows:
            marks.setdefault(r.topic, {})[r.partition] = (r.start_offset, r.end_offset)
        # a consumer that starts at the end of a partition reads nothing there and knows
        # no position: its group's committed offset stands for it
        positions = {(r.topic, r.partition): r.committed for r in rows if r.committed}
        positions.update((k, v) for k, v in rt.loop.read_positions().items() if v >= 0)
        return caught_up(positions, marks)

    def _stop(self, name: str) -> None:
        self.runtimes[name].stop()
        self.threads[name].join(120)
        if self.threads[name].is_alive():
            raise ReplayError(f"processor {name} did not stop within 120 s")

    def figures(self, name: str) -> Figures:
        rt = self.runtimes[name]
        c = rt.counters
        return Figures(c.consumed, c.produced, c.dead_lettered, dict(rt.processor.metrics()))

    def progress_line(self, stopped: set[str]) -> str:
        parts = []
        for name in self.chain:
            c = self.runtimes[name].counters
            parts.append(f"{name} {c.consumed} in, {c.produced} out"
                         + (" (done)" if name in stopped else ""))
        return "process: " + "; ".join(parts)


# --- the original run's figures, and the report ---------------------------------------------
def original_figures(config: KafkaConfig, src: Topology, chain: list[str]
                     ) -> dict[str, Figures]:
    """Per processor name, the source run's figures: the last status of each of its
    instances (``NAME/INSTANCE``) on the source's ``status`` topic, summed. Empty when
    the status topic no longer holds them (it keeps an hour by default)."""
    from astraflow.kafka.table import TopicTable
    from astraflow.wire.records import ComponentStatus

    topic = src.full_name("status")
    try:
        Offsets(config).partitions(topic)
    except Exception:  # noqa: BLE001 - no status topic left: nothing to show
        return {}
    table = TopicTable.open(config, topic, ComponentStatus, client_id="replay-status",
                            key=lambda e: e.value.component_id if e.value else None)
    try:
        table.catch_up(60.0)
        statuses = table.values()
    finally:
        table.close()
    out: dict[str, Figures] = {}
    for st in statuses:
        name = st.component_id.split("/", 1)[0]
        if st.kind != "processor" or name not in chain:
            continue
        f = out.setdefault(name, Figures())
        f.consumed += st.consumed
        f.produced += st.produced
        f.dead_lettered += st.dead_lettered
        for k, v in st.metrics.items():
            if not k.startswith("runtime/"):
                f.metrics[k] = f.metrics.get(k, 0.0) + v
    return out


def report(chain: list[str], replay: dict[str, Figures], original: dict[str, Figures]
           ) -> str:
    """One row per processor and figure: the replay's value beside the original run's."""
    rows = [("processor", "figure", "replay", "original run")]
    for name in chain:
        new, old = replay[name], original.get(name)
        figures = [("records in", new.consumed, old.consumed if old else None),
                   ("records out", new.produced, old.produced if old else None),
                   ("dead-lettered", new.dead_lettered, old.dead_lettered if old else None)]
        keys = sorted(set(new.metrics) | set(old.metrics if old else {}))
        figures += [(k, new.metrics.get(k), old.metrics.get(k) if old else None)
                    for k in keys]
        for i, (label, a, b) in enumerate(figures):
            rows.append((name if i == 0 else "", label, _num(a), _num(b)))
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows)


def _num(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{int(x):,}" if float(x).is_integer() else f"{x:.4g}"


def print_line(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


__all__ = ["ChainRun", "Figures", "apply_sets", "caught_up", "chain_of",
           "load_chain_topology", "original_figures", "report", "upstream_of",
           "version_history"]
