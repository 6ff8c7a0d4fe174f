"""What security costs: PLAINTEXT, SASL_PLAINTEXT and SASL_SSL side by side in one run.

For each protocol in turn, a fresh embedded broker in a temporary state directory (the
secured ones with SCRAM-SHA-512 users and ACLs enforced, each processor its own principal
with the ACLs ``astraflow topology acls`` gives it), and on it:

- **start**: seconds from ``EmbeddedBroker.start`` to the first metadata served (the
  storage format and, when secured, the CA and certificate made with it);
- **hop throughput**: records/s of one passthrough processor (decode, check, exactly once)
  draining a backlog of ``--records`` records of ~``--record-bytes`` B;
- **RaaS->trainer latency**: p50/p99 ms from producing a record, as a RaaS node does, to
  reading it ``read_committed`` after a chain of ``--hops`` processors (the default
  topology has three between ``trajectories.raw`` and ``batches.<policy>``: staleness
  filter, router, batcher), one record every ``--interval-ms``.

It reuses bench/processor_throughput.py's measurements. Usage (a smoke run takes about a
minute; the figures in docs/security.md come from the defaults):

    python bench/security.py [--records 20000] [--record-bytes 1024] [--light 200]
        [--interval-ms 20] [--hops 3] [--protocols PLAINTEXT,SASL_PLAINTEXT,SASL_SSL]
        [--repeats 1] [--out bench/results/security.json]

With ``--repeats N`` the protocols are measured in turn N times (round-robin, so a slow
spell of the shared machine hits each alike); the table gives each figure's median and,
when N > 1, its range.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from astraflow.broker.embedded import EmbeddedBroker, free_port
from astraflow.config.topology import Topology, parse_topology
from astraflow.kafka.clients import make_admin
from astraflow.kafka.topics import apply_topics
from astraflow.security.acls_apply import apply
from astraflow.wire.codec import SingleObjectCodec

if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

PROTOCOLS = ("PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL")


def _throughput_bench():
    """bench/processor_throughput.py as a module (bench/ is not a package)."""
    path = Path(__file__).with_name("processor_throughput.py")
    spec = importlib.util.spec_from_file_location("bench_processor_throughput", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


PT = _throughput_bench()


def bench_topology(broker: EmbeddedBroker, hops: int, creds: Path) -> Topology:
    """A backlog hop ``tp`` and a chain ``c1``..``cN``; under security, the operator is
    the admin and each processor the user ``<run>.processor.<name>``."""
    st = broker.status()
    kafka: dict = {"bootstrap_servers": st.bootstrap}
    if st.secure is not None:
        files = st.secure
        kafka["security"] = {
            "protocol": files.protocol, "username": "admin",
            "password_file": str(files.admin_password), "credentials_dir": str(creds),
            **({"ca_location": str(files.tls.ca)} if files.uses_tls else {})}
    fwd = {"kind": "passthrough", "poll_timeout_s": 0.5}
    topics = {t: {"partitions": 3, "schema": "Task"}
              for t in ["tp.in", "tp.out", *(f"c{i}" for i in range(hops + 1))]}
    processors = {"tp": {**fwd, "inputs": ["tp.in"], "outputs": ["tp.out"],
                         "max_batch": 100_000}}
    for i in range(1, hops + 1):
        processors[f"c{i}"] = {**fwd, "inputs": [f"c{i - 1}"], "outputs": [f"c{i}"],
                               "max_batch": 100_000}
    return parse_topology({"run": f"bench-{uuid.uuid4().hex[:8]}", "kafka": kafka,
                           "status_interval_s": 5.0, "topics": topics,
                           "processors": processors})


def measure(protocol: str, args: argparse.Namespace, root: Path) -> dict[str, float]:
    """One protocol's figures, on a broker of its own (stopped and removed after)."""
    broker = EmbeddedBroker(state=root / protocol / "state")
    t0 = time.perf_counter()
    broker.start(port=free_port(), secure=protocol != "PLAINTEXT",
                 protocol=protocol if protocol != "PLAINTEXT" else "SASL_SSL",
                 log=lambda _m: None)
    start_s = time.perf_counter() - t0
    try:
        topo = bench_topology(broker, args.hops, root / protocol / "creds")
        admin = topo.kafka
        apply_topics(make_admin(admin), topo.resolved_topics())
        if broker.status().secure is not None:
            apply(topo, admin, None)
        pad = PT.padding(SingleObjectCodec(), args.record_bytes)
        full = topo.full_name
        PT.preload(admin, full("tp.in"), args.records, pad)
        rate = PT.processor_throughput(topo, topo.kafka, "tp", args.records)
        chain = [PT.start_processor(topo, topo.kafka, f"c{i}")
                 for i in range(1, args.hops + 1)]
        try:
            lat = PT.latency(admin, {"chain": (full("c0"), full(f"c{args.hops}"))}, args,
                             pad)["chain"]
        finally:
            for hop in chain:
                PT.stop_processor(hop)
        return {"start": start_s, "rate": rate, "p50": PT.pct(lat, 0.5),
                "p99": PT.pct(lat, 0.99)}
    finally:
        broker.destroy()


