"""Rollout throughput with scale (issue 23, point 5).

Simulated RaaS nodes against the real dataflow, on one broker, for a grid of nodes x
partitions x processor replicas. Per grid cell it runs, on a fresh run prefix:

* the real feeder (``astraflow feeder run``) offering arithmetic tasks at twice the rate
  every node busy would take, so that admission decides what the nodes get;
* the chain ``tasks.source -> admission -> tasks -> RaaS nodes -> trajectories.raw ->
  staleness -> router -> batcher -> batches.actor -> trainer``: the processors are the real
  ``astraflow processor run`` processes (``--replicas`` instances each of staleness, router
  and batcher, one of admission, which must run alone), the nodes are real ``RaaSNode``\\ s
  (each its own consumer in the pool's group and its own transactional producer), the
  trainer is a light one: a ``read_committed`` consumer in the trainer's group that counts
  what reaches it and publishes no weights (weight fan-out is ``bench/fanout.py``'s);
* the nodes' engine is ``SleepEngine``: per task it draws ``n_samples`` lengths from a
  capped Pareto (``--min-tokens``, ``--alpha``, ``--max-tokens``) and sleeps for the
  longest one at ``--tokens-per-s`` per sequence, as a batched engine decodes its samples
  side by side;
* the nodes run as threads of this process, not as processes: 64 processes that import
  torch (the node's module does) do not fit a small machine, and a node's work here is a
  sleep. Each thread holds its own librdkafka consumer and producer, so the broker sees
  64 group members and 64 transactional ids, as with 64 processes: joins, leaves and
  rebalances are the group protocol's, unchanged. What threads share is this process's
  CPU (decode, encode, GIL), which the table shows as the bench process's CPU.

Measured per cell over ``--duration`` seconds after a warm-up (the first batch at the
trainer): trajectories/s and groups/s at the trainer, beside the expected rate
(``nodes x n_samples / mean rollout time``, the mean from the same length distribution)
and the same capped at one busy node per partition of ``tasks``; tasks in flight; busy
nodes; CPU of the broker, the processors, this process and the machine; every topic's
records (data records and transaction markers) per trajectory, and transactions/s.
Then, with ``--rebalance``, one node joins and later one leaves: the time until the
group is stable again with every partition of ``tasks`` owned, and until the next
rollout commits. Finally, where throughput stops growing and why.

    python bench/scale.py [--nodes 1,4,16,64] [--partitions 1,4,16] [--replicas 1,2,4]
        [--duration 60] [--tokens-per-s 50] [--out bench/results/scale.json]
    python bench/scale.py --quick          # nodes 1,4 on 4 partitions, 1 replica, 20 s

Runs against ASTRAFLOW_BOOTSTRAP if set, else a temporary embedded broker it starts and
removes (needs Java and Maven, like ``astraflow up``).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[1]
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
from report import run_meta  # noqa: E402  (bench/report.py: command, commit, machine, date)

for _p in (str(REPO), str(REPO / "bench")):
    if _p not in sys.path:
        sys.path.insert(0, _p)

CHAIN = ("admission", "staleness", "router", "batcher")
REPLICATED = ("staleness", "router", "batcher")  # admission: one instance per topology
POOL = "local"
POLICY = "actor"


# --- the long tail and the expected rate (plain logic) --------------------------------
@dataclass(frozen=True)
class TokenModel:
    """How long a simulated sample is and how fast it decodes: a Pareto length (minimum
    ``min_tokens``, tail index ``alpha``, capped at ``max_tokens``) at ``tokens_per_s``
    per sequence."""

    tokens_per_s: float = 50.0
    min_tokens: int = 16
    alpha: float = 1.5
    max_tokens: int = 512

    def __post_init__(self) -> None:
        if self.tokens_per_s <= 0:
            raise ValueError(f"tokens_per_s {self.tokens_per_s}: must be above 0")
        if not 1 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens {self.min_tokens}: must be in 1..max_tokens "
                             f"({self.max_tokens})")
        if self.alpha <= 0:
            raise ValueError(f"alpha {self.alpha}: must be above 0")

    def length(self, rng: random.Random) -> int:
        """One sample's generated tokens."""
        return min(self.max_tokens, max(1, int(self.min_tokens * rng.paretovariate(self.alpha))))

    def rollout_s(self, lengths: Iterable[int]) -> float:
        """Seconds a batch of samples of these lengths takes, decoded side by side."""
        return max(lengths, default=0) / self.tokens_per_s


def mean_rollout_s(model: TokenModel, n_samples: int, draws: int = 20_000,
                   seed: int = 0) -> float:
    """Mean seconds of one task's rollout (``n_samples`` samples side by side), by a seeded
    Monte Carlo of the same distribution the engine draws from."""
    rng = random.Random(seed)
    total = sum(model.rollout_s(model.length(rng) for _ in range(n_samples))
                for _ in range(draws))
    return total / draws


def expected_rates(nodes: int, partitions: int, n_samples: int, rollout_s: float
                   ) -> tuple[float, float]:
    """Trajectories/s: ``nodes`` all busy, and at most one busy node per partition of
    ``tasks`` (a group gives a partition to one member only)."""
    per_node = n_samples / rollout_s
    return nodes * per_node, min(nodes, partitions) * per_node


