"""``astraflow status``: a running topology at a glance, live or once.

What it shows comes from two places only, so it works from any machine that reaches
Kafka: the ``status`` topic (each component's latest ``ComponentStatus``, read as a
``TopicTable``; rates from each component's last two statuses) and the consumer groups'
committed offsets (lag on every edge: tasks -> RaaS, trajectories -> processors,
batches -> trainer). ``--once --json`` prints one ``snapshot`` for scripts.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from astraflow.metrics import STALENESS_DROPS
from astraflow.wire.records import ComponentStatus


@dataclass
class Rates:
    """Records/s in and out per component, from its last two statuses (plain logic)."""

    last: dict[str, ComponentStatus] = field(default_factory=dict)
    rates: dict[str, tuple[float, float]] = field(default_factory=dict)

    def fold(self, st: ComponentStatus) -> None:
        old = self.last.get(st.component_id)
        self.last[st.component_id] = st
        if old is None or st.at_ms <= old.at_ms or st.started_at_ms != old.started_at_ms:
            return  # first sight, or a restarted component whose counters began again
        dt = (st.at_ms - old.at_ms) / 1000
        self.rates[st.component_id] = ((st.consumed - old.consumed) / dt,
                                       (st.produced - old.produced) / dt)


def component_row(st: ComponentStatus, rates: Rates, now_ms: int) -> dict[str, Any]:
    """One component's line of the snapshot."""
    in_rate, out_rate = rates.rates.get(st.component_id, (None, None))
    spent = st.waiting_s + st.busy_s
    return {
        "component": st.component_id, "kind": st.kind, "state": st.state,
        "policy": st.policy or None, "pool": st.pool or None,
        "versions": dict(st.weight_versions),
        "consumed": st.consumed, "produced": st.produced,
        "dead_lettered": st.dead_lettered,
        "in_per_s": None if in_rate is None else round(in_rate, 2),
        "out_per_s": None if out_rate is None else round(out_rate, 2),
        "waiting_fraction": round(st.waiting_s / spent, 3) if spent > 0 else None,
        "age_s": round(max(0, now_ms - st.at_ms) / 1000, 1),
        "staleness_dropped": {where: int(st.metrics[m]) for where, m in STALENESS_DROPS.items()
                              if m in st.metrics},
    }


def snapshot(topo: Any, statuses: list[ComponentStatus], rates: Rates,
             lags: dict[str, list[Any]], dlq_records: int | None, now_ms: int
             ) -> dict[str, Any]:
    """The whole view as one JSON-able dict (plain logic: the inputs are already read)."""
    comps = [component_row(st, rates, now_ms)
             for st in sorted(statuses, key=lambda s: s.component_id)]
    groups = []
    for component, group, inputs in topo.consumer_groups():
        rows = lags.get(group, [])
        groups.append({
            "component": component, "group": group,
            "topics": [topo.full_name(t) for t in inputs],
            "lag": sum(r.lag for r in rows) if rows else None,
            "partitions": [{"topic": r.topic, "partition": r.partition, "lag": r.lag,
                            "committed": r.committed} for r in rows],
        })
    drops: dict[str, int] = {}
    for c in comps:
        for where, n in c["staleness_dropped"].items():
            drops[where] = drops.get(where, 0) + n
    trainers = {c["policy"]: {"version": c["versions"].get(c["policy"]),
                              "waiting_fraction": c["waiting_fraction"]}
                for c in comps if c["kind"] == "trainer" and c["policy"]}
    return {"run": topo.run, "at_ms": now_ms, "components": comps, "groups": groups,
            "staleness_dropped": drops, "trainers": trainers,
            "dlq": {"records": dlq_records,
                    "by_component": {c["component"]: c["dead_lettered"] for c in comps
                                     if c["dead_lettered"]}}}


class StatusReader:
    """Reads what ``snapshot`` needs from Kafka, incrementally."""

    def __init__(self, topo: Any, config: Any):
        from astraflow.kafka.lag import LagReader
        from astraflow.kafka.offsets import Offsets
        from astraflow.kafka.table import TopicTable

        self.topo, self.config = topo, config
        self.rates = Rates()
        self.table = TopicTable.open(config, topo.full_name("status"), ComponentStatus,
                                     client_id="astraflow-status",
                                     key=lambda e: e.value.component_id if e.value else None)
        self.table.on_change(lambda _k, _old, new: new is not None and self.rates.fold(new))
        self.lags = LagReader(config)
        self.offsets = Offsets(config)

    def read(self, catch_up_s: float = 10.0) -> dict[str, Any]:
        from confluent_kafka import KafkaException

        if not self.table.caught_up():
            self.table.catch_up(catch_up_s)
        else:
            self.table.poll(0.1)
        lags: dict[str, list[Any]] = {}
        for _, group, inputs in self.topo.consumer_groups():
            try:
                lags[group] = self.lags.lag(group, [self.topo.full_name(t) for t in inputs])
            except KafkaException:  # its input topic is missing: no lag to show
                lags[group] = []
        statuses = [v for v in self.table.values() if v is not None]
        return snapshot(self.topo, statuses, self.rates, lags, self._dlq_records(),
                        int(time.time() * 1000))

    def _dlq_records(self) -> int | None:
        """Offsets the dlq holds (its records, plus transaction markers); None: unknown."""
        from confluent_kafka import KafkaException

        try:
            marks = self.offsets.watermarks(self.topo.full_name("dlq"))
        except KafkaException:
            return None
        return sum(high - low for low, high in marks.values())

    def close(self) -> None:
        self.table.close()
        self.lags.close()


def render(snap: dict[str, Any]) -> Any:
    """The snapshot as rich tables (components, then edges)."""
    from rich.console import Group
    from rich.table import Table

    comps = Table(title=f"run {snap['run']}: components", expand=True)
    for col in ("component", "state", "versions", "in/s", "out/s", "dlq", "waiting",
                "stale drops", "age s"):
        comps.add_column(col, justify="left" if col in ("component", "state") else "right")
    for c in snap["components"]:
        comps.add_row(
            c["component"], c["state"],
            " ".join(f"{p} v{v}" for p, v in c["versions"].items()) or "-",
            _num(c["in_per_s"]), _num(c["out_per_s"]), str(c["dead_lettered"]),
            "-" if c["waiting_fraction"] is None else f"{c['waiting_fraction']:.0%}",
            str(sum(c["staleness_dropped"].values())) if c["staleness_dropped"] else "-",
            f"{c['age_s']:.0f}")
    edges = Table(title="lag on every edge", expand=True)
    for col in ("component", "group", "topics", "lag"):
        edges.add_column(col, justify="right" if col == "lag" else "left")
    for g in snap["groups"]:
        edges.add_row(g["component"], g["group"], ", ".join(g["topics"]),
                      "-" if g["lag"] is None else str(g["lag"]))
    drops = ", ".join(f"{k} {v}" for k, v in snap["staleness_dropped"].items()) or "none"
    foot = (f"stale groups dropped: {drops}; dlq records: {snap['dlq']['records']}; trainers: "
            + (", ".join(f"{p} v{t['version']} waiting {_pct(t['waiting_fraction'])}"
                         for p, t in snap["trainers"].items()) or "none"))
    return Group(comps, edges, foot)


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


__all__ = ["Rates", "StatusReader", "component_row", "render", "snapshot"]
