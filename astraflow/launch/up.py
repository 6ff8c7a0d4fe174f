"""``astraflow up`` / ``astraflow down``: run a whole topology as local processes.

``up`` starts the embedded broker if needed, applies the topics, writes missing tiny
models, then starts one process per component (trainer per policy, every processor, the
RaaS nodes of every pool, the feeder and the evaluator), each an ordinary ``astraflow``
subcommand with its log under ``runs/<run>/logs/``. It prints live progress read from the
``status`` topic and, when it ends (``--duration``, ``--versions`` or Ctrl-C), stops the
processes and writes ``runs/<run>/summary.json`` and ``summary.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config.topology import ChatSpec, DatasetSpec, FeederSpec, PolicySpec, Topology
from astraflow.metrics import STALENESS_DROPS

_UP_EXAMPLES = [
    "astraflow run up -t topology/default.yaml",
    "astraflow run up -t topology/default.yaml --duration 0        # until Ctrl-C",
    "astraflow run up -t topology/default.yaml --run trial2 --fresh",
    "astraflow up topology/default.yaml --versions 20             # the shortcut",
    "astraflow up topology/default.yaml --secure     # SASL_SSL, one principal per component",
    "astraflow up topology/default.yaml --brokers 3  # on a 3-node cluster, replication 3",
]
_DOWN_EXAMPLES = ["astraflow run down -t topology/default.yaml",
                  "astraflow down topology/default.yaml   # the shortcut"]


def register(subparsers: Any) -> None:
    """Add ``run up|down`` and their shortcuts ``up`` and ``down`` to ``subparsers``."""
    from astraflow.cli.args import add_group

    verbs = add_group(subparsers, "run", help="a whole run as local processes: up, down",
                      dest="run_command", examples=[*_UP_EXAMPLES[:1], *_DOWN_EXAMPLES[:1]])
    for where, shortcut in ((verbs, False), (subparsers, True)):  # `astraflow up`: shortcut
        _add_up(where, shortcut)
        _add_down(where, shortcut)


def _add_up(subparsers: Any, shortcut: bool) -> None:
    from astraflow.cli.args import add_cluster_options, add_command, add_run_options

    p = add_command(
        subparsers, "up", help="shortcut of `run up`" if shortcut else
        "run a whole topology locally, with live progress",
        description="Start the embedded broker if needed, apply the topics, write missing "
        "tiny models, then run every component of the topology as its own process (logs "
        "under RUNS_DIR/<run>/logs) until --duration or --versions; print progress, then "
        "stop them and write the run's summary.json.",
        examples=_UP_EXAMPLES)
    add_run_options(p, positional=True)
    p.add_argument("--runs-dir", default="runs", help="where logs and summaries go")
    p.add_argument("--duration", type=float, default=600.0, help="seconds to run (0: forever)")
    p.add_argument("--versions", type=int, default=0, help="stop after this many versions")
    p.add_argument("--fresh", action="store_true",
                   help="start from version 0: under the next free name RUN-N if RUN already "
                   "has topics (they stay; `astraflow run delete RUN` removes them)")
    p.add_argument("--keep-broker", action="store_true",
                   help="leave the embedded broker running when the run ends (default: stop "
                   "it if this `up` started it)")
    add_cluster_options(p, "run on the embedded cluster (`broker start --brokers N`), "
                        "started if needed and stopped at the end if started here")
    p.add_argument("--secure", action="store_true",
                   help="run on the secured embedded broker (SASL_SSL, ACLs enforced), each "
                   "component as its own principal with exactly the ACLs `topology acls` "
                   "prints, weights signed and verified (docs/security.md)")
    p.set_defaults(func=cmd_up)


def _add_down(subparsers: Any, shortcut: bool) -> None:
    from astraflow.cli.args import add_command, add_run_options

    d = add_command(subparsers, "down", help="shortcut of `run down`" if shortcut else
                    "stop what `astraflow up` started",
                    examples=_DOWN_EXAMPLES)
    add_run_options(d, positional=True, bootstrap=False)
    d.add_argument("--runs-dir", default="runs", help="where `up` wrote the run's process ids")
    d.set_defaults(func=cmd_down)


def _astraflow(*args: str) -> list[str]:
    return [sys.executable, "-m", "astraflow.cli.main", *args]


def plan_processes(topo: Topology, path: str) -> dict[str, list[str]]:
    """Name -> command line of every process `up` starts for ``topo``."""
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
        procs["feeder"] = _astraflow("feeder", "run", "--topology", path,
                                     *_feeder_args(topo.feeder))
    if topo.eval is not None:
        for policy in topo.policies:
            procs[f"eval-{policy}"] = _astraflow(*eval_args(topo, path, policy))
    return procs


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _optional_flags(spec: Any, names: Iterable[str]) -> list[str]:
    """``--name value`` for each of ``names`` that ``spec`` sets (not None); a true bool
    is the bare flag, a false one nothing."""
    out: list[str] = []
    for name in names:
        value = getattr(spec, name)
        if value is None or value is False:
            continue
        out += [_flag(name)] if value is True else [_flag(name), str(value)]
    return out


# TrainerSpec fields passed as they are (lr and anchor_interval always; the bools that
# turn something off have their own --no- flags)
TRAINER_OPTIONAL = ("state_interval", "state_max_lag", "keep_optimizer", "keep_versions",
                    "seed", "weight_decay", "adam_beta1", "adam_beta2", "adam_eps",
                    "max_grad_norm", "clip_low", "clip_high", "tis_cap", "tis_mask",
                    "m2_threshold", "loss", "minibatches", "micro_batch_size",
                    "micro_batch_tokens", "autocast",
                    "gradient_checkpointing", "forward_on", "dtype", "publish_dtype", "device",
                    "backend", "threads", "deterministic", "max_steps", "blob_store",
                    "state_dir")


def trainer_args(topo: Topology, path: str, policy: str) -> list[str]:
    """The ``astraflow`` arguments of ``policy``'s trainer (``trainer run``)."""
    spec = topo.policies[policy]
    t = spec.trainer
    args = ["trainer", "run", "--topology", path, "--policy", policy, "--model", spec.model,
            "--lr", str(t.lr), "--anchor-interval", str(t.anchor_interval),
            "--temperature", str(spec.temperature), "--top-p", str(spec.top_p),
            "--max-staleness", str(spec.max_staleness)]
    args += _optional_flags(t, TRAINER_OPTIONAL)
    if not t.std_normalize:
        args.append("--no-std-normalize")
    if not t.share_prompt:
        args.append("--no-share-prompt")
    return args


