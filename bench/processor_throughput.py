"""One transactional processor against raw consume+produce, and the codec against fastavro.

Prints, from one run on one broker:
- Avro encode and decode records/s of AstraFlow's codec (record objects in and out, the
  single-object header written and checked) and of plain fastavro (dicts in and out; the
  body after the header) on the same records and messages, in rounds taken in turn; the
  ratio is the median of the rounds' ratios;
- throughput at saturation: ``--records`` records of ~``--record-bytes`` B queued first, then
  drained, from the first record consumed to the last one delivered (committed), by a raw
  forwarder (plain consume + decode + produce, auto-committed offsets, no transactions) and
  by a passthrough processor (decode + check, exactly once) at ``--max-batch`` (the
  topology default: the 100 ms commit interval governs) and at ``--small-batch`` inputs per
  transaction, in ``--rounds`` (at least 5) interleaved rounds: raw, processor, raw,
  processor, ... (each round also runs the bytes-only forwarder and the small batch after
  that pair). Each round's raw and processor rates are printed with their ratio, and the
  ratio reported is the median of the rounds' ratios, so that load from other jobs on a
  shared machine hits both sides of a ratio alike (throughput first: it also warms the
  broker's JVM up);
- per-hop latency p50/p99 at light load: both hops side by side, one record to each every
  ``--interval-ms``, from the source producer to a ``read_committed`` reader of the output.

Runs against ASTRAFLOW_BOOTSTRAP if set, else the running embedded broker, else a
temporary embedded broker it starts and removes; a few minutes at most. Usage:

    python bench/processor_throughput.py [--records 100000] [--record-bytes 1024]
        [--partitions 3] [--max-batch 100000] [--small-batch 1000] [--rounds 5]
        [--light 200] [--interval-ms 20] [--codec-rounds 7] [--out FILE.json]

``--out`` writes the printed figures as JSON, with the command, commit, machine and date
(``bench/report.py`` makes ``docs/results/processor_throughput.md`` from it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from confluent_kafka import Consumer, Producer
from fastavro import parse_schema, schemaless_reader, schemaless_writer

from astraflow.broker.embedded import EmbeddedBroker, free_port
from astraflow.config.topology import ProcessorSpec, Topology, parse_topology
from astraflow.dataflow.runtime import ProcessorRuntime
from astraflow.kafka.clients import make_admin
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.topics import apply_topics
from astraflow.launch.runs import Runs
from astraflow.wire.codec import SingleObjectCodec
from astraflow.wire.records import Task, TrajectoryGroup

sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

HEADER = 10  # single-object encoding: magic and fingerprint before the Avro body


def bootstrap_or_start() -> tuple[str, EmbeddedBroker | None]:
    if os.environ.get("ASTRAFLOW_BOOTSTRAP"):
        return os.environ["ASTRAFLOW_BOOTSTRAP"], None
    running = EmbeddedBroker().bootstrap()
    if running:
        return running, None
    broker = EmbeddedBroker(state=tempfile.mkdtemp(prefix="astraflow-bench-"))
    return broker.start(port=free_port()).bootstrap, broker


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=100_000, help="records for throughput")
    ap.add_argument("--record-bytes", type=int, default=1024, help="size of a record")
    ap.add_argument("--partitions", type=int, default=3)
    default_batch = ProcessorSpec.model_fields["max_batch"].default
    ap.add_argument("--max-batch", type=int, default=default_batch,
                    help="inputs per transaction, at most (default: the topology's)")
    ap.add_argument("--small-batch", type=int, default=1000,
                    help="a second max_batch, at which each commit's cost shows")
    ap.add_argument("--rounds", type=int, default=5,
                    help="interleaved throughput rounds (raw, processor, ...), at least 5")
    ap.add_argument("--light", type=int, default=200, help="records for latency")
    ap.add_argument("--interval-ms", type=float, default=20.0, help="light load: one per")
    ap.add_argument("--codec-rounds", type=int, default=7)
    ap.add_argument("--out", type=Path, default=None,
                    help="write the figures as JSON here (for bench/report.py)")
    args = ap.parse_args()
    if args.rounds < 5:
        ap.error(f"--rounds {args.rounds}: at least 5 (the ratio is a median of rounds)")
    print("$ python " + " ".join(shlex.quote(a) for a in sys.argv))
    meta = run_meta("processor_throughput", ["python", *sys.argv])  # before the run: its commit
    codec = codec_table(args)  # first: the broker is idle then
    bootstrap, own_broker = bootstrap_or_start()
    try:
        hop = run(bootstrap, args)
    finally:
        if own_broker:
            own_broker.destroy()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "out"}
        args.out.write_text(json.dumps({"meta": meta, "args": settings, **hop, "codec": codec},
                                       indent=1) + "\n")
        print(f"wrote {args.out}")


def task(i: int, pad: str) -> Task:
    return Task(task_id=f"t{i:08d}", prompt_id=f"p{i:08d}", workflow="w", payload=pad,
                source="bench", created_at_ms=1)


def padding(codec: SingleObjectCodec, record_bytes: int) -> str:
    empty = len(codec.encode(task(0, "")))
    return "x" * max(0, record_bytes - empty - 2)  # 2: the longer length varint


# --- the hop: raw forwarder, processor, and what measures them ---------------------------
class RawForwarder:
    """Consume + produce with plain clients (auto-committed offsets, no transactions),
    polling like the loop does: return as soon as records arrive, flush when a poll finds
    nothing more. ``decode``: each record is decoded (the codec, ``expect=Task``), as any
    consumer that looks at its records does; else bytes only."""

    def __init__(self, config: KafkaConfig, group: str, src: str, dst: str, max_batch: int,
                 decode: bool = True):
        self.consumer = Consumer(config.consumer_conf(group, **{"enable.auto.commit": True}))
        self.consumer.subscribe([src])
        self.producer = Producer(config.producer_conf())
        self.dst, self.max_batch = dst, max_batch
        self.codec = SingleObjectCodec() if decode else None
        self.consumed = 0
        self.first_at: float | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        pending = False
        while not self._stop.is_set():
            if pending:
                msgs = self.consumer.consume(self.max_batch, 0)
            else:
                msgs = self.consumer.consume(1, 0.5)  # consume(n, t) would wait for all n
                if msgs:
                    msgs += self.consumer.consume(self.max_batch - 1, 0)
            msgs = [m for m in msgs if m.error() is None]
            if not msgs:
                if pending:
                    self.producer.flush()
                    pending = False
                continue
            if self.first_at is None:
                self.first_at = time.perf_counter()
            for m in msgs:
                if self.codec is not None:
                    self.codec.decode(m.value(), m.topic(), m.partition(), m.offset(), Task)
                self._produce(m.value(), m.key())
            self.consumed += len(msgs)
            self.producer.poll(0)
            pending = True

    def _produce(self, value: bytes, key: bytes | None) -> None:
        while True:
            try:
                self.producer.produce(self.dst, value, key)
                return
            except BufferError:
                self.producer.poll(0.05)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)
        self.producer.flush()
        self.consumer.close()


class Sink:
    """Reads a hop's output (``read_committed``): when each key arrived, and how many."""

    def __init__(self, config: KafkaConfig, topic: str):
        conf = config.consumer_conf(f"sink-{uuid.uuid4().hex[:8]}")
        self.consumer = Consumer(conf)
        self.consumer.subscribe([topic])
        self.arrived: dict[bytes, float] = {}
        self.count = 0
        self.last_at = 0.0
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            got = self.consumer.consume(1, 0.05)  # consume(n, t) would wait for all n
            for m in got + self.consumer.consume(1000, 0) if got else []:
                if m.error() is None:
                    now = time.perf_counter()
                    self.arrived.setdefault(m.key(), now)
                    self.count += 1
                    self.last_at = now

    def wait(self, what: Callable[[], bool], timeout_s: float, label: str) -> None:
        deadline = time.monotonic() + timeout_s
        while not what():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{label}: nothing after {timeout_s:.0f}s")
            time.sleep(0.002)

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)
        self.consumer.close()


