"""``astraflow up`` / ``astraflow down``: run a whole topology as local processes.

``up`` starts the embedded broker if needed, applies the topics, writes missing tiny
models, then starts one process per component (trainer per policy, every processor, the
RaaS nodes of every pool, the feeder and the evaluator), each an ordinary ``astraflow``
subcommand given the topology file and its identity only (it reads its settings from the
file, as when started by hand), with its log under ``runs/<run>/logs/``. It prints live
progress read from the ``status`` topic and, when it ends (``--duration``, ``--versions``
or Ctrl-C), stops the processes and writes ``runs/<run>/summary.json`` and
``summary.png``. Its command line is ``astraflow.cli.up``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config.overrides import WARM_START_FLAGS
from astraflow.config.topology import PolicySpec, Topology, with_overrides
from astraflow.metrics import STALENESS_DROPS

# the recipe a `model init` (`model init-role`) command line leaves (its parsed options:
# astraflow.models.recipe.init_recipe), given by the command line's parser
RecipeOf = Callable[[list[str]], dict[str, Any]]


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
    # rewrites a tiny model whose recipe the topology changed (None: only a missing one)
    recipe_of: RecipeOf | None = None


def _astraflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "astraflow.cli.main", *args]


def plan_processes(topo: Topology, path: str) -> dict[str, list[str]]:
    """Name -> command line of every process `up` starts for ``topo``: each component with
    the topology file ``path`` and its identity only (policy, pool and instance, processor
    name; where its model is), so that it reads its settings from the file itself, as it
    does when started by hand or by a compose service."""
    procs: dict[str, list[str]] = {}
    for policy in topo.policies:
        procs[f"trainer-{policy}"] = _astraflow(*trainer_args(topo, path, policy))
    for name in topo.processors:
        procs[f"processor-{name}"] = _astraflow("processor", "run", name, "--topology", path,
                                                "--instance", "up")
    for pool, spec in topo.pools.items():
        for i in range(spec.nodes):
            procs[f"raas-{pool}-{i}"] = _astraflow(*_raas_args(topo, path, pool, i))
    if topo.feeder is not None:
        procs["feeder"] = _astraflow("feeder", "run", "--topology", path)
    if topo.eval is not None:
        for policy in topo.policies:
            procs[f"eval-{policy}"] = _astraflow(*eval_args(topo, path, policy))
    return procs


def trainer_args(topo: Topology, path: str, policy: str) -> list[str]:
    """The ``astraflow`` arguments of ``policy``'s trainer (``trainer run``): the file,
    the policy and its model directory."""
    return ["trainer", "run", "--topology", path, "--policy", policy,
            "--model", topo.policies[policy].model]


def _raas_args(topo: Topology, path: str, pool: str, index: int) -> list[str]:
    """The ``astraflow`` arguments of node ``index`` of ``pool`` (``raas run``): the file,
    the pool, the node's instance and each policy's model directory."""
    args = ["raas", "run", "--topology", path, "--pool", pool, "--instance", f"{pool}-{index}"]
    for policy, p in topo.policies.items():
        args += ["--policy-model", f"{policy}={p.model}"]
    return args


def eval_args(topo: Topology, path: str, policy: str) -> list[str]:
    """The ``astraflow`` arguments of ``policy``'s evaluator (``eval run``): the file,
    the policy and its model directory."""
    return ["eval", "run", "--topology", path, "--policy", policy,
            "--model", topo.policies[policy].model]


def process_niceness(topo: Topology) -> dict[str, int]:
    """Name -> CPU niceness of the processes `up` starts with one (a policy's ``nice``: its
    trainer and evaluator); the others keep the launcher's."""
    out = {}
    for policy, spec in topo.policies.items():
        if spec.nice:
            out[f"trainer-{policy}"] = spec.nice
            if topo.eval is not None:
                out[f"eval-{policy}"] = spec.nice
    return out


