"""Records/s of 1 KB records: plain produce, plain consume, and one transactional processor.

Runs against ASTRAFLOW_BOOTSTRAP if set, else the running embedded broker, else a
temporary embedded broker it starts and removes. Usage:

    python bench/processor_throughput.py [--records 100000] [--record-bytes 1024]
                                         [--partitions 3] [--max-batch 1000]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import threading
import time
import uuid

from astraflow.broker import EmbeddedBroker, free_port
from astraflow.kafka.clients import RecordConsumer, RecordProducer, make_admin, make_codec_for
from astraflow.kafka.config import KafkaConfig
from astraflow.kafka.lag import LagReader, total_lag
from astraflow.kafka.runtime import ProcessorRuntime
from astraflow.kafka.topics import apply_topics
from astraflow.records import Task
from astraflow.topology import parse_topology


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
    ap.add_argument("--records", type=int, default=100_000)
    ap.add_argument("--record-bytes", type=int, default=1024, help="payload size per record")
    ap.add_argument("--partitions", type=int, default=3)
    ap.add_argument("--max-batch", type=int, default=1000, help="records per transaction")
    args = ap.parse_args()

    bootstrap, own_broker = bootstrap_or_start()
    try:
        run(bootstrap, args)
    finally:
        if own_broker:
            own_broker.destroy()


def run(bootstrap: str, args: argparse.Namespace) -> None:
    config = KafkaConfig(bootstrap_servers=bootstrap, client_id="astraflow-bench")
    run_id = f"bench-{uuid.uuid4().hex[:8]}"
    topo = parse_topology({
        "run": run_id,
        "kafka": {"bootstrap_servers": bootstrap},
        "topics": {"tasks.source": {"partitions": args.partitions},
                   "tasks": {"partitions": args.partitions}},
        "processors": {"fwd": {"kind": "passthrough", "inputs": ["tasks.source"],
                               "outputs": ["tasks"], "max_batch": args.max_batch}},
    })
    apply_topics(make_admin(config), topo.resolved_topics())
    src = topo.full_name("tasks.source")
    n = args.records
    def make(i: int, pad: str) -> Task:
        return Task(task_id=f"t{i:08d}", prompt_id=f"p{i:08d}", workflow="w", payload=pad,
                    source="bench", created_at_ms=1)

    empty = len(make_codec_for(config).encode(make(0, ""), src))
    pad = "x" * max(0, args.record_bytes - empty - 2)  # 2: the longer length varint
    print(f"broker {bootstrap}; {n} records of ~{args.record_bytes} B, "
          f"{args.partitions} partitions")

    producer = RecordProducer(config)
    sample = producer.codec.encode(make(0, pad), src)
    t0 = time.perf_counter()
    for i in range(n):
        producer.produce(src, make(i, pad), key=f"p{i}")
    producer.flush()
    produce_s = time.perf_counter() - t0

    consumer = RecordConsumer(config, f"{run_id}.plain", [src])
    got = 0
    t0 = time.perf_counter()
    t_first = None
    while got < n:
        records = consumer.poll(1000, 1.0, expect=Task)  # decoded, like the processor does
        if records and t_first is None:
            t_first = time.perf_counter()
        got += len(records)
    consume_s = time.perf_counter() - (t_first or t0)
    consumer.close()

    runtime = ProcessorRuntime(topo, "fwd", instance="bench", config=config)
    thread = threading.Thread(target=runtime.run, daemon=True)
    lagr = LagReader(config)
    group = topo.group_of("fwd")
    t0 = time.perf_counter()
    thread.start()
    first_done, t_first = None, None
    while True:
        left = total_lag(lagr.lag(group, [src]))
        now = time.perf_counter()
        if t_first is None and left < n:
            t_first, first_done = now, n - left
        if left == 0:
            break
        time.sleep(0.05)
    t_end = time.perf_counter()
    runtime.stop()
    thread.join(30)
    lagr.close()
    c = runtime.counters
    steady = (n - first_done) / (t_end - t_first) if t_end > t_first else float("nan")

    rec_bytes = len(sample)
    print(f"record size on the wire: {rec_bytes} B (Avro single-object)")
    print(f"{'path':44} {'records/s':>10} {'MB/s':>8}")
    for label, rate in [
        ("plain produce (idempotent, lz4, acks=all)", n / produce_s),
        ("plain consume + decode (read_committed)", n / consume_s),
        (f"transactional processor, steady (batch {args.max_batch})", steady),
        ("transactional processor, incl. group join", n / (t_end - t0)),
    ]:
        print(f"{label:44} {rate:10.0f} {rate * rec_bytes / 1e6:8.1f}")
    print(f"processor: {c.transactions} transactions, consumed {c.consumed}, "
          f"produced {c.produced}, dead-lettered {c.dead_lettered}")


if __name__ == "__main__":
    main()
