"""What ``astraflow up`` shows and keeps of a run: ``Progress`` folded from the ``status``
topic into its live line, TensorBoard (and W&B) series per component, the closing lines and
``runs/<run>/summary.json``."""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from astraflow.config.topology import Topology
from astraflow.metrics import STALENESS_DROPS


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


def status_table(config, topic: str, progress: Progress, series: StatusSeries | None = None,
                 timeout_s: float = 10.0):
    """The ``status`` topic from its end on, as a table by component; every new status is
    folded into ``progress`` (and ``series``). ``timeout_s``: how long Kafka may take to
    answer while it is opened (``KafkaException`` after that)."""
    from astraflow.kafka.table import TopicTable
    from astraflow.wire.records import ComponentStatus

    table = TopicTable.open(config, topic, ComponentStatus, start="end", client_id="up",
                            key=lambda e: e.value.component_id if e.value else None,
                            metadata_timeout_s=timeout_s)
    def changed(_k, _old, new) -> None:
        if new is not None:
            progress.fold(new)
            if series is not None:
                series.add(new)

    table.on_change(changed)
    return table


def write_summary(run_dir: Path, topo: Topology, progress: Progress,
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