def _raas_args(topo: Topology, path: str, pool: str, index: int) -> list[str]:
    spec = topo.pools[pool]
    args = ["raas", "run", "--topology", path, "--pool", pool, "--instance",
            f"{pool}-{index}", "--n-samples", str(spec.n_samples)]
    for policy, p in topo.policies.items():
        args += ["--policy-model", f"{policy}={p.model}"]
        if p.chat != ChatSpec():
            args += ["--chat", f"{policy}={json.dumps(p.chat.model_dump())}"]
    if spec.engine != "torch":
        args += ["--engine", spec.engine]
    if spec.engine_options:
        args += ["--engine-options", json.dumps(spec.engine_settings().given())]
    dtypes = {p.dtype for p in topo.policies.values() if p.dtype}
    if len(dtypes) == 1:
        args += ["--dtype", dtypes.pop()]
    if spec.tasks_per_transaction != 1:
        args += ["--tasks-per-transaction", str(spec.tasks_per_transaction)]
    sampling = _shared_sampling(topo)
    for name, typed in spec.workflows.items():
        # the policies' temperature and top-p unless the workflow sets its own
        options = {**sampling, **typed.given()}
        args += ["--workflow-options", f"{name}={json.dumps(options)}"]
    args += _optional_flags(spec, ("device", "prefix_cache_mib", "session_timeout_ms",
                                   "speed", "rack"))
    return args + ([] if spec.follow_weights else ["--no-follow-weights"])


def _shared_sampling(topo: Topology) -> dict[str, float]:
    """The policies' ``temperature`` and ``top_p`` where they all share one (top-p only
    when it truncates: 1.0 is every workflow's default)."""
    out: dict[str, float] = {}
    temperatures = {p.temperature for p in topo.policies.values()}
    if len(temperatures) == 1:
        out["temperature"] = temperatures.pop()
    top_ps = {p.top_p for p in topo.policies.values()}
    if len(top_ps) == 1 and (top_p := top_ps.pop()) < 1:
        out["top_p"] = top_p
    return out


def _dataset_args(d: DatasetSpec) -> list[str]:
    args = ["--dataset", d.path]
    for name in ("prompt_field", "answer_field", "messages_field"):
        value = getattr(d, name)
        if value:
            args += ["--" + name.replace("_", "-"), value]
    return args


def _feeder_args(feeder: FeederSpec) -> list[str]:
    args = _dataset_args(feeder.dataset) if feeder.dataset else []
    args += _optional_flags(feeder, ("rate", "epochs", "levels", "seed", "count", "size",
                                     "split", "task_family", "workflow"))
    for policy in feeder.policies or []:
        args += ["--policy", policy]
    return args + (["--from-start"] if feeder.from_start else [])


def eval_args(topo: Topology, path: str, policy: str) -> list[str]:
    spec, ev = topo.policies[policy], topo.eval
    assert ev is not None
    own = spec.eval

    def pick(name: str) -> Any:  # the policy's own value, else the topology's
        value = getattr(own, name)
        return getattr(ev, name) if value is None else value

    args = ["eval", "run", "--topology", path, "--policy", policy, "--model", spec.model,
            "--every", str(pick("every_versions")), "--size", str(pick("size")),
            "--max-new-tokens", str(pick("max_new_tokens"))]
    if spec.role != "solver":
        args += ["--role", spec.role]
    if ev.dataset:
        args += _dataset_args(ev.dataset)
    if ev.reward is not None:
        args += ["--reward", ev.reward if isinstance(ev.reward, str) else json.dumps(ev.reward)]
    if spec.chat != ChatSpec():
        args += ["--chat", json.dumps(spec.chat.model_dump())]
    if spec.dtype:
        args += ["--dtype", spec.dtype]
    if pick("levels") is not None:
        args += ["--levels", pick("levels")]
    return args + [flag for flag, on in (("--blind", own.blind),
                                         ("--agreement", own.agreement),
                                         ("--corrective", own.corrective)) if on]


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