def window_rate(times: Sequence[float], counts: Sequence[int], start: float, end: float
                ) -> float:
    """Sum of ``counts`` whose time is in ``[start, end)``, per second."""
    if end <= start:
        raise ValueError("window end must be after its start")
    return sum(c for t, c in zip(times, counts) if start <= t < end) / (end - start)


def arrival_rate(times: Sequence[float], counts: Sequence[int], start: float, end: float
                 ) -> float:
    """Per second, of the arrivals in ``[start, end)``: what came after the first of them
    over the time from the first to the last (arrivals come in lumps, such as batches, so
    a window's edges would cut one); with fewer than two, ``window_rate``."""
    inside = [(t, c) for t, c in zip(times, counts) if start <= t < end]
    if len(inside) < 2 or inside[-1][0] <= inside[0][0]:
        return window_rate(times, counts, start, end)
    return sum(c for _, c in inside[1:]) / (inside[-1][0] - inside[0][0])


@dataclass
class Snapshot:
    """One look at a consumer group: its state and each member's partitions."""

    at: float
    state: str
    members: dict[str, list[int]]


def settled_at(snaps: Sequence[Snapshot], since: float, members: int, partitions: int
               ) -> float | None:
    """The first time at or after ``since`` the group was stable with ``members`` members
    owning every one of ``partitions`` partitions between them; None if never seen."""
    want = set(range(partitions))
    for s in snaps:
        if s.at < since or s.state != "STABLE" or len(s.members) != members:
            continue
        if set().union(*s.members.values()) == want:
            return s.at
    return None


def first_after(times: Sequence[float], after: float) -> float | None:
    """The first of ``times`` (ascending) past ``after``."""
    return next((t for t in times if t > after), None)


# --- the simulated engine -----------------------------------------------------------------
class SleepEngine:
    """An ``Engine`` that sleeps for the token time of a model: per prompt ``params.n``
    samples of ``TokenModel`` lengths (at most ``max_new_tokens``), the whole call as long
    as its longest sample. Tokens are digits (one character each); log-probability -1."""

    def __init__(self, model: TokenModel, policy: str = POLICY, seed: int | None = None):
        self.model = model
        self.policy = policy
        self.version = 0
        self.rng = random.Random(seed)
        self.tokens_generated = 0
        self.seconds_generating = 0.0

    def encode(self, text: str) -> list[int]:
        return [ord(c) for c in text]

    def decode(self, token_ids: list[int]) -> str:
        return "".join(chr(t) for t in token_ids)

    @property
    def eos_token_id(self) -> int | None:
        return None

    def load_state_dict(self, state: Any, version: int) -> None:
        self.version = version

    def generate(self, prompts: list[list[int]], params: Any) -> list[list[Any]]:
        from astraflow.raas.engine import Generation

        cap = min(self.model.max_tokens, params.max_new_tokens)
        lengths = [[min(cap, self.model.length(self.rng)) for _ in range(params.n)]
                   for _ in prompts]
        seconds = self.model.rollout_s(n for row in lengths for n in row)
        time.sleep(seconds)
        self.tokens_generated += sum(map(sum, lengths))
        self.seconds_generating += seconds
        return [[Generation(list(p), [self.rng.randrange(48, 58) for _ in range(n)],
                            [-1.0] * n, "length", [self.version] * n) for n in row]
                for p, row in zip(prompts, lengths)]


# --- one grid cell's topology (plain dicts) -----------------------------------------------
def cell_topology(base: dict[str, Any], run: str, nodes: int, partitions: int,
                  model: TokenModel, status_interval_s: float = 2.0) -> dict[str, Any]:
    """``base`` (the default topology) as one cell's: ``partitions`` on every topic the
    tasks and trajectories cross, the admission sized for ``nodes`` nodes, the pool's
    workflow allowed ``model.max_tokens`` tokens, no feeder and no evaluator.

    The pool's ``nodes:`` stays within the partitions (the topology refuses more, as they
    would idle); the bench starts its own nodes, ``nodes`` of them, whatever it says."""
    doc = json.loads(json.dumps(base))
    doc["run"] = run
    doc["status_interval_s"] = status_interval_s
    for t in ("tasks.source", "tasks", "trajectories.raw", "trajectories", f"samples.{POLICY}"):
        doc["topics"][t] = {**(doc["topics"].get(t) or {}), "partitions": partitions}
    adm = doc["processors"]["admission"]
    adm["options"] = {**adm.get("options", {}), "pools": [POOL], "pool_capacity": nodes}
    pool = doc["pools"][POOL]
    pool["nodes"] = min(nodes, partitions)
    pool["workflows"] = {"single_turn": {"max_new_tokens": model.max_tokens}}
    doc.pop("feeder", None)
    doc.pop("eval", None)
    return doc


def plan_processors(names: Iterable[str], replicas: int) -> list[tuple[str, str]]:
    """``(processor, instance)`` of every processor process: ``replicas`` instances of
    each replicable processor, one of the others."""
    return [(name, f"r{i}") for name in names
            for i in range(replicas if name in REPLICATED else 1)]


