"""The books of a finished run: every record of every stage accounted for exactly once.

After a run of the default topology (``astraflow up``) has stopped, ``audit_run`` reads
every topic of the run from the beginning (``read_committed``) and checks, stage by stage
(admission, RaaS, staleness, router, batcher, trainer):

- no output twice, and every output from an input;
- every input below the stage's committed offset reached the next topic, or the DLQ, or
  is a counted drop (the staleness processor's ``staleness/dropped``, the batcher's
  ``batcher/dropped_stale``, as the processes last reported them on ``status``);
- versions contiguous from 0, no manifest of a kind twice for one version, no batch
  trained twice, and every batch the trainer committed past was trained, skipped (logged
  in the trainer's log) or dead-lettered.

It returns what it found (``Audit``: the counts and the problems), never raises on a
broken book: the chaos tests assert on it, the fault benches print its verdict.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from confluent_kafka import Consumer, KafkaException, TopicPartition

from astraflow.kafka.clients import read_all
from astraflow.kafka.config import KafkaConfig
from astraflow.wire.records import (
    Batch,
    ComponentStatus,
    DeadLetter,
    Task,
    TrajectoryGroup,
    WeightManifest,
)

# (topic, partition, offset, record) as read back
Row = tuple[str, int, int, object]


@dataclass
class Audit:
    """The counts per stage (``books``) and every broken rule found (``problems``)."""

    books: dict[str, int] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """Whether every record is accounted for exactly once."""
        return not self.problems

    def verdict(self) -> str:
        """``exactly once``, or the first problem and how many there are."""
        if self.ok:
            return "exactly once"
        more = f" (+{len(self.problems) - 1} more)" if len(self.problems) > 1 else ""
        return f"BROKEN: {self.problems[0]}{more}"


def committed_offsets(config: KafkaConfig, group: str, topic: str,
                      partitions: set[int]) -> dict[int, int]:
    """``group``'s committed offset of each partition of ``topic`` (0 when none)."""
    c = Consumer(config.consumer_conf(group))
    try:
        # up to the transaction timeout: a killed producer's open offsets hold the answer
        tps = c.committed([TopicPartition(topic, p) for p in sorted(partitions)], timeout=90)
    finally:
        c.close()
    return {tp.partition: max(tp.offset, 0) for tp in tps}


def versions(config: KafkaConfig, topic: str) -> list[WeightManifest]:
    """The manifests on ``topic`` (``<run>.weights.<policy>``); [] while it has none or
    does not exist yet."""
    try:
        return [r.record for r in read_all(config, topic, expect=WeightManifest,
                                           idle_s=1.0, timeout_s=20)]
    except KafkaException:
        return []


def newest_version(config: KafkaConfig, topic: str) -> int:
    """The newest version published on ``topic`` (-1: none, or no topic yet)."""
    return max((m.version for m in versions(config, topic)), default=-1)


def version_times(manifests: list[WeightManifest]) -> dict[int, int]:
    """When each version was first published (``created_at_ms`` of its first manifest)."""
    out: dict[int, int] = {}
    for m in manifests:
        out[m.version] = min(out.get(m.version, m.created_at_ms), m.created_at_ms)
    return out


def _dropped(statuses: list[ComponentStatus], prefix: str, metric: str) -> int:
    """``metric`` summed over the processes (component id, start time) of a component: the
    last value each reported."""
    last: dict[tuple[str, int], float] = {}
    for st in statuses:
        if st.component_id.startswith(prefix) and metric in st.metrics:
            last[(st.component_id, st.started_at_ms)] = st.metrics[metric]
    return int(sum(last.values()))


class _Reader:
    """The run's topics read back, and the problems found so far."""

    def __init__(self, config: KafkaConfig, run: str):
        self.config = config
        self.run = run
        self.problems: list[str] = []

    def topic(self, logical: str) -> str:
        return f"{self.run}.{logical}"

    def rows(self, logical: str, cls: type) -> list[Row]:
        return [(self.topic(logical), r.partition, r.offset, r.record) for r in read_all(
            self.config, self.topic(logical), expect=cls, idle_s=2.0, timeout_s=180)]

    def stage(self, name: str, inputs: list[Row], outputs: list, in_key, out_key,
              group: str, dead: set) -> list:
        """One stage's books: no output twice and every output from an input. Returns
        the inputs below the stage's committed offsets that are in no output and not
        dead-lettered."""
        counts = Counter(out_key(o) for o in outputs)
        twice = [k for k, n in counts.items() if n > 1]
        if twice:
            self.problems.append(f"{name}: {len(twice)} outputs twice, e.g. {twice[:3]}")
        known = {in_key(r) for *_, r in inputs}
        orphans = list(set(counts) - known)
        if orphans:
            self.problems.append(f"{name}: outputs without input: {orphans[:3]}")
        committed: dict[tuple[str, int], int] = {}
        for t in {t for t, *_ in inputs}:
            parts = {p for tt, p, _, _ in inputs if tt == t}
            committed.update({(t, p): o for p, o in
                              committed_offsets(self.config, group, t, parts).items()})
        return [r for t, p, o, r in inputs if o < committed.get((t, p), 0)
                and in_key(r) not in counts and (t, p, o) not in dead]