def latency(config: KafkaConfig, hops: dict[str, tuple[str, str]], args, pad: str
            ) -> dict[str, list[float]]:
    """Per hop, per record: ms from producing to its input to reading it from its output.
    The hops run side by side and take turns: one record to each every ``interval_ms``,
    after a warm-up record has made it through each."""
    codec = SingleObjectCodec()
    producer = Producer(config.producer_conf())
    sinks = {name: Sink(config, dst) for name, (_, dst) in hops.items()}
    sent: dict[str, dict[bytes, float]] = {name: {} for name in hops}
    tag = uuid.uuid4().hex[:8]  # keys of this call only
    try:
        for name, (src, _) in hops.items():
            warm = f"{tag}-warm-up".encode()
            producer.produce(src, codec.encode(task(-1, pad)), warm)
            producer.flush()
            sinks[name].wait(lambda s=sinks[name], w=warm: w in s.arrived, 120, "warm-up")
        for i in range(args.light):
            for name, (src, _) in hops.items():
                key, value = f"{tag}-{i}".encode(), codec.encode(task(i, pad))
                sent[name][key] = time.perf_counter()
                producer.produce(src, value, key)
                producer.flush()
                time.sleep(args.interval_ms / 1000 / len(hops))
        for name, sink in sinks.items():
            sink.wait(lambda s=sink, n=name: all(k in s.arrived for k in sent[n]), 60, name)
        return {name: [(sinks[name].arrived[k] - t) * 1000 for k, t in sent[name].items()]
                for name in hops}
    finally:
        for sink in sinks.values():
            sink.stop()