def cmd_up(args: argparse.Namespace) -> int:
    """``astraflow up``: one run at a time (a lock in its run directory)."""
    from astraflow.launch.supervisor import RunLocked, run_lock

    topo: Topology = args.loaded_topology
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


def _up(args: argparse.Namespace, topo: Topology, run_dir: Path) -> int:
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
        fresh = _write_tiny_models(topo) or args.fresh
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


def _embedded_broker(args: argparse.Namespace, topo: Topology, secure: bool):
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


def _embedded_cluster(args: argparse.Namespace, topo: Topology, secure: bool):
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


def _watch(args: argparse.Namespace, topo: Topology, config, sup, progress: Progress,
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


def _write_tiny_models(topo: Topology) -> bool:
    """Write the tiny model of every policy that lacks one or whose recipe the topology
    changed (``_model_init_command``: ``model init`` or ``model init-role``, one at a
    time); True if any was written. MissingModel for a missing model that ``up`` may not
    write (``init_tiny: false``)."""
    wrote = False
    for policy, spec in topo.policies.items():
        wrote = write_policy_model(policy, spec) or wrote
    return wrote


def write_policy_model(policy: str, spec) -> bool:
    """Write (or import) the model of one policy as its topology entry says, unless it is
    there and up to date; True if it was written."""
    if spec.import_from:
        return _import_model(policy, spec)
    stale = _tiny_model_outdated(spec)
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


# WarmStartSpec fields after steps and slip, as `model init`/`init-role` flags
WARM_START_OPTIONAL = ("seed", "levels", "lr", "batch_size", "train_size", "eval_size",
                       "size", "retry_share", "retry_slip", "label_noise", "blind")


def _model_init_command(spec: PolicySpec) -> list[str]:
    """The ``astraflow`` arguments that write the tiny model of ``spec``: ``model init``
    (the solver's answer format) or, for a verifier/selector, ``model init-role``.

    ``--carry-slip`` is always passed: the topology's ``warm_start.slip`` (default 0)
    decides, not the command's own default (``init-role``'s is 0.5).
    """
    ws = spec.warm_start
    common = ["--warm-start-steps", str(ws.steps), "--carry-slip", str(ws.slip)]
    if ws.until is not None:
        common += ["--warm-start-until", str(ws.until)]
    common += _optional_flags(ws, WARM_START_OPTIONAL)
    if spec.role != "solver":
        return ["model", "init-role", spec.model, "--role", spec.role, *common]
    return ["model", "init", spec.model, *common]


def _tiny_model_outdated(spec) -> str:
    """Why the tiny model at ``spec.model`` must be rewritten ("" when it need not be).

    Only a model that ``astraflow model init`` or ``model init-role`` wrote (both leave
    their recipe file) and whose recipe differs from what the topology asks for -- the
    command included, so a solver model becomes a verifier's and back -- is rewritten;
    any other model is left alone.
    """
    from astraflow.cli.main import build_parser
    from astraflow.models.recipe import INIT_RECIPE, OLD_ROLE_RECIPE, init_recipe

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
    want = init_recipe(build_parser().parse_args(command))
    # an option added after the model was written counts as its default
    defaults = init_recipe(build_parser().parse_args(
        [*command[:3], *(["--role", spec.role] if spec.role != "solver" else [])]))
    diff = [f"{k} {recipe.get(k, defaults.get(k))} -> {v}" for k, v in want.items()
            if recipe.get(k, defaults.get(k)) != v]
    return "the topology changed how it is made (" + ", ".join(diff) + ")" if diff else ""


def fresh_run(topo: Topology, config, runs_dir: Path) -> Topology:
    """``topo`` as a run that starts from version 0: under its own name if the cluster has
    no run of that name, else under the next free ``<run>-N`` (the older run's topics stay
    for replay; only ``astraflow run delete`` removes a run). The new name is recorded in
    ``RUNS_DIR/<run>/latest-run`` for ``astraflow down``."""
    from astraflow.cli.main import with_overrides
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


def cmd_down(args: argparse.Namespace) -> int:
    topo: Topology = args.loaded_topology
    pids_file = _pids_file(topo, args.runs_dir)
    latest = Path(args.runs_dir) / topo.run / "latest-run"
    if not pids_file.exists() and latest.exists():  # `up --fresh` started a new run name
        pids_file = Path(args.runs_dir) / latest.read_text().strip() / "pids.json"
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
