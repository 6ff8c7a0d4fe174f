"""Runs on a Kafka cluster: which there are, what each holds, and deleting one.

A run is the prefix of its topics and consumer groups (``<run>.<topic>``,
``<run>.<component>``). Every run has a ``<run>.status`` and a ``<run>.dlq`` topic (the
topology adds them), so the runs on a cluster are the prefixes that have both. Nothing here
deletes a run unless asked to by name (``astraflow run delete RUN``): a run's retained
topics are what replay works from.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from confluent_kafka import KafkaError, KafkaException, TopicPartition
from confluent_kafka.admin import OffsetSpec

from astraflow.errors import AstraflowError
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.offsets import list_offsets
from astraflow.kafka.outage import kafka_error, transient

# every run has these two topics (``astraflow.config.topology.IMPLICIT_TOPICS``)
MARKER_TOPICS = ("status", "dlq")
# how long a delete waits for a group coordinator that is loading (a broker just started)
COORDINATOR_WAIT_S = 60.0
# how long start_over waits for a group's members to leave: past librdkafka's default
# session timeout (45 s), after which a killed process's member is gone
START_OVER_MEMBERS_S = 60.0
OFFSETS_TOPIC = "__consumer_offsets"


class RunNotFound(AstraflowError):
    """No run of that name on the cluster."""


# --- which runs, which topics: plain logic on topic names ---------------------------------
def run_names(topics: Iterable[str]) -> list[str]:
    """The runs among ``topics`` (full names): prefixes with a status and a dlq topic."""
    names = set(topics)
    suffix = "." + MARKER_TOPICS[0]
    return sorted(t[: -len(suffix)] for t in names if t.endswith(suffix)
                  and all(f"{t[: -len(suffix)]}.{m}" in names for m in MARKER_TOPICS[1:]))


def topics_of(run: str, topics: Iterable[str], runs: Iterable[str] = ()) -> list[str]:
    """The topics of ``run``: those under its prefix, except those of a longer run name
    that starts with it (run ``a`` and run ``a.b`` both exist)."""
    longer = [r for r in runs if r != run and r.startswith(run + ".")]
    return sorted(t for t in topics if t.startswith(run + ".")
                  and not any(t.startswith(r + ".") for r in longer))


def next_run_id(base: str, existing: Iterable[str]) -> str:
    """``base`` if no run has that name yet, else ``base-2``, ``base-3``, ... (the first
    free one): a fresh start never reuses, and so never deletes, another run's topics."""
    taken = set(existing)
    if base not in taken:
        return base
    n = 2
    while f"{base}-{n}" in taken:
        n += 1
    return f"{base}-{n}"


# --- what a run holds ----------------------------------------------------------------------
@dataclass
class TopicSummary:
    """One topic of a run."""

    name: str  # full name
    partitions: int
    records: int  # offsets between the low and high watermarks (transaction markers too)
    bytes: int | None  # on disk; None when the broker's log directories are not local
    first_ms: int | None  # timestamp of the first record retained, if any
    last_ms: int | None  # the newest record's timestamp, if any


@dataclass
class RunSummary:
    """A run on the cluster: its topics, and the newest weight version per policy."""

    run: str
    topics: list[TopicSummary] = field(default_factory=list)
    versions: dict[str, int] = field(default_factory=dict)

    @property
    def records(self) -> int:
        return sum(t.records for t in self.topics)

    @property
    def bytes(self) -> int | None:
        sizes = [t.bytes for t in self.topics]
        return None if any(s is None for s in sizes) else sum(s or 0 for s in sizes)

    @property
    def first_ms(self) -> int | None:
        return min((t.first_ms for t in self.topics if t.first_ms is not None), default=None)

    @property
    def last_ms(self) -> int | None:
        return max((t.last_ms for t in self.topics if t.last_ms is not None), default=None)

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "records": self.records, "bytes": self.bytes,
                "first_ms": self.first_ms, "last_ms": self.last_ms, "versions": self.versions,
                "topics": [t.__dict__ for t in self.topics]}