# --- what the bench watches -------------------------------------------------------------
def proc_cpu_s(pid: int | None) -> float | None:
    """CPU seconds (user + system) of process ``pid`` so far; None if unknown or gone."""
    if pid is None:
        return None
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine so far."""
    parts = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    idle = parts[3] + (parts[4] if len(parts) > 4 else 0)
    return sum(parts) - idle, sum(parts)


class LightTrainer:
    """Reads ``batches.<policy>`` in the trainer's group (``read_committed``), committing
    its offset after every batch as the trainer does with each version (admission holds
    tasks back while more than ``max_staleness`` batches wait past that offset), and
    records when each batch arrived and what it held; it trains nothing and publishes no
    weights."""

    def __init__(self, config: Any, group: str, topic: str):
        from confluent_kafka import Consumer

        from astraflow.kafka.clients import make_codec_for

        self.consumer = Consumer(config.consumer_conf(group))
        self.consumer.subscribe([topic])
        self.codec = make_codec_for(config)
        self.times: list[float] = []
        self.groups: list[int] = []
        self.sequences: list[int] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="light-trainer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from astraflow.wire.records import Batch

        while not self._stop.is_set():
            for m in self.consumer.consume(100, 0.5):
                if m.error() is not None:
                    continue
                b = self.codec.decode(m.value(), m.topic(), m.partition(), m.offset(),
                                      expect=Batch)
                self.times.append(time.monotonic())
                self.groups.append(len(b.groups))
                self.sequences.append(sum(len(g.sequences) for g in b.groups))
                self.consumer.commit(message=m, asynchronous=True)
        self.consumer.close()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(15)


def describe_group(admin: Any, group: str) -> Snapshot:
    """The group's state and assignment now (the admin API's describe)."""
    d = admin.describe_consumer_groups([group], request_timeout=5)[group].result()
    members = {m.member_id: sorted(tp.partition for tp in m.assignment.topic_partitions)
               for m in d.members}
    return Snapshot(time.monotonic(), d.state.name, members)


class CommitTimes:
    """When the nodes committed trajectory groups (their produced count grew; sampled
    every ``interval_s``)."""

    def __init__(self, nodes: list[Any], interval_s: float = 0.02):
        self.nodes, self.interval_s = nodes, interval_s
        self.times: list[float] = []
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="commit-times", daemon=True)
        self.thread.start()

    def total(self) -> int:
        return sum(n.counters.produced for n in list(self.nodes))

    def _run(self) -> None:
        last = self.total()
        while not self._stop.wait(self.interval_s):
            now = self.total()
            if now > last:
                self.times.append(time.monotonic())
            last = now

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(5)


def topic_ends(consumer: Any, topics: Iterable[str]) -> dict[tuple[str, int], int]:
    """The end offset of every partition of ``topics`` (data records and markers)."""
    from confluent_kafka import TopicPartition

    md = consumer.list_topics(timeout=10).topics
    out = {}
    for t in topics:
        for p in (md[t].partitions if t in md else {}):
            out[(t, p)] = consumer.get_watermark_offsets(TopicPartition(t, p), timeout=10)[1]
    return out


def count_committed(config: Any, ranges: dict[tuple[str, int], tuple[int, int]],
                    idle_s: float = 3.0) -> dict[str, int]:
    """Committed data records per topic in each partition's ``[lo, hi)`` (markers and
    aborted records are not delivered to a ``read_committed`` reader)."""
    from confluent_kafka import Consumer, TopicPartition

    todo = {k: v for k, v in ranges.items() if v[1] > v[0]}
    counts = {t: 0 for t, _ in ranges}
    if not todo:
        return counts
    c = Consumer(config.consumer_conf(f"bench-scale-count-{uuid.uuid4().hex[:8]}"))
    c.assign([TopicPartition(t, p, lo) for (t, p), (lo, _) in todo.items()])
    last = time.monotonic()
    while todo and time.monotonic() - last < idle_s:
        for m in c.consume(1000, 0.5):
            key = (m.topic(), m.partition())
            if m.error() is not None or key not in todo:
                continue
            last = time.monotonic()
            if m.offset() < todo[key][1]:
                counts[m.topic()] += 1
            if m.offset() + 1 >= todo[key][1]:
                del todo[key]
    c.close()
    return counts


# --- one grid cell -----------------------------------------------------------------------
@dataclass
class CellSpec:
    nodes: int
    partitions: int
    replicas: int


@dataclass
class Cell:
    """One grid cell's run: topics, processors, trainer and nodes, and what was seen."""

    spec: CellSpec
    args: argparse.Namespace
    workdir: Path
    topo: Any = None
    procs: list[tuple[str, subprocess.Popen]] = field(default_factory=list)
    nodes: list[Any] = field(default_factory=list)
    threads: list[threading.Thread] = field(default_factory=list)
    trainer: LightTrainer | None = None
    restarts: int = 0  # processes started again after they exited
    _seed: int = 0

    def start(self, base: dict[str, Any]) -> None:
        from astraflow.config.topology import load_topology
        from astraflow.kafka.clients import make_admin
        from astraflow.kafka.topics import apply_topics

        s = self.spec
        run = f"bench-scale-{s.nodes}n{s.partitions}p{s.replicas}r-{uuid.uuid4().hex[:6]}"
        doc = cell_topology(base, run, s.nodes, s.partitions, self.args.model)
        path = self.workdir / f"{run}.yaml"
        path.write_text(yaml.safe_dump(doc, sort_keys=False))
        self.topo = load_topology(path)
        self.config = self.topo.kafka.effective()
        self.admin = make_admin(self.config)
        apply_topics(self.admin, self.topo.resolved_topics())
        self.await_topics()
        for name, inst in plan_processors(self.topo.processors, s.replicas):
            self.procs.append((f"{name}/{inst}", self.spawn(run, f"{name}-{inst}", [
                "processor", "run", name, "--topology", str(path), "--instance", inst])))
        self.procs.append(("feeder", self.spawn(run, "feeder", [
            "feeder", "run", "--topology", str(path), "--rate", f"{self.feed_rate():.2f}",
            "--epochs", "0", "--seed", str(self.args.seed), "--from-start"])))
        self.trainer = LightTrainer(self.config, self.topo.trainer_group(POLICY),
                                    self.topo.full_name(f"batches.{POLICY}"))
        for _ in range(s.nodes):
            self.add_node()

    def restart_exited(self, most: int = 3) -> None:
        """Start again a process that exited (a processor's start on a busy broker can fail
        on a transient error, "Not leader for partition"), ``most`` times in all."""
        for i, (name, p) in enumerate(self.procs):
            if p.poll() is None:
                continue
            if self.restarts >= most:
                raise RuntimeError(f"{name} exited {self.restarts + 1} times "
                                   f"(logs in {self.workdir})")
            self.restarts += 1
            log = open(self.workdir / f"{name.replace('/', '-')}.restart.log", "a")
            self.procs[i] = (name, subprocess.Popen(p.args, stdout=log, stderr=subprocess.STDOUT,
                                                    start_new_session=True))

    def await_topics(self, timeout_s: float = 120.0) -> None:
        """Until the broker lists every topic of the run with all its partitions, each with
        a leader (a busy broker answers the creation before that, and a processor that
        starts then fails)."""
        want = {t.full_name: t.partitions for t in self.topo.resolved_topics()}
        deadline = time.monotonic() + timeout_s
        while True:
            md = self.admin.list_topics(timeout=10).topics
            short = [n for n, p in want.items() if n not in md or len(md[n].partitions) < p
                     or any(x.leader < 0 for x in md[n].partitions.values())]
            if not short:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"topics not created in {timeout_s:.0f}s: {short}")
            time.sleep(0.5)

    def feed_rate(self) -> float:
        """Tasks/s for the feeder: twice what every node busy would roll out, so that
        admission, not the feeder, decides what reaches the nodes."""
        return max(1.0, 2 * self.spec.nodes / self.args.mean_rollout_s)

    def spawn(self, run: str, name: str, args: list[str]) -> subprocess.Popen:
        """``astraflow <args>`` as a process of its own, its output in the work dir."""
        log = open(self.workdir / f"{run}-{name}.log", "w")
        return subprocess.Popen([sys.executable, "-m", "astraflow.cli.main", *args], stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def add_node(self) -> Any:
        from astraflow.raas.node import NodeOptions, RaaSNode

        self._seed += 1
        engine = SleepEngine(self.args.model, seed=self.args.seed * 1000 + self._seed)
        node = RaaSNode(self.topo, {POLICY: engine}, NodeOptions(
            pool=POOL, instance=f"sim{self._seed}", n_samples=self.args.n_samples,
            follow_weights=False,
            workflow_options={"single_turn": {"max_new_tokens": self.args.model.max_tokens}}),
            self.config)
        t = threading.Thread(target=node.run, name=f"node-{self._seed}", daemon=True)
        t.start()
        self.nodes.append(node)
        self.threads.append(t)
        return node

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        for t in self.threads:
            t.join(60)
        if self.trainer is not None:
            self.trainer.stop()
        for _, p in self.procs:
            p.terminate()
        for _, p in self.procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()
        if self.topo is not None:
            names = [self.topo.full_name(t) for t in self.topo.topics]
            for f in self.admin.delete_topics(names, operation_timeout=30).values():
                try:
                    f.result()
                except Exception:  # noqa: BLE001 - a topic never made
                    pass


# --- measuring a cell ---------------------------------------------------------------------
def warm_up(cell: Cell, timeout_s: float, settle_s: float) -> float:
    """Seconds until the first batch reached the trainer, then ``settle_s`` more."""
    t0 = time.monotonic()
    while not cell.trainer.times:
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"no batch reached the trainer in {timeout_s:.0f}s "
                               f"(logs in {cell.workdir})")
        cell.restart_exited()
        time.sleep(0.2)
    first = time.monotonic() - t0
    time.sleep(settle_s)
    return first