@dataclass
class Progress:
    """Latest figures per component, folded from ``status`` records."""

    started: float = field(default_factory=time.time)
    versions: dict[str, int] = field(default_factory=dict)
    trainer: dict[str, dict[str, float]] = field(default_factory=dict)
    rollout_reward: dict[str, float] = field(default_factory=dict)  # per raas component
    # stage (filter, batcher, trainer) -> component -> groups it dropped as too stale
    drops: dict[str, dict[str, float]] = field(default_factory=dict)
    eval: dict[str, list[tuple[float, int, float]]] = field(default_factory=dict)
    series: list[dict[str, float]] = field(default_factory=list)
    # multi-policy runs: per raas component, each policy's rollout reward and the
    # workflow's own metrics (e.g. verify/*), averaged over the groups since its last status
    policy_rollout: dict[str, dict[str, float]] = field(default_factory=dict)
    workflow: dict[str, dict[str, float]] = field(default_factory=dict)
    # the admission's tasks in flight and their target (its tightest RaaS group), and the
    # most of each seen
    tasks: dict[str, float] = field(default_factory=dict)

    def fold(self, status) -> None:
        m = status.metrics
        if "admission/bound_pool" in m:
            n, target = m["admission/pool_lag"], m["admission/bound_pool"]
            peak = m.get("admission/bound_pool_max", target)
            self.tasks.update(in_flight=n, target=target,
                              in_flight_max=max(n, self.tasks.get("in_flight_max", 0.0)),
                              target_max=max(peak, self.tasks.get("target_max", 0.0)))
        for stage, key in STALENESS_DROPS.items():
            if key in m:
                self.drops.setdefault(stage, {})[status.component_id] = m[key]
        if status.kind == "trainer":
            self.versions[status.policy] = status.weight_versions.get(status.policy, 0)
            self.trainer[status.policy] = dict(m)
        elif status.kind == "raas" and "rollout/reward_mean" in m:
            self.rollout_reward[status.component_id] = m["rollout/reward_mean"]
            prefix = "rollout/reward_mean/"
            self.policy_rollout[status.component_id] = {
                k[len(prefix):]: v for k, v in m.items() if k.startswith(prefix)}
            self.workflow[status.component_id] = {
                k: v for k, v in m.items() if "/" in k and k.split("/")[0] not in
                ("rollout", "raas")}
        elif status.kind == "evaluator":
            v = status.weight_versions.get(status.policy, -1)
            points = self.eval.setdefault(status.policy, [])
            if not points or points[-1][1] != v:
                points.append((time.time() - self.started, v, m["eval/accuracy"]))

    def drops_by_stage(self) -> dict[str, float]:
        """Groups dropped as too stale per stage, summed over its components."""
        return {stage: sum(per.values()) for stage, per in self.drops.items()}

    @property
    def stale_dropped(self) -> float:
        """Groups dropped as too stale, at every stage."""
        return sum(self.drops_by_stage().values())

    def rollout_of(self, policy: str) -> float | None:
        """The policy's rollout reward, averaged over the nodes (multi-policy runs)."""
        vals = [d[policy] for d in self.policy_rollout.values() if policy in d]
        return sum(vals) / len(vals) if vals else None

    def workflow_metrics(self) -> dict[str, float]:
        """The workflow metrics (e.g. ``verify/*``), averaged over the nodes."""
        acc: dict[str, list[float]] = {}
        for d in self.workflow.values():
            for k, v in d.items():
                acc.setdefault(k, []).append(v)
        return {k: sum(v) / len(v) for k, v in sorted(acc.items())}

    def policy_summary(self, policies) -> dict[str, dict[str, Any]]:
        """Per policy: version, train and rollout reward, last held-out accuracy."""
        out = {}
        for p in policies:
            ev = self.eval.get(p) or []
            out[p] = {"version": self.versions.get(p),
                      "train_reward": self.trainer.get(p, {}).get("trainer/reward_mean"),
                      "rollout_reward": self.rollout_of(p),
                      "eval_accuracy": ev[-1][2] if ev else None,
                      "eval_version": ev[-1][1] if ev else None}
        return out

    def line(self, lag: int | None) -> str:
        """One progress line; ``lag`` None: Kafka did not answer."""
        t = time.time() - self.started
        parts = [f"{t:6.0f}s"]
        for policy, v in sorted(self.versions.items()):
            tm = self.trainer.get(policy, {})
            parts.append(f"{policy} v{v} reward {tm.get('trainer/reward_mean', float('nan')):.3f}"
                         f" wait {tm.get('trainer/wait_fraction', float('nan')):.2f}")
            r = self.rollout_of(policy)
            if r is not None:
                parts.append(f"{policy} rollout reward {r:.3f}")
            ev = self.eval.get(policy)
            if ev:
                parts.append(f"eval {ev[-1][2]:.3f}@v{ev[-1][1]}")
        wf = self.workflow_metrics()
        if wf:
            parts.append(" ".join(f"{k} {v:.2f}" for k, v in wf.items()))
        if self.rollout_reward:
            r = sum(self.rollout_reward.values()) / len(self.rollout_reward)
            parts.append(f"rollout reward {r:.3f}")
        parts.append(f"tasks lag {lag}" if lag is not None else "Kafka not answering")
        if self.tasks:
            parts.append(f"in flight {self.tasks['in_flight']:.0f}/{self.tasks['target']:.0f}")
        by_stage = self.drops_by_stage()
        parts.append("stale drops " + (" ".join(f"{k} {v:.0f}" for k, v in by_stage.items())
                                       if by_stage else "0"))
        self.series.append({
            "t": t, **{f"version/{p}": float(v) for p, v in self.versions.items()},
            **{f"reward/{p}": tm["trainer/reward_mean"]
               for p, tm in self.trainer.items() if "trainer/reward_mean" in tm},
            **{f"staleness_mean/{p}": tm["trainer/staleness_mean"]
               for p, tm in self.trainer.items() if "trainer/staleness_mean" in tm},
            "stale_dropped": self.stale_dropped,
            **({"lag/tasks": float(lag)} if lag is not None else {})})
        return " | ".join(parts)


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
        fresh = _write_tiny_models(topo, args.recipe_of) or args.fresh
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
    summary = _write_summary(run_dir, topo, progress,
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


def closing_lines(summary: dict[str, Any], run_dir: Path) -> str:
    """What ``up`` prints when it ends: the run in a few lines, and where the rest is."""
    lines = [f"run {summary['run']}: {summary['seconds']:.0f}s"]
    for policy, p in summary["policies"].items():
        acc = p.get("eval_accuracy")
        lines.append(f"  {policy}: version {p.get('version')}, train reward "
                     f"{_fmt(p.get('train_reward'))}, held-out accuracy {_fmt(acc)}"
                     + (f" at v{p.get('eval_version')}" if acc is not None else ""))
    stages = summary.get("staleness_dropped_by_stage") or {}
    where = " (" + ", ".join(f"{k} {v:.0f}" for k, v in stages.items()) + ")" if stages else ""
    lines.append(f"  stale groups dropped: {summary['staleness_dropped']:.0f}{where}; "
                 f"restarts: {summary['restarts'] or 'none'}")
    tasks = summary.get("tasks_in_flight") or {}
    if tasks:
        lines.append(f"  tasks in flight: at most {tasks['in_flight_max']:.0f} "
                     f"(admission target at most {tasks['target_max']:.0f})")
    lines.append(f"summary: {run_dir / 'summary.json'}"
                 + (f"; plot: {summary['plot']}" if summary.get("plot") else ""))
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def metrics_ports(topo: Topology) -> dict[str, int]:
    """Process name -> the port of its Prometheus metrics (``metrics_port`` and up)."""
    if topo.metrics_port is None:
        return {}
    served = [n for n in plan_processes(topo, "")  # those that run the transactional loop
              if n.startswith(("trainer-", "processor-", "raas-"))]
    return {name: topo.metrics_port + i for i, name in enumerate(served)}


def pool_bootstrap(topo: Topology, name: str) -> str | None:
    """The bootstrap address of process ``name`` when it is a node (``raas-<pool>-<i>``)
    of a pool whose ``kafka:`` sets one: ``up`` hands it over as ``ASTRAFLOW_BOOTSTRAP``
    in place of the run's (e.g. a remote pool behind a proxy); else None."""
    for pool, spec in topo.pools.items():
        index = name.removeprefix(f"raas-{pool}-")
        if index != name and index.isdigit():
            return spec.kafka.get("bootstrap_servers")
    return None


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
        with open(run_dir / "logs" / f"{name}.log", "ab") as log:
            return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=own,
                                    start_new_session=True,
                                    preexec_fn=(lambda k=nice: os.nice(k)) if nice else None)

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


