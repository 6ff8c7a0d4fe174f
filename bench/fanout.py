"""Weight fan-out: one trainer publishes real SmolLM2 deltas, N followers take each version.

The trainer replays successive SmolLM2-135M versions made by real AdamW steps
(``bench/fanout_versions.py``, cached under ``runs/fanout/``) through the project's own
publisher: ``WeightPublisher`` encodes each delta and writes it to ``weights.blobs``
(``KafkaBlobStore``), then the manifest is produced on ``weights.actor``. N followers
(threads in ``--procs`` processes) each fetch the blob with their own Kafka consumer
(``KafkaBlobStore.open``: fetch plus sha256 check), decode it and apply it
(``apply_delta``: every segment's CRC of base and result checked) to a bf16 state.

Memory: 64 private copies of the model would take 17 GB, so the followers of a process
share the state of the version before; each applies the delta into its own new copy
(``apply_delta(..., inplace=False)``), one at a time a process (``--apply-slots``), and
one of those copies becomes the process's state of the new version. The cost over a
node that applies in place is one extra copy of the model (270 MB) a follower and
version, inside the ``apply`` column. The manifests are read once a process and handed
to its followers (a node reads them itself; they are a few kB).

For each N it reports: the time from the manifest's publication until a follower has
fetched and verified the blob, and until it holds the version (p50 and max over every
follower and version); the bytes the followers fetched a version; each broker JVM's CPU
(``/proc/<pid>/stat``, less its idle rate measured for 3 s before the row) and its write
bytes (``/proc/<pid>/io`` wchar: sockets, sendfile and log writes); and, in the same
run, the physical limit: the same bytes copied to N loopback sockets by one sender.
``--remedies`` runs the largest N again with more partitions for ``weights.blobs``,
larger fetch sizes, and (3 brokers) fetching from the follower in the consumer's rack
(KIP-392). Compression stays off: ``KafkaBlobStore``
produces blobs with ``compression.type=none`` already.

    python bench/fanout.py --followers 1,4,16,64 --brokers 1,3 --versions 3 \
        --remedies --out bench/results/fanout.json
    python bench/fanout.py --report bench/results/fanout.json  # the table again
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import math
import multiprocessing as mp
import os
import queue
import re
import socket
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
if str(REPO / "bench") not in sys.path:
    sys.path.insert(0, str(REPO / "bench"))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

MB = 1e6
RACKS = ["r1", "r2", "r3"]
IDLE_S = 3.0
RESULT_TIMEOUT_S = 900.0  # a version on a loaded 2-core machine, 64 followers applying


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- pure helpers


def percentile(values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of ``values``, interpolated between ranks."""
    if not values:
        raise ValueError("percentile of no values")
    xs = sorted(values)
    k = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def proc_cpu_seconds(stat_text: str, ticks_per_s: int) -> float:
    """User plus system CPU seconds from the text of ``/proc/<pid>/stat``."""
    rest = stat_text[stat_text.rindex(")") + 2:].split()
    return (int(rest[11]) + int(rest[12])) / ticks_per_s


def proc_io_field(io_text: str, name: str) -> int:
    """One counter (``wchar``, ``rchar`` ...) from the text of ``/proc/<pid>/io``."""
    for line in io_text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == name:
            return int(value)
    raise KeyError(f"/proc/<pid>/io has no {name!r}")


def machine_busy(before: str, after: str) -> float:
    """Fraction of all CPUs busy between two readings of ``/proc/stat``'s first line."""
    a = [int(x) for x in before.split()[1:]]
    b = [int(x) for x in after.split()[1:]]
    d = [y - x for x, y in zip(a, b, strict=False)]
    total = sum(d[:8])
    idle = d[3] + d[4]
    return 1.0 - idle / total if total else 0.0