@dataclass
class Edge:
    """What the counters said at one edge of the window."""

    mono: float
    wall: float
    ends: dict[tuple[str, int], int]
    cpu: dict[str, float | None]
    machine: tuple[int, int]
    node_tx: int
    node_groups: int
    gen_s: float  # seconds the nodes' engines spent generating, summed


def edge(cell: Cell, consumer: Any, topics: list[str], broker_pid: int | None) -> Edge:
    ends = topic_ends(consumer, topics)
    own = os.times()
    cpu = {"broker": proc_cpu_s(broker_pid), "bench": own.user + own.system,
           **{name: proc_cpu_s(p.pid) for name, p in cell.procs}}
    return Edge(time.monotonic(), time.time(), ends, cpu, machine_ticks(),
                sum(n.counters.transactions for n in cell.nodes),
                sum(n.counters.produced for n in cell.nodes),
                sum(n.engines[POLICY].seconds_generating for n in cell.nodes))


def sample_window(cell: Cell, seconds: float) -> dict[str, float]:
    """Tasks in flight (queued or being rolled out), every 2 s."""
    from backpressure import InFlight

    watch, inflight = InFlight(cell.topo), []
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        n = watch.read()
        if n is not None:
            inflight.append(n)
        time.sleep(max(0.0, min(2.0, end - time.monotonic())))
    watch.close()
    return {"in_flight_mean": statistics.fmean(inflight) if inflight else float("nan"),
            "in_flight_max": float(max(inflight, default=0))}