def audit_run(config: KafkaConfig, run: str, logs_dir: Path | str, policy: str = "actor",
              killed: str | None = None) -> Audit:
    """The books of the stopped run ``run`` of the default topology (one ``policy``),
    whose component logs are in ``logs_dir``. ``killed``: the processor that was
    SIGKILLed, if any (its drop counter restarted with it)."""
    rd = _Reader(config, run)
    dead = {(d.source_topic, d.partition, d.offset) for *_, d in rd.rows("dlq", DeadLetter)}
    statuses = [r for *_, r in rd.rows("status", ComponentStatus)]
    task_id = lambda t: t.task_id  # noqa: E731
    group_id = lambda g: g.group_id  # noqa: E731
    routed = lambda g: g.group_id.rsplit("/", 1)[0]  # noqa: E731 - the router adds /<policy>
    source, tasks = rd.rows("tasks.source", Task), rd.rows("tasks", Task)
    raw, traj = rd.rows("trajectories.raw", TrajectoryGroup), rd.rows("trajectories",
                                                                       TrajectoryGroup)
    samples = rd.rows(f"samples.{policy}", TrajectoryGroup)
    batches = rd.rows(f"batches.{policy}", Batch)
    for name, ins, outs, key, out_key in [
            ("admission", source, tasks, task_id, task_id),
            ("raas", tasks, raw, task_id, task_id),
            ("router", traj, samples, group_id, routed)]:
        lost = rd.stage(name, ins, [o for *_, o in outs], key, out_key, f"{run}.{name}", dead)
        if lost:
            rd.problems.append(f"{name}: {len(lost)} inputs lost, e.g. "
                               f"{[key(x) for x in lost[:3]]}")
    books = {"tasks": len(tasks), "groups": len(raw), "batches": len(batches)}
    lost = rd.stage("staleness", raw, [g for *_, g in traj], group_id, group_id,
                    f"{run}.staleness", dead)
    books["stale_dropped"] = _dropped(statuses, "staleness/", "staleness/dropped")
    if len(lost) != books["stale_dropped"]:
        rd.problems.append(f"staleness: {len(lost)} groups missing, "
                           f"{books['stale_dropped']} reported dropped")
    in_batches = [g for *_, b in batches for g in b.groups]
    lost = rd.stage("batcher", samples, in_batches, group_id, group_id, f"{run}.batcher",
                    dead)
    manifests = versions(config, rd.topic(f"weights.{policy}"))
    _batcher_drops(rd, lost, _dropped(statuses, "batcher/", "batcher/dropped_stale"),
                   killed == "batcher", max((m.version for m in manifests), default=-1))
    books["batcher_dropped"] = len(lost)
    books.update(_trainer_books(rd, policy, manifests, batches, dead, Path(logs_dir)))
    return Audit(books, rd.problems)


def _batcher_drops(rd: _Reader, lost: list, reported: int, killed: bool,
                   newest: int) -> None:
    """The batcher's missing groups are the drops it reported; for a SIGKILLed batcher,
    whose last drops may postdate its last status, at least those reported, each of the
    rest too old to train on at the end."""
    if not killed:
        if len(lost) != reported:
            rd.problems.append(f"batcher: {len(lost)} groups missing, {reported} reported "
                               "dropped as stale")
        return
    if len(lost) < reported:
        rd.problems.append(f"batcher: {len(lost)} groups missing, fewer than the "
                           f"{reported} reported dropped")
    young = [v for v in (min(s.min_version for s in g.sequences) for g in lost)
             if newest - v <= 4]
    if young:
        rd.problems.append(f"batcher: {len(young)} missing groups young enough to train "
                           f"on (versions {young[:3]}, newest {newest})")


def _trainer_books(rd: _Reader, policy: str, manifests: list[WeightManifest],
                   batches: list[Row], dead: set, logs_dir: Path) -> dict[str, int]:
    """Versions contiguous from 0; no manifest of a kind twice; no batch trained twice;
    every batch the trainer committed past was trained, skipped (all stale: logged) or
    dead-lettered."""
    numbers = sorted({m.version for m in manifests})
    if numbers != list(range(len(numbers))):
        gaps = sorted(set(range(max(numbers, default=-1) + 1)) - set(numbers))
        rd.problems.append(f"trainer: versions not contiguous, missing {gaps[:5]}")
    for kind in ("delta", "full"):
        per = Counter(m.version for m in manifests if m.kind == kind)
        twice = sorted(v for v, n in per.items() if n > 1)
        if twice:
            rd.problems.append(f"trainer: a {kind} manifest twice for versions {twice[:5]}")
    trained = Counter(m.meta["batch_id"] for m in manifests
                      if m.version > 0 and "batch_id" in m.meta and m.kind == "delta")
    twice = [b for b, n in trained.items() if n > 1]
    if twice:
        rd.problems.append(f"trainer: batches trained twice: {twice[:3]}")
    log_file = logs_dir / f"trainer-{policy}.log"
    log = log_file.read_text() if log_file.exists() else ""
    committed = committed_offsets(rd.config, f"{rd.run}.trainer.{policy}",
                                  rd.topic(f"batches.{policy}"), {p for _, p, _, _ in batches})
    unexplained = [b.batch_id for t, p, o, b in batches
                   if o < committed.get(p, 0) and b.batch_id not in trained
                   and (t, p, o) not in dead
                   and not (f"batch {b.batch_id} @" in log and "skipped" in log)]
    if unexplained:
        rd.problems.append(f"trainer: {len(unexplained)} committed batches neither trained, "
                           f"skipped nor dead-lettered, e.g. {unexplained[:3]}")
    return {"versions": len(numbers) - 1, "trained": len(trained)}