def preload(config: KafkaConfig, topic: str, n: int, pad: str) -> float:
    """Queue ``n`` records on ``topic``; records/s of the plain producer."""
    codec = SingleObjectCodec()
    values = [codec.encode(task(i, pad)) for i in range(n)]
    producer = Producer(config.producer_conf())
    t0 = time.perf_counter()
    for i, v in enumerate(values):
        while True:
            try:
                producer.produce(topic, v, f"p{i}".encode())
                break
            except BufferError:
                producer.poll(0.05)
    producer.flush()
    return n / (time.perf_counter() - t0)


def raw_throughput(config: KafkaConfig, group: str, src: str, dst: str, n: int,
                   max_batch: int, decode: bool) -> float:
    fwd = RawForwarder(config, group, src, dst, max_batch, decode)
    while fwd.consumed < n:
        time.sleep(0.002)
    fwd.producer.flush()  # delivered: the same end as the processor's commit
    end = time.perf_counter()
    fwd.stop()
    return n / (end - fwd.first_at)


def processor_throughput(topo: Topology, config: KafkaConfig, name: str, n: int) -> float:
    runtime = ProcessorRuntime(topo, name, instance="bench", config=config)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    c = runtime.counters
    while c.consumed == 0:
        time.sleep(0.002)
    first = time.perf_counter()
    while c.produced < n:
        time.sleep(0.002)
    end = time.perf_counter()
    runtime.stop()
    thread.join(30)
    if c.dead_lettered or c.produced != n:
        raise RuntimeError(f"{name}: produced {c.produced}, dead-lettered {c.dead_lettered}")
    return n / (end - first)


# --- the codec against plain fastavro -----------------------------------------------------
def group_record(i: int) -> TrajectoryGroup:
    from astraflow.wire.records import Sequence

    seqs = [Sequence(policy="actor", token_ids=list(range(64)), loss_mask=[0] * 16 + [1] * 48,
                     logprobs=[-0.5] * 64, versions=[-1] * 16 + [3] * 48, reward=1.0,
                     sample_index=k, finish_reason="stop") for k in range(4)]
    return TrajectoryGroup(group_id=f"g{i}", prompt_id=f"p{i}", task_id=f"t{i}", workflow="w",
                           source="bench", raas_id="r", pool="p", sequences=seqs,
                           rewards=[1.0] * 4, created_at_ms=1)


def rounds(ours: Callable[[], None], plain: Callable[[], None], n: int, k: int
           ) -> tuple[float, float, float]:
    """Best records/s of each over ``k`` rounds taken in turn, and the median of the
    per-round ratios (noise on a shared machine hits both alike)."""
    best_o = best_p = 0.0
    ratios = []
    for _ in range(k):
        t0 = time.perf_counter()
        ours()
        t1 = time.perf_counter()
        plain()
        t2 = time.perf_counter()
        best_o, best_p = max(best_o, n / (t1 - t0)), max(best_p, n / (t2 - t1))
        ratios.append((t2 - t1) / (t1 - t0))
    return best_o, best_p, statistics.median(ratios)


def codec_rows(label: str, records: list, k: int) -> list[tuple[str, float, float, float]]:
    codec = SingleObjectCodec()
    ws = codec.schemas.reader(records[0].avro_name)
    schema = parse_schema(ws.expanded)  # what a plain fastavro user does
    dicts = [r.to_dict() for r in records]
    messages = [codec.encode(r) for r in records]
    cls = type(records[0])

    def enc_ours() -> None:
        for r in records:
            codec.encode(r)

    def enc_plain() -> None:
        for d in dicts:
            buf = io.BytesIO()
            schemaless_writer(buf, schema, d)
            buf.getvalue()

    def dec_ours() -> None:
        for m in messages:
            codec.decode(m, expect=cls)

    def dec_plain() -> None:  # the same messages: the body after the 10-byte header
        for m in messages:
            schemaless_reader(io.BytesIO(m[HEADER:]), schema, None)

    n = len(records)
    return [(f"encode {label}", *rounds(enc_ours, enc_plain, n, k)),
            (f"decode {label}", *rounds(dec_ours, dec_plain, n, k))]