def cpu_cores(a: Edge, b: Edge) -> dict[str, float | None]:
    """Cores used between two edges: per process, processors summed, and the machine."""
    dt = b.mono - a.mono
    out: dict[str, float | None] = {}
    for k, v in b.cpu.items():
        out[k] = None if v is None or a.cpu.get(k) is None else (v - a.cpu[k]) / dt
    procs = [v for k, v in out.items() if "/" in k and v is not None]
    out["processors"] = sum(procs)
    busy, total = b.machine[0] - a.machine[0], b.machine[1] - a.machine[1]
    out["machine_busy_fraction"] = busy / total if total else None
    out["machine_cores_busy"] = busy / total * (os.cpu_count() or 1) if total else None
    return {k: (round(v, 3) if v is not None else None) for k, v in out.items()}


def processor_rates(cell: Cell, a: Edge, b: Edge) -> dict[str, dict[str, float]]:
    """Per processor instance, from its status records in the window: transactions/s and
    the fraction of the time it was busy handling records."""
    from astraflow.kafka.clients import read_all
    from astraflow.wire.records import ComponentStatus

    seen: dict[str, list[Any]] = {}
    for r in read_all(cell.config, cell.topo.full_name("status"), expect=ComponentStatus,
                      idle_s=1.0):
        if r.record.kind == "processor" and a.wall * 1000 <= r.timestamp_ms <= b.wall * 1000:
            seen.setdefault(r.record.component_id, []).append(r)
    out = {}
    for cid, rs in sorted(seen.items()):
        first, last = rs[0], rs[-1]
        dt = (last.timestamp_ms - first.timestamp_ms) / 1000
        if dt <= 0:
            continue
        tx = (last.record.metrics.get("runtime/transactions", 0.0)
              - first.record.metrics.get("runtime/transactions", 0.0))
        out[cid] = {"tx_per_s": round(tx / dt, 2),
                    "busy_fraction": round((last.record.busy_s - first.record.busy_s) / dt, 3)}
        out[cid].update(admission_figures(first.record.metrics, last.record.metrics, dt))
    return out


def admission_figures(first: dict[str, float], last: dict[str, float], dt: float
                      ) -> dict[str, float]:
    """An admission processor's figures between two of its statuses ``dt`` s apart: tasks
    admitted per second, its bound on tasks in flight (last, highest) and tasks held back;
    nothing for other processors."""
    if "admission/admitted" not in last:
        return {}
    out = {"admitted_per_s": round((last["admission/admitted"]
                                    - first.get("admission/admitted", 0.0)) / dt, 2)}
    for key in ("bound_pool", "bound_pool_max", "held", "pool_lag"):
        if f"admission/{key}" in last:
            out[key] = last[f"admission/{key}"]
    return out


def records_used(cell: Cell, a: Edge, b: Edge, trajectories: int) -> dict[str, Any]:
    """Records the broker appended in the window, per topic: committed data records and
    the rest (transaction markers, aborted records), and per trajectory the nodes made."""
    run_topics = {cell.topo.full_name(t) for t in cell.topo.topics}
    ranges = {k: (a.ends.get(k, 0), v) for k, v in b.ends.items() if k[0] in run_topics}
    data = count_committed(cell.config, ranges)
    per_topic: dict[str, dict[str, int]] = {}
    for (t, _), v in b.ends.items():
        row = per_topic.setdefault(t, {"appended": 0, "data": 0})
        row["appended"] += v - a.ends.get((t, _), 0)
    for t, n in data.items():
        per_topic[t]["data"] = n
    # the feeder offers twice what the nodes take: the surplus waits on tasks.source, so
    # a trajectory's share there is one record per task admitted to tasks
    src, tasks = cell.topo.full_name("tasks.source"), cell.topo.full_name("tasks")
    per_topic[src] = {"appended": per_topic[tasks]["data"], "data": per_topic[tasks]["data"]}
    appended = sum(r["appended"] for r in per_topic.values())
    dt = b.mono - a.mono
    per = max(trajectories, 1)
    return {"per_topic": per_topic,
            "appended_per_s": round(appended / dt, 1),
            "data_per_trajectory": round(sum(r["data"] for r in per_topic.values()) / per, 3),
            "appended_per_trajectory": round(appended / per, 3)}