def _watch(args: UpOptions, topo: Topology, config, sup, progress: Progress,
           pids: Path) -> int:
    """Show progress and supervise until the duration, the versions, Ctrl-C or a component
    that keeps failing (exit code 1) ends the run."""
    from confluent_kafka import KafkaException

    from astraflow.kafka.lag import LagReader, total_lag
    from astraflow.launch.supervisor import GaveUp

    series = StatusSeries(Path(args.runs_dir) / topo.run / "tensorboard", topo.run,
                          time.time())
    status = _status_table(config, topo.full_name("status"), progress, series)
    scaling = _scaling_table(topo, args.topology, config, sup, pids)
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
    finally:
        lags.close()
        status.close()
        if scaling is not None:
            scaling.close()
    return 0


class MissingModel(Exception):
    """A policy's model is missing and ``astraflow up`` may not write it."""


def _write_tiny_models(topo: Topology, recipe_of: RecipeOf | None = None) -> bool:
    """Write the tiny model of every policy that lacks one or (given ``recipe_of``) whose
    recipe the topology changed (``_model_init_command``: ``model init`` or ``model
    init-role``, one at a time); True if any was written. MissingModel for a missing model
    that ``up`` may not write (``init_tiny: false``)."""
    wrote = False
    for policy, spec in topo.policies.items():
        wrote = write_policy_model(policy, spec, recipe_of) or wrote
    return wrote