def codec_table(args) -> list[dict[str, Any]]:
    """Print the codec against fastavro; the rows, for ``--out``."""
    pad = padding(SingleObjectCodec(), args.record_bytes)
    rows = codec_rows(f"Task ({args.record_bytes} B)", [task(i, pad) for i in range(20_000)],
                      args.codec_rounds)
    rows += codec_rows("TrajectoryGroup (4x64 tokens)", [group_record(i) for i in range(2_000)],
                       args.codec_rounds)
    print(f"\n{'Avro codec, records/s':38} {'AstraFlow':>10} {'fastavro':>10} {'ratio':>6}")
    for label, ours, plain, ratio in rows:
        print(f"{label:38} {ours:10.0f} {plain:10.0f} {ratio:6.2f}")
    return [{"case": label, "AstraFlow records/s": round(ours), "fastavro records/s": round(plain),
             "AstraFlow / fastavro": round(ratio, 3)} for label, ours, plain, ratio in rows]


# --- the run --------------------------------------------------------------------------------
def bench_topology(bootstrap: str, args) -> Topology:
    """Topics for each hop; processors ``lat`` (light load) and, per throughput round,
    ``tp<r>`` (``--max-batch``) and ``small<r>`` (``--small-batch``), each its own group."""
    parts = {"partitions": args.partitions, "schema": "Task"}
    fwd = {"kind": "passthrough", "poll_timeout_s": 0.5}
    processors = {"lat": {**fwd, "inputs": ["lat.in"], "outputs": ["lat.out"],
                          "max_batch": args.max_batch}}
    for r in range(args.rounds):
        for name, batch in (("tp", args.max_batch), ("small", args.small_batch)):
            processors[f"{name}{r}"] = {**fwd, "inputs": ["tp.in"], "outputs": ["tp.out"],
                                        "max_batch": batch}
    return parse_topology({
        "run": f"bench-{uuid.uuid4().hex[:8]}",
        "kafka": {"bootstrap_servers": bootstrap},
        "topics": {t: dict(parts) for t in ("lat.in", "lat.out", "lat.raw.in", "lat.raw.out",
                                            "tp.in", "tp.out", "tp.raw.out")},
        "processors": processors,
    })


def run(bootstrap: str, args: argparse.Namespace) -> dict[str, Any]:
    config = KafkaConfig(bootstrap_servers=bootstrap, client_id="astraflow-bench")
    topo = bench_topology(bootstrap, args)
    apply_topics(make_admin(config), topo.resolved_topics())
    try:
        return measure(config, topo, args)
    finally:  # a shared broker keeps no bench topics
        Runs(config).delete(topo.run)


def measure(config: KafkaConfig, topo: Topology, args: argparse.Namespace) -> dict[str, Any]:
    full = topo.full_name
    pad = padding(SingleObjectCodec(), args.record_bytes)
    print(f"\nbroker {config.bootstrap_servers}; {args.partitions} partitions; records of "
          f"{len(SingleObjectCodec().encode(task(0, pad)))} B on the wire; latency: "
          f"{args.light} records per hop, one per {args.interval_ms:g} ms; throughput: "
          f"{args.records} records, {args.rounds} rounds")
    # throughput first: it warms the broker's JVM up, which a cold one's latency would show
    produce_rate = preload(config, full("tp.in"), args.records, pad)
    rates: dict[str, list[float]] = {"raw": [], "tp": [], "bytes": [], "small": []}
    print(f"\n{'round':>5} {'raw c+p':>9} {'processor':>10} {'ratio':>6}   (max_batch "
          f"{args.max_batch}, records/s)")
    for r in range(args.rounds):  # raw and processor back to back: noise hits both alike
        for kind in rates:
            if kind in ("raw", "bytes"):
                rate = raw_throughput(config, f"{topo.run}.{kind}{r}", full("tp.in"),
                                      full("tp.raw.out"), args.records, args.max_batch,
                                      decode=kind == "raw")
            else:
                rate = processor_throughput(topo, config, f"{kind}{r}", args.records)
            rates[kind].append(rate)
        print(f"{r + 1:5d} {rates['raw'][-1]:9.0f} {rates['tp'][-1]:10.0f} "
              f"{rates['tp'][-1] / rates['raw'][-1]:6.2f}", flush=True)
    raw = RawForwarder(config, f"{topo.run}.raw-lat", full("lat.raw.in"), full("lat.raw.out"),
                       args.max_batch)
    proc = start_processor(topo, config, "lat")
    try:
        lat = latency(config, {"raw": (full("lat.raw.in"), full("lat.raw.out")),
                               "processor": (full("lat.in"), full("lat.out"))}, args, pad)
    finally:
        raw.stop()
        stop_processor(proc)
    return report(lat, rates, produce_rate, args)