def measure(cell: Cell, broker_pid: int | None) -> dict[str, Any]:
    """The window: rates at the trainer, what was in flight, CPU, records and
    transactions."""
    from confluent_kafka import Consumer

    a = cell.args
    topics = [cell.topo.full_name(t) for t in cell.topo.topics]
    topics += ["__consumer_offsets", "__transaction_state"]
    consumer = Consumer(cell.config.consumer_conf(f"bench-scale-ends-{uuid.uuid4().hex[:6]}"))
    e0 = edge(cell, consumer, topics, broker_pid)
    seen = sample_window(cell, a.duration)
    e1 = edge(cell, consumer, topics, broker_pid)
    consumer.close()
    tr = cell.trainer
    dt = e1.mono - e0.mono
    procs = processor_rates(cell, e0, e1)
    node_tx = (e1.node_tx - e0.node_tx) / dt
    proc_tx = sum(p["tx_per_s"] for p in procs.values())
    busy = (e1.gen_s - e0.gen_s) / dt  # nodes generating, on average
    made = (e1.node_groups - e0.node_groups) * a.n_samples  # trajectories the nodes made
    raas = made / dt
    return {"trajectories_per_s": round(arrival_rate(tr.times, tr.sequences, e0.mono,
                                                     e1.mono), 2),
            "groups_per_s": round(arrival_rate(tr.times, tr.groups, e0.mono, e1.mono), 2),
            "raas_trajectories_per_s": round(raas, 2),
            "busy_nodes_mean": round(busy, 2),
            "batches_in_window": sum(e0.mono <= t < e1.mono for t in tr.times),
            **{k: round(v, 2) for k, v in seen.items()},
            "cpu_cores": cpu_cores(e0, e1), "processors": procs,
            "tx_per_s": {"raas": round(node_tx, 2), "processors": round(proc_tx, 2),
                         "total": round(node_tx + proc_tx, 2)},
            "records": records_used(cell, e0, e1, made), "window_s": round(dt, 1)}


def watch_group(cell: Cell, since: float, members: int, timeout_s: float
                ) -> tuple[float | None, float | None]:
    """Seconds from ``since`` until the RaaS group first left ``STABLE`` and until it was
    stable again with ``members`` members owning every partition of ``tasks``."""
    group, parts = cell.topo.raas_group(POOL), cell.spec.partitions
    snaps: list[Snapshot] = []
    while time.monotonic() - since < timeout_s:
        try:
            snaps.append(describe_group(cell.admin, group))
        except Exception:  # noqa: BLE001 - a describe timed out on a busy broker: look again
            continue
        done = settled_at(snaps, since, members, parts)
        if done is not None:
            began = next((s.at for s in snaps if s.state != "STABLE"), None)
            return (None if began is None else began - since), done - since
        time.sleep(0.05)
    return None, None


def rebalance(cell: Cell, timeout_s: float = 180.0) -> dict[str, Any]:
    """One node joins, then one (the first) is asked to stop: per event, the seconds
    until the rebalance began, until the group was stable with every partition owned,
    and until the next trajectory group was committed."""
    commits = CommitTimes(cell.nodes)
    out: dict[str, Any] = {}
    try:
        n = len(cell.nodes)
        for event, members in (("join", n + 1), ("leave", n)):
            t0 = time.monotonic()
            if event == "join":
                cell.add_node()
            else:
                cell.nodes[0].stop()
            began, settled = watch_group(cell, t0, members, timeout_s)
            flow = None
            if settled is not None:
                deadline = time.monotonic() + 60
                while (f := first_after(commits.times, t0 + settled)) is None \
                        and time.monotonic() < deadline:
                    time.sleep(0.05)
                flow = None if f is None else f - t0
            out[event] = {"began_s": _r(began), "settled_s": _r(settled), "flow_s": _r(flow)}
    finally:
        commits.stop()
    return out


def _r(x: float | None, nd: int = 2) -> float | None:
    return None if x is None else round(x, nd)


def run_cell(spec: CellSpec, args: argparse.Namespace, base: dict[str, Any],
             broker_pid: int | None) -> dict[str, Any]:
    """One grid cell from start to teardown: its row of the table."""
    workdir = Path(tempfile.mkdtemp(prefix="bench-scale-", dir=args.workdir))
    cell = Cell(spec, args, workdir)
    ideal, capped = expected_rates(spec.nodes, spec.partitions, args.n_samples,
                                   args.mean_rollout_s)
    row: dict[str, Any] = {**asdict(spec), "expected_per_s": round(ideal, 2),
                           "expected_capped_per_s": round(capped, 2)}
    t0 = time.monotonic()
    try:
        cell.start(base)
        row["first_batch_s"] = round(warm_up(cell, args.warmup_s, args.settle_s), 1)
        row.update(measure(cell, broker_pid))
        row["restarts"] = cell.restarts
        row["efficiency"] = round(row["trajectories_per_s"] / ideal, 3)
        if args.rebalance:
            row["rebalance"] = rebalance(cell)
    except Exception as e:  # noqa: BLE001 - one failed cell is a row with its error
        row["error"] = f"{type(e).__name__}: {e}"
    finally:
        cell.stop()
    row["cell_s"] = round(time.monotonic() - t0, 1)
    return row


