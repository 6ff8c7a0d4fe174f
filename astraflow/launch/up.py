"""``astraflow up`` / ``astraflow down``: run a whole topology as local processes.

``up`` starts the embedded broker if needed, applies the topics, writes missing tiny
models, then starts one process per component (trainer per policy, every processor, the
RaaS nodes of every pool, the feeder and the evaluator), each an ordinary ``astraflow``
subcommand given the topology file and its identity only (it reads its settings from the
file, as when started by hand), with its log under ``runs/<run>/logs/``. It prints live
progress read from the ``status`` topic and, when it ends (``--duration``, ``--versions``
or Ctrl-C), stops the processes and writes ``runs/<run>/summary.json`` and
``summary.png``. When ``up`` itself dies (SIGKILL, a crash), the kernel sends each
component SIGTERM, so none outlives it. Its command line is ``astraflow.cli.up``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from astraflow.config.topology import Topology, with_overrides
from astraflow.launch.plan import (
    astraflow_command,
    metrics_ports,
    plan_processes,
    pool_bootstrap,
    process_niceness,
    raas_args,
)
from astraflow.launch.progress import (
    Progress,
    StatusSeries,
    closing_lines,
    status_table,
    write_summary,
)
from astraflow.launch.provision import MissingModel, write_tiny_models
from astraflow.trainer.processes import die_with_parent


@dataclass
class UpOptions:
    """How ``astraflow up`` runs a topology (``astraflow.cli.up`` builds it from the
    command line)."""

    topology: str  # the file each component is started with
    runs_dir: str = "runs"
    duration: float = 600.0  # seconds (0: until stopped)
    versions: int = 0  # stop after this many versions of every policy (0: no such bound)
    fresh: bool = False
    keep_broker: bool = False
    brokers: int = 1
    racks: str | None = None
    secure: bool = False
    # rewrite a tiny model whose recipe the topology changed (False: only a missing one)
    rewrite_outdated: bool = True


def _pids_file(topo: Topology, runs_dir: str) -> Path:
    return Path(runs_dir) / topo.run / "pids.json"


def up(args: UpOptions, topo: Topology) -> int:
    """``astraflow up``: one run at a time (a lock in its run directory)."""
    from astraflow.launch.supervisor import RunLocked, run_lock

    problem = trainer_backend_problem(topo)
    if problem:
        print(f"astraflow up: {problem}", file=sys.stderr)
        return 2
    run_dir = Path(args.runs_dir) / topo.run
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    try:
        with run_lock(run_dir / "up.lock"):
            return _up(args, topo, run_dir)
    except RunLocked as e:
        print(f"astraflow up: {e}", file=sys.stderr)
        return 2


def trainer_backend_problem(topo: Topology) -> str | None:
    """Why a policy's ``trainer.backend`` cannot run here (megatron-core missing, the
    wrong release on a CPU, a Python too old, a model directory already written with an
    architecture the mapping does not cover), before anything starts; None if nothing.
    Each trainer checks again at its start (a model written later included)."""
    from astraflow.models.errors import ModelError

    for policy, spec in topo.policies.items():
        backend = spec.trainer.backend or "torch"
        if backend == "torch":
            continue
        from astraflow.trainer.backend import preflight
        from astraflow.trainer.megatron_shims import MegatronUnavailable, check_megatron

        device = spec.trainer.device or "cpu"
        try:
            check_megatron(cpu=device.startswith("cpu"))
            if Path(spec.model, "config.json").is_file():
                preflight(backend, spec.model, device)
        except (MegatronUnavailable, ValueError, ModelError) as e:
            return f"policy {policy}: {e}"
    return None


def _up(args: UpOptions, topo: Topology, run_dir: Path) -> int:
    from astraflow.kafka.clients import make_admin
    from astraflow.kafka.topics import apply_topics
    from astraflow.launch.supervisor import Supervisor

    secure = getattr(args, "secure", False)
    on_cluster = getattr(args, "brokers", 1) > 1 or getattr(args, "racks", None)
    if on_cluster:
        broker, bootstrap = _embedded_cluster(args, topo, secure)
        config = topo.kafka.model_copy(update={"bootstrap_servers": bootstrap})
    else:
        broker = _embedded_broker(args, topo, secure)  # when this `up` must stop it
        config = topo.kafka.effective()  # a secured embedded broker: as its admin
    admin = make_admin(config)
    try:
        # a rewritten model starts a fresh run: the run's weight stream belongs to the old
        # model, and a trainer would resume it
        fresh = write_tiny_models(topo, rewrite_outdated=args.rewrite_outdated) or args.fresh
    except MissingModel as e:
        print(f"astraflow up: {e}", file=sys.stderr)
        return 2
    if fresh:
        topo = fresh_run(topo, config, Path(args.runs_dir))
        run_dir = Path(args.runs_dir) / topo.run
        (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    for c in apply_topics(admin, topo.resolved_topics()):
        if c.action != "unchanged":
            print(f"topic {c.action}: {c.topic}")
    secured = None
    if secure:
        from astraflow.launch.secure import prepare

        secured = prepare(topo, config, run_dir)
    sup = Supervisor(plan_processes(topo, args.topology),
                     _spawner(topo, config, run_dir, secured))
    pids = _pids_file(topo, args.runs_dir)
    progress = Progress()
    try:
        sup.start_all()
        pids.write_text(json.dumps(sup.pids()))
        print(f"started {len(sup.procs)} processes ({', '.join(sup.procs)}); logs in "
              f"{run_dir / 'logs'}")
        ports = metrics_ports(topo)
        if ports:
            print("Prometheus metrics: " + ", ".join(
                f"{name} :{port}/metrics" for name, port in ports.items()))
        code = _watch(args, topo, config, sup, progress, pids)
    finally:
        sup.stop_all()
        pids.unlink(missing_ok=True)
        if broker is not None:
            broker.stop()
            print(f"stopped the embedded {'cluster' if on_cluster else 'broker'} "
                  "(--keep-broker keeps it)")
    summary = write_summary(run_dir, topo, progress,
                             {n: k for n, k in sup.restarts.items() if k})
    print(closing_lines(summary, run_dir))
    return code


def _embedded_broker(args: UpOptions, topo: Topology, secure: bool):
    """Start the embedded broker (secured for ``--secure``) unless the run has a cluster
    of its own; the broker when this ``up`` started it (and stops it at the end)."""
    from astraflow.broker.embedded import EmbeddedBroker

    if secure:
        from astraflow.launch.secure import check_embedded

        check_embedded(topo)
    if os.environ.get("ASTRAFLOW_BOOTSTRAP") or topo.kafka.bootstrap_servers:
        return None
    embedded = EmbeddedBroker()
    started_here = not embedded.status().running and not args.keep_broker
    print(embedded.start(secure=True if secure else None).describe())
    return embedded if started_here else None


def _embedded_cluster(args: UpOptions, topo: Topology, secure: bool):
    """``up --brokers N``: start the embedded cluster (``astraflow.broker.cluster``) unless it
    runs; (the cluster when this ``up`` started it, else None; its bootstrap)."""
    from astraflow.broker.cluster import DEFAULT_CLUSTER_PORT, EmbeddedCluster, parse_racks
    from astraflow.errors import AstraflowError

    if secure:
        raise AstraflowError("up --secure runs on the single embedded broker, not --brokers")
    if os.environ.get("ASTRAFLOW_BOOTSTRAP") or topo.kafka.bootstrap_servers:
        where = ("ASTRAFLOW_BOOTSTRAP" if os.environ.get("ASTRAFLOW_BOOTSTRAP")
                 else f"{topo.source}: kafka.bootstrap_servers")
        raise AstraflowError(f"up --brokers runs on the embedded cluster, but {where} names "
                             "another: unset it, or run without --brokers")
    cluster = EmbeddedCluster(size=args.brokers, racks=parse_racks(args.racks))
    started_here = cluster.running_bootstrap() is None and not args.keep_broker
    print(cluster.start(timeout=240.0, base_port=DEFAULT_CLUSTER_PORT).describe())
    return (cluster if started_here else None), cluster.bootstrap


def _spawner(topo: Topology, config, run_dir: Path, secured=None):
    """``spawn(name, cmd)``: a component's process, logging to ``logs/<name>.log``;
    ``secured`` (``astraflow.launch.secure.SecureRun``): each as its own principal."""
    # one intra-op thread per process: several processes share the cores, and torch's
    # default (all cores each) makes them thrash
    env = {"OMP_NUM_THREADS": "1", **os.environ, "ASTRAFLOW_BOOTSTRAP": config.bootstrap_servers,
           "ASTRAFLOW_RUN": topo.run, "PYTHONUNBUFFERED": "1"}
    niceness = process_niceness(topo)
    ports = metrics_ports(topo)

    def spawn(name: str, cmd: list[str]) -> subprocess.Popen:
        nice = niceness.get(name, 0)
        own = {**env, "ASTRAFLOW_METRICS_PORT": str(ports[name])} if name in ports else env
        bootstrap = pool_bootstrap(topo, name)
        own = {**own, "ASTRAFLOW_BOOTSTRAP": bootstrap} if bootstrap else own
        if secured is not None:
            own = _secured_env(topo, secured, name, own)
        # a session of its own: the terminal's Ctrl-C reaches `up` alone, which stops the
        # components in order; SIGTERM when `up` dies, however it dies: a killed `up`
        # leaves no component running
        then = (lambda k=nice: os.nice(k)) if nice else None
        with open(run_dir / "logs" / f"{name}.log", "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=own,
                                    start_new_session=True,
                                    preexec_fn=die_with_parent(signal.SIGTERM, then))

    return spawn


def _secured_env(topo: Topology, secured, name: str, env: dict[str, str]) -> dict[str, str]:
    """``env`` for process ``name`` of a secured run: its own credentials only (a password
    or signing key that ``up`` itself was given does not pass on)."""
    from astraflow.kafka.security import ENV_PASSWORD, ENV_SSL_KEYS
    from astraflow.launch.secure import component_env
    from astraflow.weights.signing import ENV_SIGNING_KEY

    dropped = {ENV_PASSWORD, ENV_SIGNING_KEY, *ENV_SSL_KEYS}
    return {**{k: v for k, v in env.items() if k not in dropped},
            **component_env(topo, secured, name)}


class OnceAnswering:
    """A topic table ``up`` reads (its progress, scaling advice), opened once Kafka answers.

    A broker slow to answer while every component starts (a few seconds on a busy machine)
    or away for a while must not end the run: its components wait for Kafka too, and ``up``
    keeps supervising them meanwhile. Past ``limit_s`` without an answer it gives up, as
    they do (``BrokerUnreachable``). An error other than Kafka not answering is raised at once."""

    def __init__(self, open_table: Callable[[float], Any], what: str, limit_s: float,
                 attempt_s: float = 3.0):
        self._open, self.what, self.limit_s = open_table, what, limit_s
        self._attempt_s = attempt_s
        self._since = time.monotonic()
        self._waiting = False  # said that Kafka does not answer (once per wait)
        self.table: Any = None

    def poll(self, timeout: float) -> None:
        """Open the table if it is not yet (one attempt), else poll it."""
        if self.table is not None:
            self.table.poll(timeout)
            return
        from confluent_kafka import KafkaException

        from astraflow.kafka.outage import BrokerUnreachable, kafka_error, transient

        try:
            self.table = self._open(self._attempt_s)
        except KafkaException as e:
            if not transient(kafka_error(e)):
                raise
            waited = time.monotonic() - self._since
            if waited > self.limit_s:
                raise BrokerUnreachable(f"Kafka has not answered for {waited:.0f} s (over "
                                f"kafka.outage_limit_s={self.limit_s:g}): {e}") from None
            if not self._waiting:
                print(f"Kafka not answering yet: {self.what} follows once it does ({e})",
                      flush=True)
                self._waiting = True
            return
        if self._waiting:
            print(f"Kafka answers after {time.monotonic() - self._since:.0f} s: {self.what} "
                  "follows", flush=True)

    def close(self) -> None:
        if self.table is not None:
            self.table.close()


def _watch(args: UpOptions, topo: Topology, config, sup, progress: Progress,
           pids: Path) -> int:
    """Show progress and supervise until the duration, the versions, Ctrl-C or a component
    that keeps failing (exit code 1) ends the run."""
    from confluent_kafka import KafkaException

    from astraflow.kafka.lag import LagReader, total_lag
    from astraflow.kafka.outage import BrokerUnreachable
    from astraflow.launch.supervisor import GaveUp

    series = StatusSeries(Path(args.runs_dir) / topo.run / "tensorboard", topo.run,
                          time.time())
    limit_s = config.outage_limit_s
    status = OnceAnswering(lambda t: status_table(config, topo.full_name("status"), progress,
                                                  series, timeout_s=t),
                           "progress", limit_s)
    scaling = None
    if any(p.kind == "autoscaler" for p in topo.processors.values()):
        scaling = OnceAnswering(lambda t: _scaling_table(topo, args.topology, config, sup,
                                                         pids, timeout_s=t),
                                "scaling advice", limit_s)
    lags = LagReader(config)
    pool_groups = list(topo.raas_groups())
    stop = {"flag": False}
    signal.signal(signal.SIGINT, lambda *_: stop.update(flag=True))
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    last_line = 0.0
    try:
        while not stop["flag"]:
            status.poll(0.2)
            if scaling is not None:
                scaling.poll(0)
            if sup.check():
                pids.write_text(json.dumps(sup.pids()))
            if sup.finished - {"feeder"}:
                print(f"{', '.join(sorted(sup.finished - {'feeder'}))} finished: stopping")
                break
            if time.time() - last_line >= 5:
                try:
                    lag = sum(total_lag(lags.lag(g, [topo.full_name("tasks")], timeout=3))
                              for g in pool_groups)
                except KafkaException:  # the components wait for it; so does the line
                    lag = None
                restarts = sup.restart_summary()
                print(progress.line(lag) + (f" | restarts {restarts}" if restarts else ""),
                      flush=True)
                last_line = time.time()
            if args.duration and time.time() - progress.started >= args.duration:
                break
            if args.versions and progress.versions and min(progress.versions.values()) >= \
                    args.versions:
                break
            time.sleep(0.5)
    except GaveUp as e:
        print(f"astraflow up: {e}; see its log in {Path(args.runs_dir) / topo.run / 'logs'}",
              file=sys.stderr)
        return 1
    except BrokerUnreachable as e:
        print(f"astraflow up: {e}", file=sys.stderr)
        return 1
    finally:
        lags.close()
        status.close()
        if scaling is not None:
            scaling.close()
    return 0


def fresh_run(topo: Topology, config, runs_dir: Path) -> Topology:
    """``topo`` as a run that starts from version 0: under its own name if the cluster has
    no run of that name, else under the next free ``<run>-N`` (the older run's topics stay
    for replay; only ``astraflow run delete`` removes a run). The new name is recorded in
    ``RUNS_DIR/<run>/latest-run`` for ``astraflow down``."""
    from astraflow.launch.runs import Runs, next_run_id

    base = topo.run
    new = next_run_id(base, Runs(config).names())
    if new == base:
        return topo
    print(f"run {base} already has topics: this fresh run is {new} (run {base} stays, for "
          f"replay; `astraflow run delete {base}` removes it)")
    (runs_dir / base).mkdir(parents=True, exist_ok=True)
    (runs_dir / base / "latest-run").write_text(new + "\n")
    return with_overrides(topo, new, None)


def _scaling_table(topo: Topology, path: str, config, sup, pids: Path,
                   timeout_s: float = 10.0):
    """A table of ``scaling`` whose new advice the ``PoolActuator`` follows (for a topology
    with an ``autoscaler`` processor)."""
    from astraflow.kafka.table import TopicTable
    from astraflow.launch.actuator import PoolActuator
    from astraflow.wire.records import ScalingAdvice

    table = TopicTable.open(config, topo.full_name("scaling"), ScalingAdvice,
                            key=lambda e: e.value.pool if e.value else None,
                            client_id="up-actuator", metadata_timeout_s=timeout_s)
    # made once the table opens: an attempt Kafka did not answer leaves nothing behind
    actuator = PoolActuator(list(topo.pools), sup,
                            lambda pool, i: astraflow_command(*raas_args(topo, path, pool, i)))

    def changed(_k, _old, new) -> None:
        if new is not None and actuator.follow(new):
            pids.write_text(json.dumps(sup.pids()))

    table.on_change(changed)
    return table


def down(runs_dir: str, topo: Topology) -> int:
    """``astraflow down``: stop what ``up`` started for ``topo`` (its process ids under
    ``runs_dir``)."""
    pids_file = _pids_file(topo, runs_dir)
    latest = Path(runs_dir) / topo.run / "latest-run"
    if not pids_file.exists() and latest.exists():  # `up --fresh` started a new run name
        pids_file = Path(runs_dir) / latest.read_text().strip() / "pids.json"
    if not pids_file.exists():
        print(f"nothing to stop for run {topo.run} ({pids_file} not found)")
        return 0
    pids = json.loads(pids_file.read_text())
    for name, pid in pids.items():
        try:
            os.kill(pid, signal.SIGTERM)
            print(f"stopping {name} (pid {pid})")
        except ProcessLookupError:
            pass
    deadline = time.time() + 30
    for pid in pids.values():
        while time.time() < deadline:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                break
            time.sleep(0.2)
        else:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    pids_file.unlink()
    return 0