class Runs:
    """The runs on one cluster."""

    def __init__(self, config: KafkaConfig, log_dir: Path | None = None):
        self.config = config
        self.admin = make_admin(config)
        # the broker's log directory when it is this machine's embedded broker: sizes on disk
        self.log_dir = log_dir if log_dir is not None else _embedded_log_dir(config)

    def topics(self) -> dict[str, int]:
        """Every topic on the cluster (internal ones left out) -> its partition count."""
        md = self.admin.list_topics(timeout=10)
        return {name: len(t.partitions) for name, t in md.topics.items()
                if not name.startswith("__")}

    def names(self) -> list[str]:
        return run_names(self.topics())

    def summary(self, run: str, topics: dict[str, int] | None = None) -> RunSummary:
        """What ``run`` holds now; ``RunNotFound`` when it has no topics."""
        topics = topics if topics is not None else self.topics()
        mine = self._topics_of(run, topics)
        tps = [TopicPartition(t, p) for t in mine for p in range(topics[t])]
        low = list_offsets(self.admin, tps, OffsetSpec.earliest())
        high = list_offsets(self.admin, tps, OffsetSpec.latest())
        first = list_offsets(self.admin, tps, OffsetSpec.for_timestamp(0))
        last = list_offsets(self.admin, tps, OffsetSpec.max_timestamp())
        out = RunSummary(run)
        for t in mine:
            keys = [(t, p) for p in range(topics[t])]
            firsts = [first[k].timestamp for k in keys if first[k].timestamp >= 0]
            lasts = [last[k].timestamp for k in keys if last[k].timestamp >= 0]
            out.topics.append(TopicSummary(
                name=t, partitions=topics[t],
                records=sum(max(0, high[k].offset - low[k].offset) for k in keys),
                bytes=self._bytes_on_disk(t, topics[t]),
                first_ms=min(firsts) if firsts else None, last_ms=max(lasts) if lasts else None))
        out.versions = self._versions(run, mine)
        return out

    def delete(self, run: str, wait_members_s: float = 0.0
               ) -> tuple[list[str], list[str], dict[str, str]]:
        """Delete ``run``'s topics and consumer groups: the topics deleted, the groups
        deleted, and the groups kept with why (a group with live members stays; with
        ``wait_members_s`` it is tried again until then, as a killed process's member
        leaves once its session times out).

        A coordinator still loading its groups (a broker just started) is waited for
        (``AstraflowError`` past ``COORDINATOR_WAIT_S``): it would neither list nor delete
        them, nor drop their offsets of the deleted topics, and a run made again under the
        same name would then inherit those offsets."""
        topics = self.topics()
        runs = run_names(topics)
        mine = self._topics_of(run, topics)
        groups = self._groups_of(run, runs)  # first: waits for the coordinator
        for fut in self.admin.delete_topics(mine, operation_timeout=30).values():
            fut.result()
        deleted, kept = self._delete_groups(groups, wait_members_s)
        _wait_gone(self.admin, mine)
        return mine, deleted, kept

    # --- helpers -----------------------------------------------------------------------
    def _topics_of(self, run: str, topics: dict[str, int]) -> list[str]:
        """``run``'s topics; ``RunNotFound`` unless it is a run (a status and a dlq topic):
        a prefix that merely matches some topics names no run to show or delete."""
        runs = run_names(topics)
        if run not in runs:
            raise RunNotFound(f"no run {run!r} on {self.config.bootstrap_servers} "
                              f"(runs: {', '.join(runs) or 'none'})")
        return topics_of(run, topics, runs)

    def _bytes_on_disk(self, topic: str, partitions: int) -> int | None:
        if self.log_dir is None:
            return None
        total = 0
        for p in range(partitions):
            d = self.log_dir / f"{topic}-{p}"
            if d.is_dir():
                total += sum(f.stat().st_size for f in d.iterdir() if f.suffix == ".log")
        return total

    def _versions(self, run: str, topics: list[str]) -> dict[str, int]:
        """Policy -> the newest weight version in the run's manifest topics."""
        from astraflow.kafka.table import TopicReader
        from astraflow.wire.records import WeightManifest

        out: dict[str, int] = {}
        for t in topics:
            if not t.startswith(f"{run}.weights.") or t.endswith(".blobs"):
                continue
            reader = TopicReader(self.config, t, None, start=-5, client_id="run-list")
            try:
                for e in reader.catch_up(timeout_s=10):
                    m = e.value
                    if isinstance(m, WeightManifest) and m.version > out.get(m.policy, -1):
                        out[m.policy] = m.version
            finally:
                reader.close()
        return out

    def _delete_groups(self, groups: list[str], wait_members_s: float
                       ) -> tuple[list[str], dict[str, str]]:
        """Delete ``groups``: the deleted, and the kept with why. A group is tried again
        while its coordinator is busy (moving or loading), and while it has members until
        ``wait_members_s`` have passed."""
        deleted: list[str] = []
        kept: dict[str, str] = {}
        todo = list(groups)
        coordinator_by = time.monotonic() + COORDINATOR_WAIT_S
        members_by = time.monotonic() + wait_members_s
        while todo:
            retry: list[str] = []
            for g, fut in self.admin.delete_consumer_groups(todo, request_timeout=30).items():
                try:
                    fut.result()
                    deleted.append(g)
                except KafkaException as e:
                    err = kafka_error(e)
                    if err is not None and err.code() == KafkaError.GROUP_ID_NOT_FOUND:
                        deleted.append(g)  # gone meanwhile
                    elif _again(err, coordinator_by, members_by):
                        retry.append(g)
                    else:
                        kept[g] = err.str() if err is not None else str(e)
            todo = retry
            if todo:
                time.sleep(0.5)
        return deleted, kept

    def _groups_of(self, run: str, runs: list[str]) -> list[str]:
        """``run``'s consumer groups, once the group coordinator has loaded them: on a
        broker just started it lists none, without an error, until it takes up the
        partitions of ``__consumer_offsets``, then answers with an error while it loads
        them."""
        self._wait_for_coordinator(run)
        deadline = time.monotonic() + COORDINATOR_WAIT_S
        while True:
            listed = self.admin.list_consumer_groups(request_timeout=30).result()
            # librdkafka gives each broker's error as a KafkaError, not an exception
            errors = [e if isinstance(e, KafkaError) else kafka_error(e) or e
                      for e in listed.errors]
            if not errors:
                break
            if time.monotonic() > deadline or not all(
                    isinstance(e, KafkaError) and transient(e) for e in errors):
                raise AstraflowError(
                    f"listing the consumer groups of run {run!r} failed: "
                    + "; ".join(e.str() if isinstance(e, KafkaError) else str(e)
                                for e in errors))
            time.sleep(0.5)
        return topics_of(run, [g.group_id for g in listed.valid], runs)

    def _wait_for_coordinator(self, run: str) -> None:
        """Until every partition of ``__consumer_offsets`` is loaded: describing a group
        (one named after the run, which its ACLs cover, and that nobody uses) of each
        partition answers "not coordinator", then "load in progress", until it is."""
        md = self.admin.list_topics(topic=OFFSETS_TOPIC, timeout=10).topics.get(OFFSETS_TOPIC)
        if md is None or md.error is not None or not md.partitions:
            return  # no group has offsets here, or this principal may not see them
        probes = _probe_groups(f"{run}.coordinator-probe", len(md.partitions))
        deadline = time.monotonic() + COORDINATOR_WAIT_S
        while True:
            busy = []
            answers = self.admin.describe_consumer_groups(probes, request_timeout=10)
            for fut in answers.values():
                try:
                    fut.result()
                except KafkaException as e:  # denied, say: nothing to wait for there
                    err = kafka_error(e)
                    if transient(err):
                        busy.append(err.str())
            if not busy:
                return
            if time.monotonic() > deadline:
                raise AstraflowError(
                    f"the group coordinator did not load __consumer_offsets within "
                    f"{COORDINATOR_WAIT_S:.0f} s ({busy[0]}); run {run!r} was not deleted")
            time.sleep(0.2)