# --- where throughput stops growing (plain logic) ---------------------------------------
def reasons(row: dict[str, Any], busy: float = 0.7, machine: float = 0.85) -> list[str]:
    """What held a row below its expected rate, from its own measurements."""
    out = []
    n, p = row["nodes"], row["partitions"]
    if n > p:
        out.append(f"{n - p} of {n} nodes idle: {p} partitions of tasks")
    live = min(n, p)
    if row.get("busy_nodes_mean", live) < 0.8 * live and row.get("in_flight_mean", 0) < 2 * live:
        out.append(f"admission: {row['in_flight_mean']:.0f} tasks in flight for {live} "
                   f"nodes that can work, {row['busy_nodes_mean']:.1f} busy")
    for cid, pr in row.get("processors", {}).items():
        if pr["busy_fraction"] >= busy:
            out.append(f"processor {cid} busy {pr['busy_fraction']:.0%}")
    cpu = row.get("cpu_cores", {})
    if (cpu.get("machine_busy_fraction") or 0) >= machine:
        own = sum(cpu.get(k) or 0.0 for k in ("broker", "processors", "bench"))
        out.append(f"machine CPU {cpu['machine_busy_fraction']:.0%} busy "
                   f"({row.get('cpu_count') or os.cpu_count()} cores; this bench's broker, "
                   f"processors and nodes {own:.2f} cores)")
    for who, label in (("broker", "broker"), ("bench", "node process (GIL)")):
        if (cpu.get(who) or 0) >= 0.8:
            out.append(f"{label} uses {cpu[who]:.2f} cores")
    return out


def plateaus(rows: list[dict[str, Any]], keep: float = 0.5) -> list[dict[str, Any]]:
    """Per (partitions, replicas), the first node count at which throughput grew by less
    than ``keep`` of the growth in nodes (None: it kept growing), and that row's reasons."""
    series: dict[tuple[int, int], list[dict[str, Any]]] = {}
    for r in rows:
        if "trajectories_per_s" in r:
            series.setdefault((r["partitions"], r["replicas"]), []).append(r)
    out = []
    for (p, rep), rs in sorted(series.items()):
        rs.sort(key=lambda r: r["nodes"])
        stop = None
        for prev, cur in zip(rs, rs[1:]):
            grow = cur["nodes"] / prev["nodes"] - 1
            got = cur["trajectories_per_s"] / max(prev["trajectories_per_s"], 1e-9) - 1
            if got < keep * grow:
                stop = cur
                break
        out.append({"partitions": p, "replicas": rep,
                    "stops_at_nodes": stop["nodes"] if stop else None,
                    "peak_per_s": max(r["trajectories_per_s"] for r in rs),
                    "why": reasons(stop) if stop else []})
    return out


def _f(x: Any, nd: int = 1) -> str:
    return "-" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def table(rows: list[dict[str, Any]]) -> str:
    head = ("| nodes | partitions | replicas | traj/s | RaaS traj/s | expected | "
            "expected (capped) | efficiency | in flight | busy nodes | tx/s | records/traj | "
            "broker cores | processor cores | bench cores | machine busy | join s | leave s |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['nodes']} | {r['partitions']} | {r['replicas']} | "
                         f"error: {r['error']} |")
            continue
        c, rb = r["cpu_cores"], r.get("rebalance", {})
        lines.append("| " + " | ".join([
            str(r["nodes"]), str(r["partitions"]), str(r["replicas"]),
            _f(r["trajectories_per_s"]), _f(r["raas_trajectories_per_s"]),
            _f(r["expected_per_s"]),
            _f(r["expected_capped_per_s"]), _f(r["efficiency"], 2), _f(r["in_flight_mean"]),
            _f(r["busy_nodes_mean"]), _f(r["tx_per_s"]["total"]),
            _f(r["records"]["appended_per_trajectory"], 2), _f(c.get("broker"), 2),
            _f(c.get("processors"), 2), _f(c.get("bench"), 2),
            _f(c.get("machine_busy_fraction"), 2),
            _f(rb.get("join", {}).get("settled_s"), 2),
            _f(rb.get("leave", {}).get("settled_s"), 2)]) + " |")
    return "\n".join(lines)


def records_table(row: dict[str, Any]) -> str:
    """Per topic of one row: committed data records and all records appended (with
    transaction markers), per trajectory the nodes made."""
    made = row["raas_trajectories_per_s"] * row["window_s"]
    lines = [f"records per trajectory, {row['nodes']} nodes, {row['partitions']} partitions, "
             f"{row['replicas']} replicas ({made:.0f} trajectories in {row['window_s']} s, "
             f"{row['tx_per_s']['total']:.1f} transactions/s, "
             f"{row['records']['appended_per_s']:.0f} records/s appended):",
             "| topic | data / trajectory | appended / trajectory |", "|---|---|---|"]
    for t, r in row["records"]["per_topic"].items():
        if r["appended"]:
            short = t.split(".", 1)[1] if t.startswith("bench-scale-") else t
            lines.append(f"| {short} | {r['data'] / max(made, 1):.3f} | "
                         f"{r['appended'] / max(made, 1):.3f} |")
    rec = row["records"]
    lines.append(f"| all | {rec['data_per_trajectory']:.3f} | "
                 f"{rec['appended_per_trajectory']:.3f} |")
    return "\n".join(lines)