def growth_verdict(ns: list[int], times: list[float], margin: float = 1.1) -> str:
    """Whether the time grows faster than N between the two largest N (``margin`` allows
    for noise): ``superlinear (time x8.1 for x4 followers)``, ``linear or better (...)``;
    ``too few points`` below two N. A fixed floor (one fetch's latency) makes the growth
    look sublinear at small N, so only the last step is judged."""
    if len(ns) < 2 or times[-2] <= 0:
        return "too few points"
    rt, rn = times[-1] / times[-2], ns[-1] / ns[-2]
    verdict = "superlinear" if rt > margin * rn else "linear or better"
    return f"{verdict} (time x{rt:.1f} for x{rn:.0f} followers)"


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares (intercept, slope) of ``ys`` against ``xs``."""
    n = len(xs)
    if n < 2 or len(set(xs)) < 2:
        raise ValueError("a line needs two distinct x values")
    mx, my = sum(xs) / n, sum(ys) / n
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / \
        sum((x - mx) ** 2 for x in xs)
    return my - slope * mx, slope


def marginal_notes(rows: list[dict[str, Any]]) -> list[str]:
    """Per broker count: broker CPU a version as fixed cost plus cost per MB served (a
    line through the baseline rows): the throughput of a broker core at the margin."""
    out = []
    for nb in sorted({r["brokers"] for r in rows}):
        base = [r for r in rows if r["brokers"] == nb and r["variant"] == "baseline"]
        if len({r["followers"] for r in base}) < 2:
            continue
        a, b = linear_fit([r["served_bytes_per_version"] / MB for r in base],
                          [r["broker_cpu_s_per_version"] for r in base])
        per_core = f"{1 / b:.0f} MB served per broker CPU-second" if b > 0 else "no slope"
        out.append(f"{nb} broker(s): broker CPU a version = {a:.3f}s + {b * 1000:.2f} ms per MB "
                   f"served: {per_core} at the margin")
    return out


def amplification(served_bytes: float, followers: int, blob_bytes: float) -> float:
    """Bytes served over the bytes N followers need at least (1.0: no waste)."""
    return served_bytes / (followers * blob_bytes) if followers and blob_bytes else 0.0


def saturation_notes(rows: list[dict[str, Any]], busy_limit: float = 0.9) -> list[str]:
    """One line for each phase in which a broker or the machine ran out of CPU, and whether a
    single broker saturated before three did (the largest N on both)."""
    notes = []
    for r in rows:
        if r["broker_busy_max"] >= busy_limit:
            notes.append(f"{r['brokers']} broker(s), {r['variant']}, N={r['followers']}: a "
                         f"broker used {r['broker_busy_max']:.2f} cores while serving: it "
                         "saturated")
    busy = [r["machine_busy"] for r in rows if r["machine_busy"] >= busy_limit]
    if busy:
        notes.append(f"in {len(busy)} of {len(rows)} rows the machine's CPUs were at least "
                     f"{min(busy):.0%} busy (this bench and anything else running): CPU, "
                     "not Kafka, bound them")
    base = [r for r in rows if r["variant"] == "baseline"]
    top = max((r["followers"] for r in base), default=0)
    one = [r for r in base if r["brokers"] == 1 and r["followers"] == top]
    three = [r for r in base if r["brokers"] == 3 and r["followers"] == top]
    if one and three:
        a, b = one[0]["fetched_max_s"], three[0]["fetched_max_s"]
        busy = one[0]["broker_busy_max"]
        if b >= 0.75 * a:
            first = "one broker is not the bottleneck (three fetch no faster)"
        elif busy >= busy_limit:
            first = "a single broker saturates first"
        else:
            first = (f"three were faster, yet the single broker used {busy:.2f} cores at "
                     "most: not a broker limit")
        notes.append(f"N={top}: fetched by all in {a:.2f}s on 1 broker, {b:.2f}s on 3: {first}")
    return notes


# --------------------------------------------------------------------------- followers


@dataclass
class WorkerSpec:
    """What one follower process needs (picklable)."""

    worker: int
    bootstrap: str
    manifests_topic: str
    blobs_topic: str
    base_path: str
    followers: list[int]
    racks: list[str | None]
    fetch_bytes: int | None
    apply: bool
    apply_slots: int


def counting_store(config, topic: str, fetch_bytes: int | None):
    """A ``KafkaBlobStore`` that counts the bytes its consumer receives and may fetch more
    per request than the store's default (``fetch_bytes``)."""
    from confluent_kafka import Consumer

    from astraflow.kafka.config import BLOB_READER_GROUP_PREFIX
    from astraflow.weights.stores.kafka import KafkaBlobStore

    class CountingBlobStore(KafkaBlobStore):
        consumed = 0

        def _get_consumer(self):
            if self._consumer is None and fetch_bytes:
                size = max(self._max_message(), fetch_bytes)
                self._consumer = Consumer(self.config.consumer_conf(
                    f"{BLOB_READER_GROUP_PREFIX}{uuid.uuid4().hex[:8]}",
                    **{"enable.partition.eof": True, "max.partition.fetch.bytes": size,
                       "fetch.max.bytes": max(size, 52428800),
                       "queued.max.messages.kbytes": max(65536, 4 * size // 1024)}))
            return super()._get_consumer()

        def _poll(self, deadline):
            msg = super()._poll(deadline)
            if msg.error() is None:
                self.consumed += len(msg.value() or b"") + len(msg.key() or b"")
            return msg

    return CountingBlobStore(config, topic)


class _States:
    """The process's states by version, shared by its followers (see the module doc)."""

    def __init__(self, base: dict) -> None:
        self.by_version = {0: base}
        self.cond = threading.Condition()

    def get(self, version: int, timeout: float = RESULT_TIMEOUT_S) -> dict:
        with self.cond:
            if not self.cond.wait_for(lambda: version in self.by_version, timeout):
                raise TimeoutError(f"state of version {version} never came")
            return self.by_version[version]

    def put(self, version: int, state: dict) -> None:
        with self.cond:
            if version not in self.by_version:
                self.by_version[version] = state
                # no follower still reads these: version - 1 is published only when all hold it
                for v in [v for v in self.by_version if v < version - 1]:
                    del self.by_version[v]
            self.cond.notify_all()


def _follow(fid: int, store, inbox: queue.Queue, states: _States, slots: threading.Semaphore,
            apply: bool, results) -> None:
    """One follower: for each manifest, fetch and verify the blob, then apply it."""
    from astraflow.weights.apply import apply_delta

    while (item := inbox.get()) is not None:
        m, t_seen = item
        before = store.consumed
        try:
            f = store.open(m.blobs[0])  # fetch + size and sha256 check
            t_fetched, apply_s = time.time(), 0.0
            with f:
                if apply:
                    base = states.get(m.base_version)
                    with slots:
                        t_a = time.perf_counter()
                        new = apply_delta(base, f, inplace=False, threads=1)
                        apply_s = time.perf_counter() - t_a
                    states.put(m.version, new)
                    del new
        except Exception as e:  # reported to the trainer, which stops the run
            results.put(("error", fid, f"{type(e).__name__}: {e}"))
            return
        results.put(("held", fid, m.version, t_seen, t_fetched, time.time(), apply_s,
                     store.consumed - before))


def _start_followers(spec: WorkerSpec, states: _States, results):
    """(inboxes, threads, stores) of the process's followers, their clients warmed up."""
    from astraflow.kafka.config import KafkaConfig

    slots = threading.Semaphore(spec.apply_slots)
    inboxes, threads, stores = [], [], []
    for fid, rack in zip(spec.followers, spec.racks, strict=True):
        opts = {"client.rack": rack} if rack else {}
        config = KafkaConfig(bootstrap_servers=spec.bootstrap, client_id=f"follower-{fid}",
                             consumer_options=opts)
        store = counting_store(config, spec.blobs_topic, spec.fetch_bytes)
        for p in store._partitions():  # connect and learn the leaders before timing
            store._watermarks(p)
        inbox: queue.Queue = queue.Queue()
        t = threading.Thread(target=_follow, args=(fid, store, inbox, states, slots,
                                                   spec.apply, results), daemon=True)
        t.start()
        inboxes.append(inbox)
        threads.append(t)
        stores.append(store)
    return inboxes, threads, stores


def worker_main(spec: WorkerSpec, results, stop) -> None:
    """A follower process: its followers, and one manifest reader handing them out."""
    import torch
    from safetensors.torch import load_file

    from astraflow.kafka.config import KafkaConfig
    from astraflow.kafka.table import TopicReader
    from astraflow.wire.records import WeightManifest

    torch.set_num_threads(1)
    states = _States(load_file(spec.base_path))
    inboxes, threads, stores = _start_followers(spec, states, results)
    reader = TopicReader(KafkaConfig(bootstrap_servers=spec.bootstrap), spec.manifests_topic,
                         WeightManifest, client_id=f"fanout-manifests-{spec.worker}")
    results.put(("ready", spec.worker))
    try:
        while not stop.is_set():
            for entry in reader.poll(0.05):
                m, t_seen = entry.value, time.time()
                if m is not None and m.kind == "delta":
                    for inbox in inboxes:
                        inbox.put((m, t_seen))
    finally:
        for inbox in inboxes:
            inbox.put(None)
        for t in threads:
            t.join(30)
        reader.close()
        for s in stores:
            s.close()


# --------------------------------------------------------------------------- brokers


@dataclass
class Brokers:
    """A running embedded broker or cluster, and its JVMs' pids."""

    bootstrap: str
    pids: list[int]
    stop: Any


def start_brokers(n: int, work: Path) -> Brokers:
    """One embedded broker, or a 3-node cluster with a rack a node (for KIP-392)."""
    if n == 1:
        from astraflow.broker.embedded import EmbeddedBroker, free_port

        b = EmbeddedBroker(work / "broker")
        st = b.start(port=free_port(), log=log)
        return Brokers(st.bootstrap, [int(st.pid)], b.destroy)
    from astraflow.broker.cluster import EmbeddedCluster

    c = EmbeddedCluster(work / "cluster", size=n, racks=RACKS[:n] if n == 3 else None)
    c.start(log=log)
    return Brokers(c.bootstrap, [int(c.pid(i)) for i in c.node_ids], c.destroy)


def broker_counters(pids: list[int]) -> list[tuple[float, int]]:
    """(CPU seconds, wchar bytes) of each broker JVM."""
    tick = os.sysconf("SC_CLK_TCK")
    out = []
    for pid in pids:
        stat = Path(f"/proc/{pid}/stat").read_text()
        io = Path(f"/proc/{pid}/io").read_text()
        out.append((proc_cpu_seconds(stat, tick), proc_io_field(io, "wchar")))
    return out


def broker_idle_rate(pids: list[int], seconds: float = IDLE_S) -> list[float]:
    """CPU seconds a second each broker uses while nobody publishes or fetches (KRaft
    heartbeats, log cleaner ...), subtracted from the phase's CPU."""
    a = broker_counters(pids)
    time.sleep(seconds)
    b = broker_counters(pids)
    return [(y[0] - x[0]) / seconds for x, y in zip(a, b, strict=True)]


def _cpu_line() -> str:
    return Path("/proc/stat").read_text().splitlines()[0]


def create_topics(bootstrap: str, run: str, partitions: int) -> tuple[str, str]:
    """The phase's ``<run>.weights.actor`` and ``<run>.weights.blobs`` topics."""
    from confluent_kafka.admin import AdminClient, NewTopic

    from astraflow.kafka.config import KafkaConfig
    from astraflow.kafka.replication import replication
    from astraflow.weights.stores.kafka import create_blob_topic

    config = KafkaConfig(bootstrap_servers=bootstrap)
    manifests, blobs = f"{run}.weights.actor", f"{run}.weights.blobs"
    admin = AdminClient(config.admin_conf())
    rf, conf = replication(len(admin.list_topics(timeout=30).brokers))
    admin.create_topics([NewTopic(manifests, 1, rf, config=conf)])[manifests].result()
    create_blob_topic(config, blobs, partitions=partitions)
    return manifests, blobs


# --------------------------------------------------------------------------- trainer


@dataclass
class Phase:
    """One measured configuration."""

    brokers: int
    variant: str
    followers: int
    partitions: int = 1
    fetch_bytes: int | None = None
    rack: bool = False
    apply: bool = True
    records: list[tuple] = field(default_factory=list)
    published: dict[int, float] = field(default_factory=dict)
    publish_s: list[float] = field(default_factory=list)
    blob_bytes: list[int] = field(default_factory=list)
    sparsity: list[float] = field(default_factory=list)
    broker_cpu_s: list[float] = field(default_factory=list)
    broker_idle_cpu_s: list[float] = field(default_factory=list)
    broker_wchar: list[int] = field(default_factory=list)
    window_s: float = 0.0
    machine_busy: float = 0.0
    loopback_s: list[float] = field(default_factory=list)


def _await(results, want: int, phase: Phase, kind: str = "held") -> list[tuple]:
    """``want`` messages of ``kind`` from the followers (an error stops the run)."""
    got = []
    deadline = time.time() + RESULT_TIMEOUT_S
    while len(got) < want:
        try:
            msg = results.get(timeout=max(0.1, deadline - time.time()))
        except queue.Empty:
            raise TimeoutError(f"{phase.variant} N={phase.followers}: {len(got)} of "
                               f"{want} {kind} messages in {RESULT_TIMEOUT_S:.0f}s") from None
        if msg[0] == "error":
            raise RuntimeError(f"follower {msg[1]}: {msg[2]}")
        if msg[0] == kind:
            got.append(msg)
    return got


def spawn_followers(phase: Phase, brokers: Brokers, topics: tuple[str, str], base_path: Path,
                    args) -> tuple[list, Any, Any]:
    """Start the phase's follower processes; returns once every follower is ready."""
    ctx = mp.get_context("spawn")
    results, stop = ctx.Queue(), ctx.Event()
    nproc = min(phase.followers, args.procs)
    procs = []
    for w in range(nproc):
        fids = list(range(w, phase.followers, nproc))
        racks = [RACKS[f % 3] if phase.rack else None for f in fids]
        spec = WorkerSpec(w, brokers.bootstrap, topics[0], topics[1], str(base_path), fids,
                          racks, phase.fetch_bytes, phase.apply, args.apply_slots)
        p = ctx.Process(target=worker_main, args=(spec, results, stop), daemon=True)
        p.start()
        procs.append(p)
    _await(results, nproc, phase, "ready")
    return procs, results, stop


def publish_versions(phase: Phase, brokers: Brokers, topics: tuple[str, str], base: dict,
                     deltas: list[bytes], results) -> None:
    """Publish every version (the next once all followers hold the last), timing it all."""
    import torch
    from confluent_kafka import Producer

    from astraflow.kafka.config import KafkaConfig
    from astraflow.weights.apply import apply_delta
    from astraflow.weights.publisher import WeightPublisher
    from astraflow.weights.stores.kafka import KafkaBlobStore
    from astraflow.wire.codec import make_codec

    config = KafkaConfig(bootstrap_servers=brokers.bootstrap)
    codec = make_codec()
    producer = Producer(config.producer_conf())
    store = KafkaBlobStore(config, topics[1])
    work = {k: t.clone() for k, t in base.items()}
    publisher = WeightPublisher(store, "actor", anchor_interval=0, version=0, state=work)
    idle = broker_idle_rate(brokers.pids)
    before, cpu0, t_start = broker_counters(brokers.pids), _cpu_line(), time.time()
    for v, blob in enumerate(deltas, start=1):
        with torch.no_grad():
            apply_delta(work, blob, inplace=True)
        t_pub = time.perf_counter()
        (m,) = publisher.publish(work, version=v, trainer_step=v)
        phase.publish_s.append(time.perf_counter() - t_pub)
        phase.blob_bytes.append(m.encoded_bytes)
        phase.sparsity.append(m.sparsity)
        phase.published[v] = time.time()
        producer.produce(topics[0], key=b"actor", value=codec.encode(m, topics[0]))
        producer.flush(30)
        phase.records += _await(results, phase.followers, phase)
    phase.window_s = time.time() - t_start
    after = broker_counters(brokers.pids)
    phase.machine_busy = machine_busy(cpu0, _cpu_line())
    phase.broker_cpu_s = [a[0] - b[0] for a, b in zip(after, before, strict=True)]
    phase.broker_idle_cpu_s = [rate * phase.window_s for rate in idle]
    phase.broker_wchar = [a[1] - b[1] for a, b in zip(after, before, strict=True)]
    store.close()


# --------------------------------------------------------------------------- loopback


def _send_all(conn: socket.socket, payload: bytes) -> None:
    conn.sendall(payload)


def loopback_copy(nbytes: int, n: int, *,
                  send: Callable[[socket.socket, bytes], None] = _send_all) -> list[float]:
    """Seconds until each of ``n`` loopback sockets has received ``nbytes`` that one
    process sends to all of them at once (a thread a socket, as a broker's network
    threads): the physical limit of serving the same bytes.

    Every socket's bytes are counted and hashed as they arrive; a socket that got fewer
    bytes than were sent, or other bytes, raises ``RuntimeError``, so a time is never
    reported for a copy that did not arrive. ``send`` writes the payload to one connection
    (tests replace it to cut or corrupt a delivery)."""
    payload = os.urandom(nbytes)
    want = hashlib.sha256(payload).hexdigest()
    srv = socket.create_server(("127.0.0.1", 0), backlog=n)
    port = srv.getsockname()[1]
    done: list[tuple[float, int, str]] = []
    go = threading.Event()

    def client() -> None:
        with socket.create_connection(("127.0.0.1", port)) as s:
            buf, got, digest = bytearray(1 << 20), 0, hashlib.sha256()
            while got < nbytes:
                k = s.recv_into(buf)
                if not k:  # the sender closed early: counted short below
                    break
                digest.update(memoryview(buf)[:k])
                got += k
            done.append((time.perf_counter(), got, digest.hexdigest()))

    def sender(conn: socket.socket) -> None:
        go.wait()
        try:
            send(conn, payload)
        finally:
            # EOF, so that a short send cannot leave a client waiting forever
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)

    clients = [threading.Thread(target=client) for _ in range(n)]
    for t in clients:
        t.start()
    conns = [srv.accept()[0] for _ in range(n)]
    senders = [threading.Thread(target=sender, args=(c,)) for c in conns]
    for t in senders:
        t.start()
    t0 = time.perf_counter()
    go.set()
    for t in senders + clients:
        t.join()
    for c in conns:
        c.close()
    srv.close()
    bad = [(got, digest) for _, got, digest in done if got != nbytes or digest != want]
    if bad or len(done) != n:
        got, digest = bad[0] if bad else (0, "")
        raise RuntimeError(
            f"loopback copy: {len(bad) + n - len(done)} of {n} sockets did not receive the "
            f"{nbytes} bytes sent (one got {got} bytes, sha256 {digest[:12] or '-'} against "
            f"{want[:12]})")
    return [t - t0 for t, _, _ in done]


# --------------------------------------------------------------------------- report


def summarize(p: Phase) -> dict[str, Any]:
    """The table row of a phase (everything per version is a mean over versions)."""
    k = len(p.blob_bytes)
    fetched = [r[4] - p.published[r[2]] for r in p.records]
    held = [r[5] - p.published[r[2]] for r in p.records]
    fetch_s = [max(r[4] - r[3], 1e-6) for r in p.records]
    rates = [r[7] / s for r, s in zip(p.records, fetch_s, strict=True)]
    blob = sum(p.blob_bytes) / k
    served = sum(r[7] for r in p.records) / k
    all_fetched = [max(r[4] for r in p.records if r[2] == v) - p.published[v]
                   for v in p.published]
    raw = sum(p.broker_cpu_s) / k
    cpu = max(0.0, raw - sum(p.broker_idle_cpu_s) / k)
    return {
        "brokers": p.brokers, "variant": p.variant, "followers": p.followers,
        "partitions": p.partitions, "versions": k, "delta_bytes": blob,
        "sparsity": sum(p.sparsity) / k, "publish_s": sum(p.publish_s) / k,
        "fetched_p50_s": percentile(fetched, 50), "fetched_max_s": max(fetched),
        "held_p50_s": percentile(held, 50), "held_max_s": max(held),
        "apply_p50_s": percentile([r[6] for r in p.records], 50),
        "served_bytes_per_version": served,
        "amplification": amplification(served, p.followers, blob),
        "broker_wchar_per_version": sum(p.broker_wchar) / k,
        "broker_cpu_s_per_version": cpu, "broker_cpu_raw_s_per_version": raw,
        "broker_busy_max": max(p.broker_cpu_s) / p.window_s if p.window_s else 0.0,
        "machine_busy": p.machine_busy,
        "follower_mb_s_p50": percentile(rates, 50) / MB,
        "aggregate_mb_s": served / (sum(all_fetched) / k) / MB,
        "broker_mb_per_cpu_s": served / cpu / MB if cpu else 0.0,
        "loopback_p50_s": percentile(p.loopback_s, 50) if p.loopback_s else 0.0,
        "loopback_max_s": max(p.loopback_s) if p.loopback_s else 0.0,
        "loopback_mb_s": (blob * p.followers / max(p.loopback_s) / MB) if p.loopback_s
        else 0.0,
    }


COLUMNS = [
    ("brokers", "brk", "{:>3}"), ("variant", "variant", "{:<11}"),
    ("followers", "N", "{:>3}"), ("delta_bytes", "delta MB", "{:>8.2f}"),
    ("fetched_p50_s", "fetch p50", "{:>9.3f}"), ("fetched_max_s", "fetch max", "{:>9.3f}"),
    ("held_p50_s", "held p50", "{:>8.3f}"), ("held_max_s", "held max", "{:>8.3f}"),
    ("apply_p50_s", "apply s", "{:>7.3f}"),
    ("served_bytes_per_version", "served MB/v", "{:>11.2f}"),
    ("broker_wchar_per_version", "wchar MB/v", "{:>10.2f}"),
    ("broker_cpu_s_per_version", "brk CPU s/v", "{:>11.3f}"),
    ("broker_cpu_raw_s_per_version", "raw", "{:>6.3f}"),
    ("broker_busy_max", "brk busy", "{:>8.2f}"), ("machine_busy", "host busy", "{:>9.0%}"),
    ("follower_mb_s_p50", "MB/s 1 fol", "{:>10.1f}"), ("aggregate_mb_s", "MB/s all", "{:>8.1f}"),
    ("broker_mb_per_cpu_s", "MB/brk-CPU-s", "{:>12.1f}"),
    ("loopback_p50_s", "loop p50", "{:>8.4f}"), ("loopback_max_s", "loop max", "{:>8.4f}"),
]
_SCALED = {"delta_bytes", "served_bytes_per_version", "broker_wchar_per_version"}


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as one fixed-width table (times in seconds, sizes in MB)."""
    widths = [int(re.search(r"[<>](\d+)", f).group(1)) for _, _, f in COLUMNS]
    head = " ".join(h.rjust(max(w, len(h))) for (_, h, _), w in zip(COLUMNS, widths,
                                                                   strict=True))
    lines = [head]
    for r in rows:
        cells = [f.format(r[k] / MB if k in _SCALED else r[k]) for k, _, f in COLUMNS]
        lines.append(" ".join(cells))
    return "\n".join(lines)


# --------------------------------------------------------------------------- main


def run_phase(phase: Phase, brokers: Brokers, base_path: Path, base: dict,
              deltas: list[bytes], args) -> dict[str, Any]:
    """Topics, followers, versions, then the loopback copy of the same bytes."""
    run = f"fanout-{uuid.uuid4().hex[:6]}-b{phase.brokers}-{phase.variant}-n{phase.followers}"
    topics = create_topics(brokers.bootstrap, run, phase.partitions)
    procs, results, stop = spawn_followers(phase, brokers, topics, base_path, args)
    try:
        publish_versions(phase, brokers, topics, base, deltas, results)
    finally:
        stop.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    for blob in phase.blob_bytes:
        phase.loopback_s += loopback_copy(blob, phase.followers)
    row = summarize(phase)
    log(f"{phase.brokers} broker(s) {phase.variant} N={phase.followers}: fetched max "
        f"{row['fetched_max_s']:.3f}s, held max {row['held_max_s']:.3f}s, loopback max "
        f"{row['loopback_max_s']:.4f}s")
    return row


def phases_for(brokers: int, ns: list[int], remedies: bool, apply: bool = True
               ) -> list[Phase]:
    """The baseline at every N, then, at the largest N, the remedies beside a baseline of
    their own, all fetching and verifying only: they act on the brokers' side, and the
    followers' decoding would hide them on a small machine."""
    out = [Phase(brokers, "baseline", n, apply=apply) for n in ns]
    if remedies:
        top = max(ns)
        if apply:
            out.append(Phase(brokers, "fetch-only", top, apply=False))
        out += [Phase(brokers, "partitions3", top, partitions=3, apply=False),
                Phase(brokers, "fetch32MiB", top, fetch_bytes=32 << 20, apply=False)]
        if brokers == 3:
            out.append(Phase(brokers, "rack-fetch", top, rack=True, apply=False))
    return out


def load_versions(args) -> tuple[Path, dict, list[bytes], dict]:
    """(base path, base state, delta blobs, record) of the cached AdamW versions."""
    from safetensors.torch import load_file

    sys.path.insert(0, str(REPO / "bench"))
    from fanout_versions import cache_dir, make_versions

    model = Path(args.model)
    if not (model / "config.json").exists():
        raise SystemExit(f"--model {model}: no model there; `astraflow model import smollm2 "
                         f"{model}` first")
    out = cache_dir(Path(args.cache), model, args.lr, args.seed)
    record = make_versions(model, out, args.versions, args.lr, args.seed, log=log)
    deltas = [(out / f"delta-v{v}.afwb").read_bytes() for v in range(1, args.versions + 1)]
    base_path = out / "base.safetensors"
    return base_path, load_file(base_path), deltas, record


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    ap.add_argument("--followers", type=ints, default=[1, 4, 16, 64])
    ap.add_argument("--brokers", type=ints, default=[1, 3])
    ap.add_argument("--versions", type=int, default=3, help="versions published per N")
    ap.add_argument("--remedies", action="store_true",
                    help="also run the largest N with the Kafka remedies")
    ap.add_argument("--procs", type=int, default=2, help="follower processes (default 2)")
    ap.add_argument("--apply-slots", type=int, default=1,
                    help="followers of a process applying at once (memory: 270 MB each)")
    ap.add_argument("--no-apply", action="store_true", help="fetch and verify only")
    ap.add_argument("--model", default=str(REPO / "runs" / "fanout" / "smollm2"))
    ap.add_argument("--cache", default=str(REPO / "runs" / "fanout"))
    ap.add_argument("--lr", type=float, default=1e-6, help="AdamW learning rate")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", help="write the rows and notes as JSON here")
    ap.add_argument("--report", metavar="FILE.json",
                    help="print the table and notes of an earlier run's --out again")
    args = ap.parse_args(argv)
    if bad := [b for b in args.brokers if b not in (1, 3)]:
        ap.error(f"--brokers: 1 or 3, not {bad}")
    if not args.followers or min(args.followers) < 1:
        ap.error("--followers: positive counts, e.g. 1,4,16,64")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report:  # the table and notes of an earlier run, by this code
        doc = json.loads(Path(args.report).read_text())
        args = argparse.Namespace(**{**doc["args"], "out": args.out, "report": None})
        meta = doc.get("meta") or run_meta("fanout", [])
        print(report(args, doc["versions"], doc["rows"], [n for n in doc["notes"]
                                                           if "did not finish" in n],
                     doc.get("load_before", 0.0), args.versions, meta))
        return 0
    meta = run_meta("fanout", ["python", *sys.argv] if argv is None
                    else ["python", "bench/fanout.py", *argv])  # before the run: its commit
    base_path, base, deltas, record = load_versions(args)
    load = os.getloadavg()[0]
    rows: list[dict[str, Any]] = []
    failed: list[str] = []
    with tempfile.TemporaryDirectory(prefix="bench-fanout-") as tmp:
        for nb in args.brokers:
            brokers = start_brokers(nb, Path(tmp) / f"b{nb}")
            try:
                for phase in phases_for(nb, args.followers, args.remedies, not args.no_apply):
                    try:
                        rows.append(run_phase(phase, brokers, base_path, base, deltas, args))
                    except (TimeoutError, RuntimeError) as e:  # noted; the next phase runs
                        log(f"phase failed: {e}")
                        failed.append(f"{nb} broker(s), {phase.variant}, N={phase.followers}"
                                      f" did not finish: {e}")
                    report(args, record, rows, failed, load, len(deltas), meta)
            finally:
                brokers.stop()
    print(report(args, record, rows, failed, load, len(deltas), meta))
    return 1 if failed else 0


def report(args, record: dict, rows: list[dict[str, Any]], failed: list[str], load: float,
           versions: int, meta: dict[str, Any] | None = None) -> str:
    """The table and its notes; written to ``--out`` with ``meta`` (after every phase, so
    that a run cut short keeps what it measured)."""
    notes = [f"time to the max N ({r[0]} broker(s)): fetched {r[1]}, held {r[2]}"
             for r in _growth(rows)] + marginal_notes(rows) + saturation_notes(rows) + failed
    text = "\n".join([
        f"\nSmolLM2-135M, {versions} AdamW versions (lr {args.lr:g}), host {os.cpu_count()} "
        f"CPUs, load average {load:.2f} before / {os.getloadavg()[0]:.2f} now; followers "
        f"in {args.procs} processes", table(rows), *("- " + n for n in notes)])
    if args.out:
        Path(args.out).write_text(json.dumps({"meta": meta, "args": vars(args), "versions": record,
                                              "rows": rows, "notes": notes,
                                              "load_before": load}, indent=1))
    return text


def _growth(rows: list[dict[str, Any]]) -> list[tuple[int, str, str]]:
    out = []
    for nb in sorted({r["brokers"] for r in rows}):
        base = sorted((r for r in rows if r["brokers"] == nb and r["variant"] == "baseline"),
                      key=lambda r: r["followers"])
        ns = [r["followers"] for r in base]
        out.append((nb, growth_verdict(ns, [r["fetched_max_s"] for r in base]),
                    growth_verdict(ns, [r["held_max_s"] for r in base])))
    return out


if __name__ == "__main__":
    sys.exit(main())