ROWS = (("broker start to metadata (s)", "start", "{:.1f}"),
        ("hop throughput (records/s)", "rate", "{:.0f}"),
        ("RaaS->trainer latency p50 (ms)", "p50", "{:.1f}"),
        ("RaaS->trainer latency p99 (ms)", "p99", "{:.1f}"))


def cell(values: list[float], fmt: str) -> str:
    """The median, and the range when there are several values."""
    mid = fmt.format(statistics.median(values))
    if len(values) < 2:
        return mid
    return f"{mid} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def report(runs: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> None:
    print(f"\n{args.records} records of ~{args.record_bytes} B; latency: {args.light} "
          f"records through {args.hops} processors, one per {args.interval_ms:g} ms; "
          f"{args.repeats} run(s) per protocol")
    width = 24 if args.repeats > 1 else 16
    print(f"{'':34}" + "".join(f"{p:>{width}}" for p in runs))
    for label, key, fmt in ROWS:
        print(f"{label:34}" + "".join(
            f"{cell([r[key] for r in rs], fmt):>{width}}" for rs in runs.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--records", type=int, default=20_000, help="backlog for throughput")
    ap.add_argument("--record-bytes", type=int, default=1024)
    ap.add_argument("--light", type=int, default=200, help="records for latency")
    ap.add_argument("--interval-ms", type=float, default=20.0)
    ap.add_argument("--hops", type=int, default=3, help="processors between RaaS and trainer")
    ap.add_argument("--protocols", default=",".join(PROTOCOLS))
    ap.add_argument("--repeats", type=int, default=1, help="rounds over the protocols")
    ap.add_argument("--out", type=Path, help="write every run's figures here (JSON)")
    args = ap.parse_args()
    meta = run_meta("security", ["python", *sys.argv])  # before the run: its commit
    protocols = [p.strip() for p in args.protocols.split(",") if p.strip()]
    unknown = sorted(set(protocols) - set(PROTOCOLS))
    if unknown:
        raise SystemExit(f"--protocols: unknown {', '.join(unknown)} (one of {PROTOCOLS})")
    runs: dict[str, list[dict[str, float]]] = {p: [] for p in protocols}
    for round_ in range(args.repeats):
        for p in protocols:
            with tempfile.TemporaryDirectory(prefix="astraflow-bench-security-") as tmp:
                runs[p].append(measure(p, args, Path(tmp)))
            print(f"round {round_ + 1}/{args.repeats} {p}: {runs[p][-1]}", flush=True)
    report(runs, args)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"meta": meta,
                                        "args": {k: str(v) for k, v in vars(args).items()},
                                        "runs": runs}, indent=1))


if __name__ == "__main__":
    main()
