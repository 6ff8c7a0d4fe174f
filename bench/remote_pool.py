"""A remote RaaS pool behind a slow link: its share of the rollouts, against both pools local.

The reference's heterogeneous-pools experiment puts two of its three pools at 300 ms RTT and
4 Gbit/s from the trainer and finds that every pool contributes every iteration. Here one
pool of two reaches the broker through Toxiproxy (``scripts/toxiproxy`` builds it with ``go
install`` on first use), shaped to ``--rtt-ms`` (half each way) and ``--rate-kbps`` (each
way; 500000 KB/s = 4 Gbit/s):

* an embedded broker of the bench's own (temporary state, free ports) gets a second
  listener, REMOTE, that advertises the proxy's address, so clients that bootstrap through
  the proxy keep talking through it;
* the link is probed once: metadata round trips and a 32 MiB read, direct and through it;
* the default topology (tiny model, 100 warm-start steps, no evaluator) runs under
  ``astraflow up`` for ``--duration`` seconds with two pools of one node each, ``local``
  and ``remote``, alike but for ``pools.remote.kafka.bootstrap_servers`` (the proxy);
  the baseline is the same topology with both pools local, run first on the same broker.

Then, from the run's topics, printed side by side: versions reached; trajectory groups per
pool (total, share); the trainer's iterations (batches) that held a group of each pool and
the weight versions each pool generated with; how far behind the newest published version
each pool rolled out; each pool's weight-sync time (``raas/weight_sync_s`` over
``raas/weight_updates`` on ``status``); the trainer's waiting fraction. Pools are counted
from the ``pool`` field of the records, whatever consumer groups the pools run in.

    python bench/remote_pool.py                       # 150 s per run
    python bench/remote_pool.py --env-latency 2 --out bench/results/remote_pool.json

``--env-latency S`` makes every rollout wait S seconds on its environment, so rollouts take
seconds as an LLM's do (the tiny model's take milliseconds, far less than one round trip);
``--batch-size N`` makes the trainer's iterations longer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

from astraflow.broker.embedded import EmbeddedBroker, free_port  # noqa: E402
from astraflow.kafka.clients import read_all  # noqa: E402
from astraflow.kafka.config import KafkaConfig  # noqa: E402
from astraflow.wire.records import Batch, ComponentStatus, TrajectoryGroup, WeightManifest  # noqa: E402

POOLS = ("local", "remote")


class Toxiproxy:
    """A toxiproxy-server process and its HTTP API (urllib: no client library)."""

    def __init__(self, binary: str, log: Path):
        self.api = f"http://127.0.0.1:{free_port()}"
        port = self.api.rsplit(":", 1)[1]
        self.proc = subprocess.Popen([binary, "-host", "127.0.0.1", "-port", port],
                                     stdout=open(log, "wb"), stderr=subprocess.STDOUT)
        deadline = time.time() + 30
        while True:
            try:
                self.version = self.call("GET", "/version")
                return
            except OSError:
                if time.time() > deadline or self.proc.poll() is not None:
                    self.stop()
                    raise SystemExit(f"toxiproxy-server did not answer; see {log}") from None
                time.sleep(0.2)

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(self.api + path, data=data, method=method,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as resp:
            text = resp.read().decode()
        try:
            return json.loads(text)
        except ValueError:  # /version answers plain text
            return text

    def shaped_proxy(self, name: str, listen: str, upstream: str, rtt_ms: float,
                     rate_kbps: int) -> dict:
        """A proxy ``listen`` -> ``upstream`` with half of ``rtt_ms`` of latency and
        ``rate_kbps`` of bandwidth in each direction; the proxy as the API shows it."""
        self.call("POST", "/proxies", {"name": name, "listen": listen, "upstream": upstream,
                                       "enabled": True})
        for stream in ("upstream", "downstream"):
            self.call("POST", f"/proxies/{name}/toxics", {
                "name": f"latency_{stream}", "type": "latency", "stream": stream,
                "toxicity": 1.0, "attributes": {"latency": int(rtt_ms / 2), "jitter": 0}})
            self.call("POST", f"/proxies/{name}/toxics", {
                "name": f"bandwidth_{stream}", "type": "bandwidth", "stream": stream,
                "toxicity": 1.0, "attributes": {"rate": int(rate_kbps)}})
        return self.call("GET", f"/proxies/{name}")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def toxiproxy_binary() -> str:
    """The path ``scripts/toxiproxy`` prints (it builds the server on first use)."""
    done = subprocess.run(["bash", str(REPO / "scripts" / "toxiproxy")], capture_output=True,
                          text=True)
    if done.returncode:
        raise SystemExit(done.stderr.strip() or "scripts/toxiproxy failed")
    return done.stdout.strip().splitlines()[-1]


def metadata_rtt_ms(bootstrap: str, rounds: int = 7) -> float:
    """Median milliseconds of one metadata request on a connection already open."""
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.list_topics(timeout=30)  # connect, ApiVersions, first metadata
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        admin.list_topics(timeout=30)
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def read_mib_s(bootstrap: str, topic: str, total: int) -> float:
    """MiB/s of one consumer reading ``topic`` (partition 0, ``total`` bytes) from offset 0,
    with fetches as large as the topic (a link's throughput, not a fetch size's)."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": "bench-probe",
                  "enable.partition.eof": True, "fetch.max.bytes": 64 << 20,
                  "max.partition.fetch.bytes": 64 << 20, "receive.message.max.bytes": 65 << 20})
    c.assign([TopicPartition(topic, 0, 0)])
    got, t0 = 0, time.perf_counter()
    try:
        while got < total:
            m = c.poll(30)
            if m is None:
                raise SystemExit(f"probe: nothing read from {topic} in 30 s")
            if m.error():
                if m.error().code() != KafkaError._PARTITION_EOF:
                    raise SystemExit(f"probe: {m.error()}")
                continue
            got += len(m.value())
        return got / (1 << 20) / (time.perf_counter() - t0)
    finally:
        c.close()