def write_policy_model(policy: str, spec, recipe_of: RecipeOf | None = None) -> bool:
    """Write (or import) the model of one policy as its topology entry says, unless it is
    there (and, given ``recipe_of``, up to date); True if it was written."""
    if spec.import_from:
        return _import_model(policy, spec)
    stale = _tiny_model_outdated(spec, recipe_of) if recipe_of is not None else ""
    if not stale and Path(spec.model, "config.json").exists():
        return False
    if not spec.init_tiny:
        raise MissingModel(f"policy {policy}: no model at {spec.model}")
    what = "default" if spec.role == "solver" else spec.role
    print(f"writing the tiny {what} model for {policy} to {spec.model} (warm start "
          f"{spec.warm_start.steps} steps, carry slip {spec.warm_start.slip})"
          f"{': ' + stale if stale else ''}", flush=True)
    subprocess.run(_astraflow(*_model_init_command(spec)), check=True)
    return True


def _import_model(policy: str, spec) -> bool:
    """Import the policy's pretrained model (``import_from``) when its directory has none;
    True if it was imported."""
    from astraflow.models.recipe import INIT_RECIPE

    if Path(spec.model, "config.json").exists():
        if Path(spec.model, INIT_RECIPE).exists():  # a tiny model, not this import
            raise MissingModel(
                f"policy {policy}: {spec.model} holds a tiny model written by `astraflow "
                f"model init` ({INIT_RECIPE}), not one imported from {spec.import_from}; "
                f"delete that directory or give the policy another `model:`")
        return False
    source = (["--gguf", spec.import_from] if spec.import_from.endswith(".gguf")
              else [spec.import_from])
    print(f"importing {spec.import_from} for {policy} into {spec.model}", flush=True)
    done = subprocess.run(_astraflow("model", "import", *source, spec.model))
    if done.returncode:
        raise MissingModel(f"policy {policy}: importing {spec.import_from} failed")
    return True


def _model_init_command(spec: PolicySpec) -> list[str]:
    """The ``astraflow`` arguments that write the tiny model of ``spec``: ``model init``
    (the solver's answer format) or, for a verifier/selector, ``model init-role``; each
    warm-start setting the file gives as its flag (``WARM_START_FLAGS``).

    ``--warm-start-steps`` and ``--carry-slip`` are always passed: the topology's
    ``warm_start`` (default 0 each) decides, not the command's own default
    (``init-role``'s slip is 0.5).
    """
    ws = spec.warm_start
    common: list[str] = []
    for flag in WARM_START_FLAGS:
        value = getattr(ws, flag.field)
        if value is None or value is False:
            continue
        common += [flag.name] if value is True else [flag.name, str(value)]
    if spec.role != "solver":
        return ["model", "init-role", spec.model, "--role", spec.role, *common]
    return ["model", "init", spec.model, *common]


def _tiny_model_outdated(spec, recipe_of: RecipeOf) -> str:
    """Why the tiny model at ``spec.model`` must be rewritten ("" when it need not be).

    Only a model that ``astraflow model init`` or ``model init-role`` wrote (both leave
    their recipe file) and whose recipe differs from what the topology asks for -- the
    command included, so a solver model becomes a verifier's and back -- is rewritten;
    any other model is left alone. ``recipe_of(argv)``: the recipe the command line
    ``argv`` leaves (its parser is the command line's: ``astraflow.cli.up``).
    """
    from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE

    if not spec.init_tiny:
        return ""
    recipe_file = Path(spec.model, INIT_RECIPE)
    if not recipe_file.is_file():
        if Path(spec.model, OLD_ROLE_RECIPE).is_file():
            return f"written by an older `model init-role` ({OLD_ROLE_RECIPE}, no {INIT_RECIPE})"
        return ""
    try:
        recipe = json.loads(recipe_file.read_text())
    except (OSError, ValueError):
        return ""
    command = _model_init_command(spec)
    want = recipe_of(command)
    # an option added after the model was written counts as its default
    defaults = recipe_of([*command[:3], *(["--role", spec.role] if spec.role != "solver"
                                         else [])])
    diff = [f"{k} {recipe.get(k, defaults.get(k))} -> {v}" for k, v in want.items()
            if recipe.get(k, defaults.get(k)) != v]
    return "the topology changed how it is made (" + ", ".join(diff) + ")" if diff else ""


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


