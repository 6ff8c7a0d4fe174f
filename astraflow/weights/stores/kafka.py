"""Kafka blob store: weight blobs as ``BlobChunk`` records on a topic (``weights.blobs``).

Writing: the blob is spooled to a temporary file (in memory up to 64 MB) while its sha256
is computed, then produced as chunks of at most ``chunk_bytes`` (4 MiB by default), keyed
by blob id so that all chunks of a blob land in one partition, in order. Every chunk
carries the blob's chunk count, total size and sha256. The returned ``BlobRef`` uri is
``kafka://<topic>/<blob id>?partition=<p>&offset=<first chunk offset>``.

Reading: with the partition/offset hint from the uri the reader seeks straight to the
first chunk and reads forward until it has every chunk of the blob (chunks of other blobs
in between are skipped). Without a usable hint it builds, once, an in-memory index
``blob id -> (partition, first offset)`` by reading the topic from its start (and
incrementally after that); that scan transfers every chunk, so it is the slow path.
Size and sha256 are checked against the ``BlobRef`` before anything is returned.

Deletion: Kafka cannot remove single records, so ``delete`` returns False. Space comes
back through the topic's retention, or through ``truncate_before`` (``DeleteRecords``
below the first chunk of the oldest blob still needed, per partition), which the garbage
collector offers.

The topic needs ``max.message.bytes`` above the chunk size (default chunks are 4 MiB;
``create_blob_topic`` sets 8 MiB).
"""

from __future__ import annotations

import hashlib
import logging
import tempfile
import threading
import time
import urllib.parse
import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, BinaryIO

from confluent_kafka import Consumer, KafkaError, KafkaException, Producer, TopicPartition
from confluent_kafka.admin import AdminClient, NewTopic

from astraflow.kafka.clients import flush_waiting
from astraflow.kafka.config import BLOB_READER_GROUP_PREFIX, KafkaConfig
from astraflow.kafka.loop import kafka_error
from astraflow.kafka.replication import replication
from astraflow.kafka.table import TopicReader
from astraflow.weights.errors import CorruptBlobError, MissingBlobError, WeightsError
from astraflow.weights.stores.base import (
    BlobData,
    StoredBlob,
    blob_id_of,
    check_blob_id,
    pieces,
    verify_stream,
)
from astraflow.wire.codec import Codec, RecordDecodeError, make_codec
from astraflow.wire.records import BlobChunk, BlobRef, WeightManifest

log = logging.getLogger("astraflow.weights")

DEFAULT_CHUNK_BYTES = 4 << 20
TOPIC_MAX_MESSAGE_BYTES = 8 << 20
_SPOOL_BYTES = 64 << 20
_ENVELOPE = 64 << 10  # room for the Avro envelope around a chunk's data


def create_blob_topic(
    config: KafkaConfig,
    topic: str,
    partitions: int = 1,
    replication_factor: int | None = None,
    **configs: str,
) -> bool:
    """Create a blob topic that takes 4 MiB chunks (8 MiB ``max.message.bytes``, no time
    retention unless ``configs`` say otherwise), replicated as a topology's topics are
    (default ``min(3, brokers)``, ``min.insync.replicas`` 2 from 3 replicas:
    ``astraflow.kafka.replication``). Returns False if it already existed."""
    admin = AdminClient(config.admin_conf())
    brokers = len(admin.list_topics(timeout=30).brokers)
    replication_factor, conf = replication(
        brokers, replication_factor, "replication_factor",
        {"max.message.bytes": str(TOPIC_MAX_MESSAGE_BYTES), "retention.ms": "-1", **configs})
    fut = admin.create_topics([NewTopic(topic, partitions, replication_factor, config=conf)])
    try:
        fut[topic].result()
    except KafkaException as e:
        if e.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise
    return True


@dataclass
class _Located:
    partition: int
    offset: int
    count: int
    total_bytes: int
    sha256: str
    timestamp_ms: int