def probe_link(direct: str, proxied: str, mib: int = 32) -> dict[str, float]:
    """Metadata round trip and read throughput, direct and through the proxy."""
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"bench-probe-{os.getpid()}"
    admin = AdminClient({"bootstrap.servers": direct})
    for f in admin.create_topics([NewTopic(topic, 1, 1, config={
            "max.message.bytes": str(2 << 20)})]).values():
        f.result(30)
    p = Producer({"bootstrap.servers": direct, "message.max.bytes": 2 << 20,
                  "compression.type": "none"})
    for _ in range(mib):
        p.produce(topic, os.urandom(1 << 20), partition=0)
        p.poll(0)
    p.flush(60)
    out = {"rtt_direct_ms": metadata_rtt_ms(direct), "rtt_proxy_ms": metadata_rtt_ms(proxied),
           "read_direct_mib_s": read_mib_s(direct, topic, mib << 20),
           "read_proxy_mib_s": read_mib_s(proxied, topic, mib << 20)}
    admin.delete_topics([topic])
    return out


def write_topology(work: Path, run: str, bootstrap: str, model: Path,
                   remote_bootstrap: str | None, args: argparse.Namespace) -> Path:
    """The default topology as ``run``: the bench's broker and model, no evaluator, pools
    ``local`` and ``remote`` alike (``remote`` through ``remote_bootstrap`` when given),
    and the batch size and environment latency of ``args`` when given."""
    topo = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    topo["run"] = run
    if args.batch_size:
        topo["processors"]["batcher"]["options"]["batch_size"] = args.batch_size
    if args.env_latency:
        topo["pools"]["local"]["workflows"]["single_turn"]["env_latency"] = args.env_latency
    topo["kafka"] = {"bootstrap_servers": bootstrap}
    topo["policies"]["actor"].update(model=str(model), warm_start={"steps": 100})
    topo.pop("eval", None)  # the two cores go to the pools and the trainer
    pool = topo["pools"]["local"]
    topo["pools"] = {name: json.loads(json.dumps(pool)) for name in POOLS}
    if remote_bootstrap:
        topo["pools"]["remote"]["kafka"] = {"bootstrap_servers": remote_bootstrap}
    path = work / f"{run}.yaml"
    path.write_text(yaml.safe_dump(topo, sort_keys=False))
    return path