class StatusSeries:
    """Every component's status figures as scalar series: one TensorBoard run per
    component under ``log_dir`` (``tensorboard --logdir runs/<run>/tensorboard``), and to
    W&B when ``$WANDB_PROJECT`` is set and wandb is installed. The step is the component's
    weight version when it has one, else the seconds since ``started``."""

    def __init__(self, log_dir: Path, run: str, started: float):
        from astraflow.metrics import WandbSink

        self.log_dir, self.started = log_dir, started
        self.sinks: dict[str, Any] = {}
        self.wandb = None
        project = os.environ.get("WANDB_PROJECT")
        if project:
            try:
                self.wandb = WandbSink(project, run)
            except Exception as e:  # noqa: BLE001 - metrics must not stop the run
                print(f"no W&B metrics: {e}", file=sys.stderr)

    def add(self, status) -> None:
        from astraflow.metrics import TensorBoardSink

        cid = status.component_id
        sink = self.sinks.get(cid)
        if sink is None:
            sink = self.sinks[cid] = TensorBoardSink(self.log_dir / cid.replace("/", "_"))
        step = (status.weight_versions.get(status.policy) if status.policy else None)
        if step is None:
            step = int(time.time() - self.started)
        figures = {**status.metrics, "records/in": status.consumed,
                   "records/out": status.produced, "records/dead_lettered": status.dead_lettered}
        sink.emit(step, figures)
        if self.wandb is not None:
            self.wandb.emit(int(time.time() - self.started),
                            {f"{cid}/{k}": v for k, v in figures.items()})


def _status_table(config, topic: str, progress: Progress, series: StatusSeries | None = None):
    """The ``status`` topic from its end on, as a table by component; every new status is
    folded into ``progress`` (and ``series``)."""
    from astraflow.kafka.table import TopicTable
    from astraflow.wire.records import ComponentStatus

    table = TopicTable.open(config, topic, ComponentStatus, start="end", client_id="up",
                            key=lambda e: e.value.component_id if e.value else None)
    def changed(_k, _old, new) -> None:
        if new is not None:
            progress.fold(new)
            if series is not None:
                series.add(new)

    table.on_change(changed)
    return table


def _scaling_table(topo: Topology, path: str, config, sup, pids: Path):
    """With an ``autoscaler`` processor in the topology: a table of ``scaling`` whose new
    advice the ``PoolActuator`` follows (None without one)."""
    if not any(p.kind == "autoscaler" for p in topo.processors.values()):
        return None
    from astraflow.kafka.table import TopicTable
    from astraflow.launch.actuator import PoolActuator
    from astraflow.wire.records import ScalingAdvice

    actuator = PoolActuator(list(topo.pools), sup,
                            lambda pool, i: _astraflow(*_raas_args(topo, path, pool, i)))
    table = TopicTable.open(config, topo.full_name("scaling"), ScalingAdvice,
                            key=lambda e: e.value.pool if e.value else None,
                            client_id="up-actuator")

    def changed(_k, _old, new) -> None:
        if new is not None and actuator.follow(new):
            pids.write_text(json.dumps(sup.pids()))

    table.on_change(changed)
    return table


def _write_summary(run_dir: Path, topo: Topology, progress: Progress,
                   restarts: dict[str, int]) -> dict[str, Any]:
    summary: dict[str, Any] = {
        "run": topo.run,
        "started_at": round(progress.started, 3),  # epoch s: eval times count from here
        "seconds": round(time.time() - progress.started, 1),
        "versions": progress.versions,
        "trainer": progress.trainer,
        "eval": {p: [{"t": round(t, 1), "version": v, "accuracy": a} for t, v, a in pts]
                 for p, pts in progress.eval.items()},
        "staleness_dropped": progress.stale_dropped,
        "staleness_dropped_by_stage": progress.drops_by_stage(),
        "tasks_in_flight": progress.tasks,
        "policies": progress.policy_summary(topo.policies),
        "workflow_metrics": progress.workflow_metrics(),
        "restarts": restarts,
    }
    summary["series"] = progress.series
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    from astraflow.launch.plots import write_plots

    try:
        summary["plots"] = [str(p) for p in write_plots(summary, run_dir)]
    except Exception as e:  # noqa: BLE001 - the summary is written; a plot is a nicety
        print(f"no plots: {e}", file=sys.stderr)
        summary["plots"] = []
    summary["plot"] = summary["plots"][0] if summary["plots"] else None
    return summary


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
