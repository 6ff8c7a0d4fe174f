"""Offline replay from a run's retained topics.

A run's topics are its complete record: the batches each version was trained on, every
trajectory, every published weight version. Replay works from them without re-running
rollouts:

* ``replay train``: copies the source run's ``batches.<policy>`` (all, or a range by
  offsets, timestamps or weight version) into a new run and trains a trainer on them from
  the source's version 0. With the same configuration the weights are the same bit for bit
  (it prints the sha256 of both at the last common version); with other flags (after
  ``--``: another learning rate, loss, ...) it is an ablation on identical data.
* ``replay export``: a topic's records as JSON lines (or Parquet, with pyarrow).

Signed weights: with a public key (``--public-key``, else ``$ASTRAFLOW_WEIGHTS_PUBLIC_KEY``,
else the topology's ``weight_signing.public_key``) every manifest of the source run that a
replay uses is verified first. One that is unsigned or not signed by the key is never used
(``trusted_manifests``): the replay prints the reason and dead-letters it to the new run's
``dlq`` when it has one.

Copies resume where they stopped: a copy's progress is its destination's end offsets (it is
the destination's only writer), so running the same command again continues it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import subprocess
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer, TopicPartition

from astraflow.errors import AstraflowError
from astraflow.kafka.config import REPLAY_GROUP, KafkaConfig
from astraflow.kafka.offsets import Offsets

log = logging.getLogger("astraflow.replay.ranges")


class ReplayError(AstraflowError):
    """A replay cannot be done as asked (the message says why and what to do)."""


# --- what to replay: a range of offsets per partition ----------------------------------
@dataclass
class Range:
    """Per partition, the first offset to take and the offset to stop before."""

    start: dict[int, int]
    end: dict[int, int]

    @property
    def records(self) -> int:
        return sum(max(0, self.end[p] - self.start[p]) for p in self.start)


def parse_offsets(text: str) -> tuple[int | None, int | None]:
    """``"A:B"`` (either side may be empty) -> (A, B): offsets from A up to, not including,
    B, in every partition."""
    a, sep, b = text.partition(":")
    if not sep:
        raise ReplayError(f"--offsets {text!r}: write FROM:TO (e.g. 100:500, :500 or 100:)")
    try:
        return (int(a) if a else None), (int(b) if b else None)
    except ValueError:
        raise ReplayError(f"--offsets {text!r}: FROM and TO must be offsets") from None


def parse_time(text: str) -> int:
    """Milliseconds since the epoch, or an ISO date/time (UTC unless it says otherwise)."""
    from datetime import datetime, timezone

    if text.isdigit():
        return int(text)
    try:
        dt = datetime.fromisoformat(text)
    except ValueError:
        raise ReplayError(f"{text!r}: give milliseconds or an ISO time "
                          "(2026-11-24T15:00:00)") from None
    if dt.tzinfo is None:
        dt = dt.replace(tzinfo=timezone.utc)
    return int(dt.timestamp() * 1000)


def clamp_range(marks: dict[int, tuple[int, int]], offsets: tuple[int | None, int | None],
                by_time: tuple[dict[int, int] | None, dict[int, int] | None],
                end_by_version: dict[int, int] | None = None) -> Range:
    """The range within each partition's (low, high) that every given bound allows: the
    offsets, the first offsets at or after the since/until times, and the end offsets of
    a weight version (plain logic)."""
    start, end = {}, {}
    for p, (low, high) in marks.items():
        s, e = low, high
        if offsets[0] is not None:
            s = max(s, offsets[0])
        if offsets[1] is not None:
            e = min(e, offsets[1])
        if by_time[0] is not None:
            s = max(s, by_time[0].get(p, high))
        if by_time[1] is not None:
            e = min(e, by_time[1].get(p, high))
        if end_by_version is not None:
            e = min(e, end_by_version.get(p, low))
        start[p], end[p] = s, max(s, e)
    return Range(start, end)


def version_ends(manifests: Iterable[Any], batches_topic: str, version: int) -> dict[int, int]:
    """Per partition of ``batches_topic``, the offset after the last batch trained into a
    version up to ``version`` (from the manifests' ``consumed_offsets``)."""
    ends: dict[int, int] = {}
    for m in manifests:
        if m.version > version:
            continue
        for po in m.consumed_offsets:
            if po.topic == batches_topic:
                ends[po.partition] = max(ends.get(po.partition, 0), po.offset)
    if not ends:
        raise ReplayError(f"no version up to {version} names a batch of {batches_topic}")
    return ends


# --- copying a range, resumably ------------------------------------------------------------
SOURCE_OFFSET = "astraflow.source_offset"  # header of a copied record: where it came from


def copy_range(config: KafkaConfig, src: str, dst: str, rng: Range,
               progress: Callable[[int, int], None] | None = None,
               max_bytes: int = 8 * 1024 * 1024) -> int:
    """Copy ``rng`` of ``src`` to the same partitions of ``dst`` (key, value and timestamp
    kept, the source offset in a header), continuing after the last record ``dst`` holds;
    how many records ``dst`` holds now. ``max_bytes``: the largest record to copy (the
    topics' ``max.message.bytes``). A record that is not delivered raises ``ReplayError``
    (a copy with a gap would replay other data)."""
    offsets = Offsets(config)
    if offsets.partitions(src) != offsets.partitions(dst):
        raise ReplayError(f"{dst} has {offsets.partitions(dst)} partitions, {src} "
                          f"{offsets.partitions(src)}: a copy keeps each record's partition")
    marks = offsets.watermarks(dst)
    resume = copied_up_to(config, dst, marks)
    todo = {p: (max(rng.start[p], resume.get(p, -1) + 1), rng.end[p]) for p in rng.start}
    todo = {p: (s, e) for p, (s, e) in todo.items() if s < e}
    done = sum(high for _, high in marks.values())  # the copy is dst's only writer
    if not todo:
        return done
    consumer = Consumer(config.consumer_conf(REPLAY_GROUP, **{
        "enable.auto.commit": False, "enable.partition.eof": True,
        "receive.message.max.bytes": max(max_bytes, 52_428_800) + 1_048_576}))
    failed: list[str] = []
    producer = Producer(config.producer_conf(**{
        "message.max.bytes": max_bytes + 65_536,
        "on_delivery": lambda err, _m: err is not None and failed.append(str(err))}))
    consumer.assign([TopicPartition(src, p, s) for p, (s, _) in todo.items()])
    left = {p: e for p, (_, e) in todo.items()}
    last = 0.0
    try:
        while left:
            for m in consumer.consume(500, 1.0):
                p = m.partition()
                if p not in left:
                    continue
                if m.error() is not None or m.offset() >= left[p]:
                    if m.error() is None or _eof(m):  # past the range, or at its end
                        left.pop(p)
                    continue
                _produce(producer, dst, m, p)
                done += 1
                if m.offset() + 1 >= left[p]:
                    left.pop(p)
            producer.poll(0)
            if failed:
                break
            if progress is not None and time.monotonic() - last >= 1.0:
                progress(done, rng.records)
                last = time.monotonic()
        if producer.flush(60) or failed:
            raise ReplayError(f"copying {src} to {dst}: "
                              f"{failed[0] if failed else 'records not delivered in 60 s'}; "
                              "the same command again continues after the last delivered")
    finally:
        consumer.close()
    if progress is not None:
        progress(done, rng.records)
    return done


def _produce(producer: Producer, dst: str, m, partition: int) -> None:
    while True:
        try:
            producer.produce(dst, m.value(), m.key(), partition=partition,
                             timestamp=m.timestamp()[1],
                             headers=[(SOURCE_OFFSET, str(m.offset()).encode())])
            return
        except BufferError:  # the local queue is full: wait for deliveries
            producer.poll(0.5)


def copied_up_to(config: KafkaConfig, dst: str, marks: dict[int, tuple[int, int]]
                 ) -> dict[int, int]:
    """Per partition of ``dst`` (its watermarks ``marks``), the source offset of the last
    record copied there."""
    out: dict[int, int] = {}
    consumer = Consumer(config.consumer_conf(REPLAY_GROUP, **{
        "enable.auto.commit": False, "isolation.level": "read_uncommitted"}))
    try:
        for p, (low, high) in marks.items():
            if high <= low:
                continue
            consumer.assign([TopicPartition(dst, p, high - 1)])
            got = [m for m in consumer.consume(1, 10.0) if m.error() is None]
            headers = dict(got[0].headers() or []) if got else {}
            if SOURCE_OFFSET not in headers:
                raise ReplayError(
                    f"{dst}[{p}] holds records that are not a replay's copy (or its last one "
                    "could not be read): give --into a new run name")
            out[p] = int(headers[SOURCE_OFFSET])
    finally:
        consumer.close()
    return out


def _eof(m) -> bool:
    from confluent_kafka import KafkaError

    return m.error() is not None and m.error().code() == KafkaError._PARTITION_EOF


# --- comparing weights -----------------------------------------------------------------------
def weights_digest(state: dict[str, Any]) -> str:
    """sha256 over every tensor's name, dtype, shape and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].contiguous()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def digest_at(config: KafkaConfig, weights_topic: str, policy: str, version: int,
              verifier: Any = None) -> str:
    """The ``weights_digest`` of ``policy``'s published weights at ``version`` (from the
    manifests ``verifier`` trusts, when one is given)."""
    from astraflow.weights.follower import WeightFollower
    from astraflow.weights.stores.kafka import read_manifests

    follower = WeightFollower(policy=policy, kafka_config=config, inplace=False,
                              verifier=verifier)
    try:
        follower.observe([m for m in read_manifests(config, weights_topic)
                          if m.policy == policy])
        follower.update(version)
        return weights_digest(follower.state)
    finally:
        follower.close()


# --- signed weights ------------------------------------------------------------------------
# refused manifests: each with the reason and where it was read (partition, offset; -1: not
# known)
Refusals = list[tuple[Any, str, tuple[int, int]]]


def trusted_manifests(manifests: list[Any], verifier: Any, topic: str,
                      config: KafkaConfig | None = None, dlq: str | None = None) -> list[Any]:
    """The manifests of ``manifests`` (read from ``topic``) that ``verifier`` trusts (all
    without one); the refused ones are reported (``report_refused``). ``ReplayError`` when
    every one is refused."""
    from astraflow.weights.signing import split_trusted

    kept, refused = split_trusted(manifests, verifier)
    if refused:
        report_refused(config, topic, [(m, why, (-1, -1)) for m, why in refused], dlq)
    if refused and not kept:
        raise ReplayError(f"every manifest on {topic} is refused ({refused[-1][1]}); give "
                          "the public key the run was signed with (--public-key FILE)")
    return kept


def report_refused(config: KafkaConfig | None, topic: str, refused: Refusals,
                   dlq: str | None = None) -> None:
    """Say why each refused manifest of ``topic`` is not used and, given a ``dlq`` topic
    (and ``config``), dead-letter it there with the reason."""
    for _, why, _ in refused:
        print(f"replay: refused: {why}; not used", file=sys.stderr, flush=True)
    if dlq is None or config is None or not refused:
        return
    from astraflow.kafka.clients import RecordProducer
    from astraflow.weights.signing import refusal_letter

    producer = RecordProducer(config)
    for m, why, where in refused:
        producer.produce(dlq, refusal_letter(m, why, topic, "replay", producer.codec, where))
    producer.flush(60)
    print(f"replay: {len(refused)} refused manifest(s) dead-lettered to {dlq}",
          file=sys.stderr, flush=True)


def print_progress(label: str) -> Callable[[int, int], None]:
    def show(done: int, total: int) -> None:
        # offsets count transaction markers too: a transactional topic ends below 100 %
        print(f"{label}: {done} records of {total} offsets", file=sys.stderr, flush=True)
    return show


def export_topic(config: KafkaConfig, topic: str, rng: Range, out: Path,
                 fmt: str = "jsonl") -> int:
    """Write the records of ``rng`` of ``topic`` to ``out`` (one JSON object per line, or
    Parquet with one column per record field); how many were written."""
    from astraflow.kafka.table import TopicReader

    reader = TopicReader(config, topic, None, start=dict(rng.start), client_id="export")
    rows: list[dict[str, Any]] = []
    show = print_progress(f"export {topic}")
    last = 0.0
    try:
        reader.retarget()
        while not reader.caught_up():
            for e in reader.poll(1.0):
                if e.offset < rng.end.get(e.partition, 0) and e.value is not None:
                    rows.append({"_partition": e.partition, "_offset": e.offset,
                                 "_timestamp_ms": e.timestamp_ms, **e.value.to_dict()})
            if time.monotonic() - last >= 1.0:
                show(len(rows), rng.records)
                last = time.monotonic()
    finally:
        reader.close()
    show(len(rows), rng.records)
    _write_rows(rows, out, fmt)
    return len(rows)


def _write_rows(rows: list[dict[str, Any]], out: Path, fmt: str) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt == "jsonl":
        with out.open("w", encoding="utf-8") as f:
            for r in rows:
                f.write(json.dumps(r, default=_jsonable) + "\n")
        return
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise ReplayError("--format parquet needs pyarrow: python3 -m pip install pyarrow"
                          ) from None
    pq.write_table(pa.Table.from_pylist(
        [json.loads(json.dumps(r, default=_jsonable)) for r in rows]), out)


def _jsonable(x: Any) -> Any:
    if isinstance(x, bytes):
        return x.hex()
    raise TypeError(f"{type(x).__name__} is not JSON serialisable")


def run_trainer(cmd: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as f:
        return subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env)


def describe_range(rng: Range) -> str:
    """``[0] 10..20, [1] 5..9``: the offsets of each partition a range holds."""
    return ", ".join(f"[{p}] {rng.start[p]}..{rng.end[p]}" for p in sorted(rng.start))


__all__ = [
    "Range",
    "ReplayError",
    "clamp_range",
    "copy_range",
    "describe_range",
    "digest_at",
    "export_topic",
    "parse_offsets",
    "parse_time",
    "report_refused",
    "trusted_manifests",
    "version_ends",
    "weights_digest",
]