def run_up(path: Path, work: Path, bootstrap: str, duration: float) -> None:
    """``astraflow up PATH --duration D`` against the bench's broker; fails on its exit."""
    log = work / f"{path.stem}.up.log"
    env = {**os.environ, "ASTRAFLOW_BOOTSTRAP": bootstrap}
    print(f"$ astraflow up {path.name} --duration {duration:.0f}  (log {log})", flush=True)
    with open(log, "wb") as out:
        rc = subprocess.run([sys.executable, "-m", "astraflow.cli.main", "up", str(path),
                             "--duration", str(duration), "--runs-dir", str(work / "runs")],
                            cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    if rc:
        raise SystemExit(f"astraflow up exited with {rc}; see {log}")


def _read(config: KafkaConfig, topic: str, expect: type) -> list:
    return read_all(config, topic, expect=expect, idle_s=3.0, timeout_s=180)


def collect(config: KafkaConfig, run: str) -> dict[str, Any]:
    """The run's figures, from its topics."""
    groups = _read(config, f"{run}.trajectories.raw", TrajectoryGroup)
    manifests = sorted((r.record for r in _read(config, f"{run}.weights.actor",
                                                WeightManifest)), key=lambda m: m.version)
    # the batches the trainer trained on: below the newest version's consumed offset
    consumed = max((o.offset for m in manifests[-1:] for o in m.consumed_offsets
                    if o.topic == f"{run}.batches.actor"), default=0)
    batches = [r.record for r in _read(config, f"{run}.batches.actor", Batch)
               if r.offset < consumed]
    statuses = [r.record for r in _read(config, f"{run}.status", ComponentStatus)]
    published = [(m.created_at_ms, m.version) for m in manifests]
    pools = {p: pool_figures(p, [r for r in groups if r.record.pool == p], batches,
                             published, statuses) for p in POOLS}
    total = sum(f["groups"] for f in pools.values()) or 1
    trained = sum(f["groups_trained"] for f in pools.values()) or 1
    for f in pools.values():
        f["share"] = f["groups"] / total
        f["trained_share"] = f["groups_trained"] / trained
    return {"versions": max((m.version for m in manifests), default=0),
            "iterations": len(batches), "pools": pools,
            "trainer": trainer_figures(statuses)}


def _published_at(published: list[tuple[int, int]], ts_ms: int) -> int:
    """The newest version published by ``ts_ms``."""
    return max((v for t, v in published if t <= ts_ms), default=0)


def pool_figures(pool: str, groups: list, batches: list[Batch],
                 published: list[tuple[int, int]], statuses: list[ComponentStatus]) -> dict:
    """One pool's groups, the iterations and versions it reached, its lag behind the newest
    version, and its weight-sync time (its nodes' last status)."""
    used = [int(r.record.metrics.get("rollout/max_version", -1)) for r in groups]
    lag = [_published_at(published, r.timestamp_ms) - v for r, v in zip(groups, used)]
    last: dict[str, ComponentStatus] = {}
    for s in statuses:
        if s.kind == "raas" and s.pool == pool:
            last[s.component_id] = s
    sync_s = sum(s.metrics.get("raas/weight_sync_s", 0.0) for s in last.values())
    updates = sum(s.metrics.get("raas/weight_updates", 0.0) for s in last.values())
    in_batches = [b for b in batches if any(g.pool == pool for g in b.groups)]
    return {"nodes": sorted(last), "groups": len(groups),
            "groups_trained": sum(g.pool == pool for b in batches for g in b.groups),
            "iterations_with_groups": len(in_batches),
            "groups_per_iteration": (statistics.fmean(
                sum(g.pool == pool for g in b.groups) for b in batches) if batches else 0.0),
            "versions_generated_with": len({v for v in used if v >= 0}),
            "version_lag_mean": statistics.fmean(lag) if lag else None,
            "weight_updates": updates, "weight_sync_s_total": sync_s,
            "weight_sync_s_mean": sync_s / updates if updates else None}


def trainer_figures(statuses: list[ComponentStatus]) -> dict[str, float | None]:
    """The trainer's waiting fraction over its whole life (its last status) and from its
    first published version on (start-up left out); the batches it skipped because every
    group in them was too stale."""
    mine = [s for s in statuses if s.kind == "trainer"]
    if not mine:
        return {"wait_fraction": None, "wait_fraction_after_v1": None, "skipped_batches": None}
    first = next((s for s in mine if max(s.weight_versions.values(), default=0) >= 1), None)
    end = mine[-1]
    after = None
    if first is not None and end.at_ms > first.at_ms:
        after = (end.waiting_s - first.waiting_s) / ((end.at_ms - first.at_ms) / 1000)
    return {"wait_fraction": end.metrics.get("trainer/wait_fraction"),
            "wait_fraction_after_v1": after,
            "skipped_batches": end.metrics.get("trainer/stale_skipped_batches")}


def _cell(x: Any, fmt: str = "{}") -> str:
    return "-" if x is None else fmt.format(x)


def table(results: dict[str, dict[str, Any]]) -> str:
    """The figures of each variant side by side, as a Markdown table."""
    names = list(results)
    rows = [("versions reached", lambda r: str(r["versions"])),
            ("batches the trainer consumed", lambda r: str(r["iterations"])),
            ("... skipped: every group too stale",
             lambda r: _cell(r["trainer"]["skipped_batches"], "{:.0f}"))]
    for p in POOLS:
        rows += [
            (f"{p}: trajectory groups (share)",
             lambda r, p=p: f"{r['pools'][p]['groups']} ({r['pools'][p]['share']:.1%})"),
            (f"{p}: groups in the batches consumed (share)",
             lambda r, p=p: f"{r['pools'][p]['groups_trained']} "
                            f"({r['pools'][p]['trained_share']:.1%})"),
            (f"{p}: batches with its groups",
             lambda r, p=p: f"{r['pools'][p]['iterations_with_groups']} / {r['iterations']}"),
            (f"{p}: groups per batch",
             lambda r, p=p: f"{r['pools'][p]['groups_per_iteration']:.2f}"),
            (f"{p}: versions generated with",
             lambda r, p=p: str(r['pools'][p]['versions_generated_with'])),
            (f"{p}: versions behind the newest (mean)",
             lambda r, p=p: _cell(r['pools'][p]['version_lag_mean'], "{:.2f}")),
            (f"{p}: weight sync, s per update (updates)",
             lambda r, p=p: f"{_cell(r['pools'][p]['weight_sync_s_mean'], '{:.3f}')} "
                            f"({r['pools'][p]['weight_updates']:.0f})")]
    rows += [("trainer waiting fraction (whole run)",
              lambda r: _cell(r["trainer"]["wait_fraction"], "{:.2f}")),
             ("trainer waiting fraction (from v1)",
              lambda r: _cell(r["trainer"]["wait_fraction_after_v1"], "{:.2f}"))]
    lines = ["| | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    lines += [f"| {label} | " + " | ".join(f(results[n]) for n in names) + " |"
              for label, f in rows]
    return "\n".join(lines)


def run_variant(name: str, work: Path, bootstrap: str, model: Path, args: argparse.Namespace,
                remote_bootstrap: str | None) -> dict[str, Any]:
    """One ``up`` of the two-pool topology, and its figures."""
    run = f"remote-{name}-{os.getpid()}"
    path = write_topology(work, run, bootstrap, model, remote_bootstrap, args)
    duration = args.duration
    t0 = time.time()
    run_up(path, work, bootstrap, duration)
    figures = collect(KafkaConfig(bootstrap_servers=bootstrap, client_id="bench-remote"), run)
    figures["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps({name: figures}), flush=True)
    return figures


def shaped_link(args: argparse.Namespace, work: Path, broker: EmbeddedBroker
                ) -> tuple[str, str, Toxiproxy, dict[str, float]]:
    """Start ``broker`` with a REMOTE listener advertised at a Toxiproxy proxy, shape the
    proxy and probe it: the direct and proxied bootstrap addresses, the proxy and the
    probe's figures."""
    proxy_port, remote_port = free_port(), free_port()
    proxied = f"127.0.0.1:{proxy_port}"
    bootstrap = broker.start(port=free_port(), log=lambda *_: None,
                             remote_listener=(remote_port, proxied)).bootstrap
    assert bootstrap is not None
    toxi = Toxiproxy(toxiproxy_binary(), work / "toxiproxy.log")
    shown = toxi.shaped_proxy("remote-pool", proxied, f"127.0.0.1:{remote_port}",
                              args.rtt_ms, args.rate_kbps)
    print(f"broker {bootstrap}; the remote pool goes through toxiproxy {toxi.version} at "
          f"{proxied} to the REMOTE listener :{remote_port}; toxics "
          + ", ".join(f"{t['name']} {t['attributes']}" for t in shown["toxics"]), flush=True)
    link = probe_link(bootstrap, proxied)
    print(f"link: metadata round trip {link['rtt_direct_ms']:.1f} ms direct, "
          f"{link['rtt_proxy_ms']:.1f} ms through the proxy; 32 MiB read at "
          f"{link['read_direct_mib_s']:.0f} MiB/s direct, "
          f"{link['read_proxy_mib_s']:.0f} MiB/s through it", flush=True)
    return bootstrap, proxied, toxi, link


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--duration", type=float, default=150.0, help="seconds per run (150)")
    ap.add_argument("--rtt-ms", type=float, default=300.0, help="round trip added (300)")
    ap.add_argument("--rate-kbps", type=int, default=500_000,
                    help="bandwidth each way in KB/s (500000: 4 Gbit/s)")
    ap.add_argument("--batch-size", type=int, default=None,
                    help="groups per trainer iteration (default: the topology's, 8); larger "
                    "means longer iterations against the same round trip")
    ap.add_argument("--env-latency", type=float, default=None, metavar="S",
                    help="seconds every rollout waits on its environment (single_turn's "
                    "env_latency): rollouts that take seconds, as an LLM's do, instead of the "
                    "tiny model's milliseconds")
    ap.add_argument("--no-baseline", action="store_true", help="only the run with the proxy")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    args = ap.parse_args(argv)
    meta = run_meta("remote_pool", ["python", *(sys.argv if argv is None else argv)])
    work = Path(tempfile.mkdtemp(prefix="bench-remote-pool-"))
    print(f"work directory (logs) {work}", flush=True)
    broker = EmbeddedBroker(work / "broker")
    toxi = None
    try:
        bootstrap, proxied, toxi, link = shaped_link(args, work, broker)
        model = work / "model"
        subprocess.run([sys.executable, "-m", "astraflow.cli.main", "model", "init", str(model),
                        "--warm-start-steps", "100"], check=True, cwd=REPO,
                       capture_output=True)
        results: dict[str, dict[str, Any]] = {}
        if not args.no_baseline:
            results["both local"] = run_variant("base", work, bootstrap, model, args, None)
        results[f"remote at {args.rtt_ms:.0f} ms"] = run_variant(
            "slow", work, bootstrap, model, args, proxied)
    finally:
        if toxi is not None:
            toxi.stop()
        broker.destroy()
    print()
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {"meta": meta, "duration_s": args.duration, "rtt_ms": args.rtt_ms,
             "rate_kbps": args.rate_kbps,
             "batch_size": args.batch_size or 8, "env_latency_s": args.env_latency,
             "link": link, "runs": results},
            indent=1) + "\n")
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