def offsets_partition(group: str, partitions: int) -> int:
    """The partition of ``__consumer_offsets`` that holds ``group``: Kafka's
    ``abs(String.hashCode()) % partitions`` (Java's hash of UTF-16 code units)."""
    h = 0
    units = group.encode("utf-16-be")
    for i in range(0, len(units), 2):
        h = (31 * h + int.from_bytes(units[i:i + 2], "big")) & 0xFFFFFFFF
    if h >= 1 << 31:
        h -= 1 << 32
    return (0 if h == -(1 << 31) else abs(h)) % partitions


def _probe_groups(prefix: str, partitions: int) -> list[str]:
    """One group name ``<prefix>-<i>`` for each partition of ``__consumer_offsets``."""
    found: dict[int, str] = {}
    i = 0
    while len(found) < partitions:
        found.setdefault(offsets_partition(f"{prefix}-{i}", partitions), f"{prefix}-{i}")
        i += 1
    return [found[p] for p in sorted(found)]


def _again(err: KafkaError | None, coordinator_by: float, members_by: float) -> bool:
    """Whether a group that could not be deleted with ``err`` is tried again: while its
    coordinator loads or moves, or the broker does not answer (until ``coordinator_by``),
    and while it has members (until ``members_by``)."""
    now = time.monotonic()
    if err is not None and err.code() == KafkaError.NON_EMPTY_GROUP:
        return now < members_by
    return transient(err) and now < coordinator_by