def start_processor(topo: Topology, config: KafkaConfig, name: str) -> tuple:
    runtime = ProcessorRuntime(topo, name, instance="bench", config=config)
    thread = threading.Thread(target=runtime.run, daemon=True)
    thread.start()
    return runtime, thread


def stop_processor(hop: tuple) -> None:
    runtime, thread = hop
    runtime.stop()
    thread.join(30)


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def report(lat: dict[str, list[float]], rates: dict[str, list[float]], produce_rate: float,
           args: argparse.Namespace) -> dict[str, Any]:
    """Print the hop's figures; the same as a dict, for ``--out``."""
    rows: list[dict[str, Any]] = []
    print("\nraw c+p: plain consume + decode + produce, auto-committed offsets, no "
          "transactions;\nprocessor: passthrough, exactly once (decode, check, one "
          "transaction per commit)")
    print(f"{'one hop':44} {'raw c+p':>9} {'processor':>10} {'ratio':>6}")
    for label, q in (("latency p50, light load (ms)", 0.5),
                     ("latency p99, light load (ms)", 0.99)):
        raw, proc = pct(lat["raw"], q), pct(lat["processor"], q)
        print(f"{label:44} {raw:9.1f} {proc:10.1f} {proc / raw:6.2f}")
        rows.append({"one hop": label, "raw c+p": round(raw, 2), "processor": round(proc, 2),
                     "processor / raw": round(proc / raw, 3)})
    med = {k: statistics.median(v) for k, v in rates.items()}
    print(f"\n{'throughput, records/s':28} " + " ".join(f"{'round ' + str(i + 1):>9}"
                                                      for i in range(len(rates['raw'])))
          + f" {'median':>9}")
    for kind, label in (("raw", "raw c+p"), ("tp", f"processor, max_batch {args.max_batch}"),
                        ("small", f"processor, max_batch {args.small_batch}")):
        print(f"{label:28} " + " ".join(f"{r:9.0f}" for r in rates[kind])
              + f" {med[kind]:9.0f}")
    for kind, label in (("tp", f"ratio, max_batch {args.max_batch}"),
                        ("small", f"ratio, max_batch {args.small_batch}")):
        ratios = [p / r for p, r in zip(rates[kind], rates["raw"])]
        print(f"{label:28} " + " ".join(f"{r:9.2f}" for r in ratios)
              + f" {statistics.median(ratios):9.2f}")
    for kind, batch in (("tp", args.max_batch), ("small", args.small_batch)):
        ratios = [p / r for p, r in zip(rates[kind], rates["raw"])]
        label = f"throughput (records/s), max_batch {batch}"
        print(f"{label:44} {med['raw']:9.0f} {med[kind]:10.0f} {statistics.median(ratios):6.2f}")
        rows.append({"one hop": label, "raw c+p": round(med["raw"]), "processor": round(med[kind]),
                     "processor / raw": round(statistics.median(ratios), 3)})
    print(f"(medians of {args.rounds} interleaved rounds, ratio: median of the rounds' "
          f"ratios; raw c+p without decoding: {med['bytes']:.0f} records/s; plain produce of "
          f"the backlog: {produce_rate:.0f} records/s)")
    return {"hop": rows,
            "rounds_records_per_s": {k: [round(r) for r in v] for k, v in rates.items()},
            "rounds_processor_over_raw": [round(p / r, 3)
                                          for p, r in zip(rates["tp"], rates["raw"])],
            "raw_bytes_only_records_per_s": round(med["bytes"]),
            "produce_records_per_s": round(produce_rate)}


if __name__ == "__main__":
    main()