class KafkaBlobStore:
    """Blobs as ``BlobChunk`` records on one Kafka topic (see the module docstring)."""

    def __init__(
        self,
        config: KafkaConfig,
        topic: str,
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        codec: Codec | None = None,
        timeout_s: float = 60.0,
    ):
        if chunk_bytes <= 0:
            raise ValueError("chunk_bytes must be positive")
        self.config = config
        self.topic = topic
        self.uri = f"kafka://{topic}"
        self.chunk_bytes = chunk_bytes
        self.codec = codec or make_codec(config.schema_registry_url, config.schema_registry_options)
        self.timeout_s = timeout_s
        self._producer: Producer | None = None
        self._consumer: Consumer | None = None
        self._lock = threading.RLock()
        self._index: dict[str, _Located] = {}
        self._scanned: dict[int, int] = {}

    # ------------------------------------------------------------------ clients

    def _max_message(self) -> int:
        return self.chunk_bytes + _ENVELOPE

    def _get_producer(self) -> Producer:
        if self._producer is None:
            size = max(self._max_message(), 1 << 20)
            self._producer = Producer(
                self.config.producer_conf(
                    **{
                        "message.max.bytes": size,
                        "batch.size": size,
                        "compression.type": "none",  # blobs are zstd already
                        "queue.buffering.max.kbytes": max(65536, 4 * size // 1024),
                        "linger.ms": 2,
                        # chunks wait out a broker outage (kafka.outage_limit_s)
                        "message.timeout.ms": int(self._wait_s() * 1000) + 30_000,
                    }
                )
            )
        return self._producer

    def _get_consumer(self) -> Consumer:
        if self._consumer is None:
            size = max(self._max_message(), 1 << 20)
            self._consumer = Consumer(
                self.config.consumer_conf(
                    f"{BLOB_READER_GROUP_PREFIX}{uuid.uuid4().hex[:8]}",
                    **{
                        "enable.partition.eof": True,
                        "max.partition.fetch.bytes": size,
                        "fetch.max.bytes": max(size, 52428800),
                        "queued.max.messages.kbytes": max(65536, 4 * size // 1024),
                    },
                )
            )
        return self._consumer

    def close(self) -> None:
        with self._lock:
            if self._producer is not None:
                self._producer.flush(self.timeout_s)
                self._producer = None
            if self._consumer is not None:
                self._consumer.close()
                self._consumer = None

    def __repr__(self) -> str:
        return f"KafkaBlobStore({self.topic!r})"

    # ------------------------------------------------------------------ writing

    def put(self, blob_id: str, data: BlobData) -> BlobRef:
        """Spool, hash, and produce ``data`` as chunks; returns once every chunk is acked."""
        check_blob_id(blob_id)
        h = hashlib.sha256()
        total = 0
        with tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES) as spool:
            for piece in pieces(data):
                h.update(piece)
                spool.write(piece)
                total += len(piece)
            spool.seek(0)
            sha = h.hexdigest()
            count = max(1, -(-total // self.chunk_bytes))
            first, errors, remaining = self._produce_chunks(blob_id, spool, count, total, sha)
        if errors:
            self._raise_write_error(blob_id, errors[0])
        if remaining or not first:
            raise WeightsError(f"writing blob {blob_id}: not acknowledged in {self._wait_s():.0f}s")
        partition, offset = first[0]
        with self._lock:
            self._index[blob_id] = _Located(
                partition, offset, count, total, sha, int(time.time() * 1000)
            )
        uri = f"{self.uri}/{blob_id}?partition={partition}&offset={offset}"
        return BlobRef(uri=uri, bytes=total, sha256=sha)

    def _produce_chunks(self, blob_id: str, spool: Any, count: int, total: int, sha: str
                        ) -> tuple[list[tuple[int, int]], list[KafkaError], int]:
        """Produce ``count`` chunks read from ``spool`` and wait for them: ``(partition and
        offset of the first chunk once acked, delivery errors, messages still unacked)``."""
        first: list[tuple[int, int]] = []
        errors: list[KafkaError] = []
        key = blob_id.encode()

        def on_delivery(err: KafkaError | None, msg: Any, index: int) -> None:
            if err is not None:
                errors.append(err)
            elif index == 0:
                first.append((msg.partition(), msg.offset()))

        with self._lock:
            producer = self._get_producer()
            for index in range(count):
                chunk = BlobChunk(blob_id, index, count, spool.read(self.chunk_bytes), total, sha)
                value = self.codec.encode(chunk, self.topic)
                while True:
                    try:
                        producer.produce(
                            self.topic,
                            value=value,
                            key=key,
                            on_delivery=lambda e, m, i=index: on_delivery(e, m, i),
                        )
                        break
                    except BufferError:
                        producer.poll(0.1)
                producer.poll(0)
            remaining = flush_waiting(producer, self._wait_s(), f"chunks of blob {blob_id}")
        return first, errors, remaining

    def _raise_write_error(self, blob_id: str, err: KafkaError) -> None:
        hint = ""
        if err.code() == KafkaError.MSG_SIZE_TOO_LARGE:
            hint = (
                f" (topic {self.topic} needs max.message.bytes >= {self._max_message()}; "
                "see create_blob_topic, or use a smaller chunk_bytes)"
            )
        raise WeightsError(f"writing blob {blob_id} to {self.topic} failed: {err}{hint}")

    def _wait_s(self) -> float:
        return max(self.timeout_s, self.config.outage_limit_s)

    # ------------------------------------------------------------------ reading

    def open(self, ref: BlobRef) -> BinaryIO:
        """A verified spooled file holding the blob (memory up to 64 MB, then disk)."""
        blob_id = blob_id_of(ref)
        hint = _hint(ref.uri)
        with self._lock:
            tried: set[tuple[int, int]] = set()
            if hint is not None:
                tried.add(hint)
                f = self._read(blob_id, *hint)
                if f is not None:
                    return _verified(f, ref)
            self._scan()
            loc = self._index.get(blob_id)
            if loc is None or (loc.partition, loc.offset) in tried:
                raise MissingBlobError(f"{ref.uri}: no complete blob {blob_id} on {self.topic}")
            f = self._read(blob_id, loc.partition, loc.offset)
            if f is None:
                raise MissingBlobError(f"{ref.uri}: blob {blob_id} on {self.topic} is incomplete")
            return _verified(f, ref)

    def get(self, ref: BlobRef) -> bytes:
        with self.open(ref) as f:
            return f.read()

    def _watermarks(self, partition: int) -> tuple[int, int]:
        consumer = self._get_consumer()
        tp = TopicPartition(self.topic, partition)
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                return consumer.get_watermark_offsets(tp, timeout=self.timeout_s)
            except KafkaException as e:
                # a fresh client may not know the partition yet (metadata on its way)
                err = kafka_error(e)
                if (err is None or err.code() != KafkaError._UNKNOWN_PARTITION
                        or time.monotonic() > deadline):
                    raise
                consumer.list_topics(self.topic, timeout=5)
                time.sleep(0.2)

    def _partitions(self) -> list[int]:
        md = self._get_consumer().list_topics(self.topic, timeout=self.timeout_s)
        t = md.topics.get(self.topic)
        if t is None or t.error is not None:
            raise MissingBlobError(f"topic {self.topic} not found: {t.error if t else ''}")
        return sorted(t.partitions)

    def _poll(self, deadline: float) -> Any:
        consumer = self._get_consumer()
        while True:
            msg = consumer.poll(0.5)
            if msg is not None:
                return msg
            if time.time() > deadline:
                raise MissingBlobError(f"timed out reading {self.topic}")

    def _decode(self, msg: Any) -> BlobChunk:
        try:
            rec = self.codec.decode(
                msg.value(), msg.topic(), msg.partition(), msg.offset(), expect=BlobChunk
            )
        except RecordDecodeError as e:
            raise CorruptBlobError(f"undecodable blob chunk: {e}") from e
        assert isinstance(rec, BlobChunk)
        return rec

    def _read(self, blob_id: str, partition: int, offset: int) -> BinaryIO | None:
        """Chunks of ``blob_id`` from ``partition`` starting at ``offset``; None if absent."""
        lo, hi = self._watermarks(partition)
        if offset < lo or offset >= hi:
            return None
        consumer = self._get_consumer()
        consumer.assign([TopicPartition(self.topic, partition, offset)])
        key = blob_id.encode()
        spool: Any = None
        expected, count = 0, -1
        deadline = time.time() + self.timeout_s
        try:
            while True:
                msg = self._poll(deadline)
                if msg.error():
                    if msg.error().code() == KafkaError._PARTITION_EOF:
                        break
                    raise WeightsError(f"reading {self.topic}: {msg.error()}")
                if msg.key() != key:
                    continue
                chunk = self._decode(msg)
                if chunk.index == 0:  # (re)start: a blob written twice is read from its last start
                    if spool is not None:
                        spool.close()
                    spool = tempfile.SpooledTemporaryFile(max_size=_SPOOL_BYTES)
                    expected, count = 0, chunk.count
                if spool is None or chunk.index != expected or chunk.count != count:
                    continue
                spool.write(chunk.data)
                expected += 1
                if expected == count:
                    spool.seek(0)
                    out, spool = spool, None
                    return out
                if msg.offset() >= hi - 1:
                    break
        finally:
            consumer.unassign()
            if spool is not None:
                spool.close()
        return None

    def _scan(self) -> None:
        """Extend the blob index with everything written since the last scan."""
        consumer = self._get_consumer()
        deadline = time.time() + max(self.timeout_s, 300.0)
        for p in self._partitions():
            lo, hi = self._watermarks(p)
            start = max(lo, self._scanned.get(p, lo))
            if start >= hi:
                self._scanned[p] = hi
                continue
            consumer.assign([TopicPartition(self.topic, p, start)])
            try:
                while True:
                    msg = self._poll(deadline)
                    if msg.error():
                        if msg.error().code() == KafkaError._PARTITION_EOF:
                            break
                        raise WeightsError(f"reading {self.topic}: {msg.error()}")
                    try:
                        chunk = self._decode(msg)
                    except CorruptBlobError:
                        continue  # not ours to judge here; a read of that blob will fail
                    if chunk.index == 0:
                        self._index[chunk.blob_id] = _Located(
                            p,
                            msg.offset(),
                            chunk.count,
                            chunk.total_bytes,
                            chunk.sha256,
                            msg.timestamp()[1],
                        )
                    self._scanned[p] = msg.offset() + 1
                    if msg.offset() >= hi - 1:
                        break
            finally:
                consumer.unassign()

    # ------------------------------------------------------------------ listing / GC

    def delete(self, ref: BlobRef | StoredBlob) -> bool:
        """Kafka cannot delete single records: always False (see ``truncate_before``)."""
        return False

    def list(self) -> list[StoredBlob]:
        """Every blob whose first chunk is still on the topic (scans the topic)."""
        with self._lock:
            self._scan()
            lo_by_p = {p: self._watermarks(p)[0] for p in self._partitions()}
            return [
                StoredBlob(
                    blob_id,
                    f"{self.uri}/{blob_id}?partition={loc.partition}&offset={loc.offset}",
                    loc.total_bytes,
                    loc.timestamp_ms,
                    loc.sha256,
                )
                for blob_id, loc in sorted(self._index.items())
                if loc.offset >= lo_by_p.get(loc.partition, 0)
            ]

    def truncate_before(self, keep: Iterable[str]) -> dict[int, int]:
        """Delete, per partition, every record before the first chunk of the oldest blob in
        ``keep`` (all records when a partition holds none of them). Returns the new low
        watermark per partition that moved."""
        keep = set(keep)
        out: dict[int, int] = {}
        with self._lock:
            self._scan()
            targets = []
            for p in self._partitions():
                lo, hi = self._watermarks(p)
                firsts = [
                    loc.offset
                    for b, loc in self._index.items()
                    if b in keep and loc.partition == p and loc.offset >= lo
                ]
                cut = min(firsts) if firsts else min(hi, self._scanned.get(p, lo))
                if cut > lo:
                    targets.append(TopicPartition(self.topic, p, cut))
            if not targets:
                return out
            admin = AdminClient(self.config.admin_conf())
            futs = admin.delete_records(targets, request_timeout=self.timeout_s)
            for tp, fut in futs.items():
                res = fut.result()
                out[tp.partition] = getattr(res, "low_watermark", tp.offset)
        return out


    def truncate_to(self, keep: Iterable[BlobRef]) -> dict[int, int]:
        """Delete, per partition, the records before the first chunk of the oldest blob of
        ``keep`` there, by the offsets in their uris (no scan); partitions holding none of
        them are left alone. Returns the new low watermark per partition that moved."""
        cuts: dict[int, int] = {}
        for ref in keep:
            hint = _hint(ref.uri)
            if hint is None:
                return {}  # a blob we cannot place: keep everything
            p, off = hint
            cuts[p] = min(off, cuts.get(p, off))
        targets = [TopicPartition(self.topic, p, off) for p, off in sorted(cuts.items())
                   if off > self._watermarks(p)[0]]
        if not targets:
            return {}
        admin = AdminClient(self.config.admin_conf())
        out = {}
        for tp, fut in admin.delete_records(targets, request_timeout=self.timeout_s).items():
            res = fut.result()
            out[tp.partition] = getattr(res, "low_watermark", tp.offset)
        return out


def _hint(uri: str) -> tuple[int, int] | None:
    q = urllib.parse.parse_qs(urllib.parse.urlsplit(uri).query)
    try:
        return int(q["partition"][0]), int(q["offset"][0])
    except (KeyError, ValueError, IndexError):
        return None


def _verified(f: Any, ref: BlobRef) -> BinaryIO:
    try:
        verify_stream(f, ref)
    except BaseException:
        f.close()
        raise
    return f


def read_manifests(
    config: KafkaConfig,
    topic: str,
    *,
    codec: Codec | None = None,
    timeout_s: float = 60.0,
) -> list[WeightManifest]:
    """Every ``WeightManifest`` on ``topic`` (read_committed, from the start to the end).

    Raises on a record that does not decode: a caller deciding what to keep (the garbage
    collector) must not act on a partial view.
    """
    try:
        reader: TopicReader[WeightManifest] = TopicReader(
            config, topic, WeightManifest, codec=codec, strict=True,
            client_id="manifest-reader", metadata_timeout_s=timeout_s)
    except KafkaException as e:
        raise WeightsError(f"manifest topic {topic} not found: {e}") from e
    try:
        entries = reader.catch_up(timeout_s)
        if not reader.caught_up():
            raise WeightsError(f"timed out reading manifests from {topic}")
    finally:
        reader.close()
    return [e.value for e in entries if e.value is not None]