# --- the run ------------------------------------------------------------------------------
def int_list(text: str) -> list[int]:
    """``"1,4,16"`` as ``[1, 4, 16]``; a clear error for anything else."""
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers, e.g. 1,4,16") from None
    if not out or min(out) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give whole numbers of at least 1")
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int_list, default=[1, 4, 16, 64])
    ap.add_argument("--partitions", type=int_list, default=[1, 4, 16])
    ap.add_argument("--replicas", type=int_list, default=[1, 2, 4],
                    help="instances of each replicable processor (staleness, router, batcher)")
    ap.add_argument("--duration", type=float, default=60.0, help="measured seconds per cell")
    ap.add_argument("--warmup-s", type=float, default=180.0,
                    help="longest wait for the first batch at the trainer")
    ap.add_argument("--settle-s", type=float, default=5.0, help="after the first batch")
    ap.add_argument("--tokens-per-s", type=float, default=50.0, help="per sequence")
    ap.add_argument("--min-tokens", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=1.5, help="Pareto tail index")
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--n-samples", type=int, default=4, help="samples per task")
    ap.add_argument("--no-rebalance", dest="rebalance", action="store_false")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--quick", action="store_true",
                    help="nodes 1,4 on 4 partitions, 1 replica, 20 s: a smoke run")
    ap.add_argument("--workdir", default=None, help="topologies and processor logs")
    ap.add_argument("--out", default=None, help="write the rows and conclusions here (JSON)")
    ap.add_argument("--report", default=None, metavar="FILE.json",
                    help="print the tables and conclusions of an earlier --out; run nothing")
    args = ap.parse_args(argv)
    if args.quick:
        args.nodes, args.partitions, args.replicas, args.duration = [1, 4], [4], [1], 20.0
    try:
        args.model = TokenModel(args.tokens_per_s, args.min_tokens, args.alpha, args.max_tokens)
    except ValueError as e:
        ap.error(str(e))
    args.mean_rollout_s = mean_rollout_s(args.model, args.n_samples, seed=args.seed)
    return args


def broker() -> tuple[int | None, Any]:
    """(the broker's pid if known, the embedded broker this bench started or None); sets
    ASTRAFLOW_BOOTSTRAP for every client and processor."""
    from astraflow.broker.embedded import EmbeddedBroker, free_port

    if os.environ.get("ASTRAFLOW_BOOTSTRAP"):
        pid = os.environ.get("ASTRAFLOW_BROKER_PID")
        return (int(pid) if pid else None), None
    own = EmbeddedBroker(state=tempfile.mkdtemp(prefix="astraflow-bench-scale-"))
    st = own.start(port=free_port())
    os.environ["ASTRAFLOW_BOOTSTRAP"] = st.bootstrap
    return st.pid, own


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    meta = run_meta("scale", ["python", *sys.argv] if argv is None
                    else ["python", "bench/scale.py", *argv])  # before the run: its commit
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        args.out = None
        report(args, saved["rows"], saved.get("meta") or meta)
        return
    print("$ python " + " ".join(shlex.quote(a) for a in [sys.argv[0], *(argv or sys.argv[1:])]))
    m = args.model
    print(f"[bench] engine: {m.tokens_per_s:g} tokens/s per sequence, Pareto length min "
          f"{m.min_tokens} alpha {m.alpha:g} cap {m.max_tokens}, {args.n_samples} samples per "
          f"task: mean rollout {args.mean_rollout_s:.2f}s", flush=True)
    base = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    broker_pid, own = broker()
    rows: list[dict[str, Any]] = []
    try:
        for p in args.partitions:
            for rep in args.replicas:
                for n in args.nodes:
                    rows.append(run_cell(CellSpec(n, p, rep), args, base, broker_pid))
                    rows[-1]["cpu_count"] = os.cpu_count()
                    print(f"[bench] {json.dumps(rows[-1])}", flush=True)
    finally:
        if own is not None:
            own.destroy()
    report(args, rows, meta)


def report(args: argparse.Namespace, rows: list[dict[str, Any]],
           meta: dict[str, Any]) -> None:
    print(table(rows))
    done = [r for r in rows if "trajectories_per_s" in r]
    if done:
        print(records_table(max(done, key=lambda r: r["raas_trajectories_per_s"])))
    found = plateaus(rows)
    for f in found:
        where = (f"stops growing at {f['stops_at_nodes']} nodes"
                 if f["stops_at_nodes"] else "keeps growing over the nodes run")
        print(f"partitions {f['partitions']}, replicas {f['replicas']}: peak "
              f"{f['peak_per_s']:.1f} trajectories/s; {where}"
              + (f": {'; '.join(f['why']) or 'no single cause measured'}"
                 if f["stops_at_nodes"] else ""))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        settings = {k: v for k, v in vars(args).items() if k != "model"}
        settings["model"] = asdict(args.model)
        Path(args.out).write_text(json.dumps(
            {"meta": meta, "settings": settings, "rows": rows, "plateaus": found,
             "cpu_count": os.cpu_count()}, indent=1))
        print(f"[bench] wrote {args.out}")


if __name__ == "__main__":
    main()