def _embedded_log_dir(config: KafkaConfig) -> Path | None:
    """The embedded broker's data directory if ``config`` talks to it, else None."""
    from astraflow.broker.embedded import EmbeddedBroker

    broker = EmbeddedBroker()
    if broker.bootstrap() != config.bootstrap_servers:
        return None
    data = broker.state / "data"
    return data if data.is_dir() else None


def _wait_gone(admin, topics: list[str], timeout_s: float = 30.0) -> None:
    """Until the cluster no longer lists ``topics`` (a delete is asynchronous)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not set(topics) & set(admin.list_topics(timeout=10).topics):
            return
        time.sleep(0.2)


def start_over(run: str, config: KafkaConfig | None = None) -> None:
    """Delete run ``run`` if the cluster holds it, so that ``astraflow up`` starts it at
    version 0 under the same name (benches that compare runs by name). Without ``config``
    the cluster is ``$ASTRAFLOW_BOOTSTRAP``, else the embedded broker, started if needed.
    ``AstraflowError`` if a consumer group of the run keeps members past
    ``START_OVER_MEMBERS_S`` (a process of the run still runs)."""
    import os

    from astraflow.broker.embedded import EmbeddedBroker

    if config is None:
        if not os.environ.get("ASTRAFLOW_BOOTSTRAP"):
            EmbeddedBroker().start()
        config = KafkaConfig().effective()
    runs = Runs(config)
    if run in runs.names():
        _, _, kept = runs.delete(run, wait_members_s=START_OVER_MEMBERS_S)
        kept.update((g, "still listed after the delete")
                    for g in runs._groups_of(run, runs.names()) if g not in kept)
        if kept:  # its offsets would carry over to the run made again
            raise AstraflowError(f"run {run!r} could not start over: " + "; ".join(
                f"consumer group {g} kept ({why})" for g, why in sorted(kept.items())))


def human_bytes(n: int | None) -> str:
    if n is None:
        return "?"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(ms / 1000))


def format_runs(summaries: list[RunSummary]) -> str:
    """A table of runs, one line each, then each run's topics indented."""
    lines = [f"{'run':24} {'topics':>6} {'records':>10} {'size':>10}  {'first record':19}  "
             f"{'last record':19}  versions"]
    for s in summaries:
        versions = ", ".join(f"{p} v{v}" for p, v in sorted(s.versions.items())) or "-"
        lines.append(f"{s.run:24} {len(s.topics):6d} {s.records:10d} {human_bytes(s.bytes):>10}"
                     f"  {_when(s.first_ms):19}  {_when(s.last_ms):19}  {versions}")
    return "\n".join(lines)


def format_topics(summary: RunSummary) -> str:
    lines = [f"{'topic':40} {'partitions':>10} {'records':>10} {'size':>10}  last record"]
    for t in summary.topics:
        lines.append(f"{t.name:40} {t.partitions:10d} {t.records:10d} "
                     f"{human_bytes(t.bytes):>10}  {_when(t.last_ms)}")
    return "\n".join(lines)


__all__ = ["RunNotFound", "RunSummary", "Runs", "TopicSummary", "format_runs",
           "format_topics", "human_bytes", "next_run_id", "run_names", "start_over",
           "topics_of"]
