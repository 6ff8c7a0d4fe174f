"""The autoscaler's advice: decision logic and processor, without a broker."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from astraflow.config.topology import parse_topology
from astraflow.dataflow import PROCESSOR_KINDS, Incoming
from astraflow.dataflow.autoscaler import (
    Autoscaler,
    AutoscalerOptions,
    PoolBounds,
    Reading,
    ScalingPolicy,
    Seen,
)
from astraflow.wire.records import ComponentStatus, ScalingAdvice

REPO = Path(__file__).resolve().parents[3]
T0 = 1_700_000_000_000  # ms
STEP_S = 5  # every component reports every 5 s, as status_interval_s does by default


def options(**kw) -> AutoscalerOptions:
    kw.setdefault("pools", {"local": {"min_size": 1, "max_size": 4}})
    return AutoscalerOptions(**kw)


class Cluster:
    """Trainers and RaaS nodes that report status every ``STEP_S`` seconds: each trainer
    waits its ``waits`` share of the time, each node produces 2 and consumes 1 record/s."""

    def __init__(self, policy: ScalingPolicy, nodes: int = 2, pool: str = "local",
                 waits: dict[str, float] | None = None):
        self.policy = policy
        self.t = T0
        self.waits = {"actor": 0.2} if waits is None else waits
        self.waiting = dict.fromkeys(self.waits, 0.0)
        self.nodes: dict[str, str] = {}
        self.counts: dict[str, int] = {}
        self.stopping: set[str] = set()
        for _ in range(nodes):
            self.add_node(pool)

    def add_node(self, pool: str = "local") -> None:
        self.nodes[f"raas.{pool}/{len(self.counts)}"] = pool
        self.counts[f"raas.{pool}/{len(self.counts)}"] = 0

    def remove_node(self, pool: str = "local") -> None:
        del self.nodes[next(c for c, p in reversed(self.nodes.items()) if p == pool)]

    def tick(self) -> list[ScalingAdvice]:
        self.t += STEP_S * 1000
        for policy, w in self.waits.items():
            self.waiting[policy] += w * STEP_S
            self.policy.observe(trainer(policy, self.waiting[policy], self.t))
        for cid, pool in self.nodes.items():
            self.counts[cid] += STEP_S
            self.policy.observe(ComponentStatus(
                component_id=cid, kind="raas", host="h", pool=pool, at_ms=self.t,
                state="stopping" if cid in self.stopping else "running",
                produced=2 * self.counts[cid], consumed=self.counts[cid]))
        return self.policy.decide(self.t)

    def run(self, seconds: int, follow: bool = False) -> list[tuple[int, ScalingAdvice]]:
        """(seconds since T0, advice) over ``seconds``; ``follow``: act on the advice."""
        out = []
        for _ in range(seconds // STEP_S):
            for a in self.tick():
                out.append(((self.t - T0) // 1000, a))
                if follow:
                    for _ in range(a.target_size - a.current_size):
                        self.add_node(a.pool)
                    for _ in range(a.current_size - a.target_size):
                        self.remove_node(a.pool)
        return out


def trainer(policy: str, waiting_s: float, at_ms: int, **kw) -> ComponentStatus:
    return ComponentStatus(component_id=f"trainer.{policy}/0", kind="trainer", host="h",
                           policy=policy, waiting_s=waiting_s, at_ms=at_ms, **kw)


def summary(advice: list[tuple[int, ScalingAdvice]]) -> list[tuple[int, str, int, int]]:
    return [(t, a.branch, a.current_size, a.target_size) for t, a in advice]


# --- the dead band ----------------------------------------------------------------------
def test_a_waiting_trainer_gets_one_node_more():
    advice = Cluster(ScalingPolicy(options()), nodes=2, waits={"actor": 0.2}).run(40)
    # statuses from 5 s on; no advice before they span stale_after_s (30 s)
    assert summary(advice) == [(35, "up", 2, 3)]
    a = advice[0][1]
    assert a.pool == "local" and a.wait_fraction == pytest.approx(0.2)
    assert (a.upper, a.lower) == (0.10, 0.05)
    assert a.produced_rate == pytest.approx(4.0) and a.consumed_rate == pytest.approx(2.0)
    assert a.reason == "pool local: trainer actor waits 20% of the time (> 10%): 2 -> 3 nodes"
    assert a.at_ms == T0 + 35_000


def test_a_busy_trainer_gets_one_node_less():
    advice = Cluster(ScalingPolicy(options()), nodes=3, waits={"actor": 0.01}).run(40)
    assert summary(advice) == [(35, "down", 3, 2)]
    assert advice[0][1].reason == \
        "pool local: trainer actor waits 1% of the time (< 5%): 3 -> 2 nodes"


def test_idle_nodes_get_one_node_less_even_while_the_trainer_waits():
    policy = ScalingPolicy(options())
    for k in range(8):  # every 5 s: the trainer waits half the time, the nodes 95 %
        t = T0 + 5000 * k
        policy.observe(trainer("actor", 2.5 * k, t))
        for cid in ("raas.local/0", "raas.local/1"):
            policy.observe(ComponentStatus(component_id=cid, kind="raas", host="h",
                                           pool="local", at_ms=t, waiting_s=4.75 * k))
    advice = policy.decide(T0 + 35_000)
    assert [(a.branch, a.current_size, a.target_size) for a in advice] == [("idle", 2, 1)]
    assert advice[0].reason == ("pool local: its nodes wait for tasks 95% of the time "
                                "(> 90%): 2 -> 1 nodes")


def test_inside_the_band_nothing_is_advised():
    assert Cluster(ScalingPolicy(options()), nodes=2, waits={"actor": 0.07}).run(600) == []


def node(cid: str = "raas.local/0", pool: str = "local") -> Seen:
    return Seen(ComponentStatus(component_id=cid, kind="raas", host="h", pool=pool))


def test_the_band_edges_hold():
    policy = ScalingPolicy(options())
    two = [node("a"), node("b")]

    def advise(wait: float) -> ScalingAdvice | None:
        return policy.advise("local", PoolBounds(min_size=1, max_size=4),
                             Reading(two, "actor", wait), T0)

    assert advise(0.10) is None and advise(0.05) is None  # on an edge: not beyond it
    assert (advise(0.1001).branch, advise(0.1001).target_size) == ("up", 3)
    assert (advise(0.0499).branch, advise(0.0499).target_size) == ("down", 1)


def test_the_band_is_configurable():
    wide = Cluster(ScalingPolicy(options(upper=0.3, lower=0.02)), nodes=2,
                   waits={"actor": 0.2})
    assert wide.run(300) == []
    narrow = options(upper=0.15, lower=0.1)
    assert Cluster(ScalingPolicy(narrow), nodes=2, waits={"actor": 0.12}).run(300) == []
    low = Cluster(ScalingPolicy(narrow), nodes=2, waits={"actor": 0.08})
    assert summary(low.run(40)) == [(35, "down", 2, 1)]
    assert low.policy.readings["local"].wait == pytest.approx(0.08)


# --- bounds, cooldown, liveness ---------------------------------------------------------
def test_advice_stays_within_min_and_max():
    assert Cluster(ScalingPolicy(options()), nodes=4, waits={"actor": 0.5}).run(300) == []
    assert Cluster(ScalingPolicy(options()), nodes=1, waits={"actor": 0.0}).run(300) == []
    zero = options(pools={"local": {"min_size": 0, "max_size": 2}})
    gone = Cluster(ScalingPolicy(zero), nodes=1, waits={"actor": 0.0}).run(40)
    assert summary(gone) == [(35, "down", 1, 0)]


def test_a_pool_outside_its_bounds_is_clamped_whatever_the_wait():
    big = Cluster(ScalingPolicy(options()), nodes=6, waits={"actor": 0.07}).run(40)
    assert summary(big) == [(35, "clamp", 6, 4)]
    assert big[0][1].reason == "pool local: 6 nodes, above max_size 4: 6 -> 4 nodes"
    empty = Cluster(ScalingPolicy(options()), nodes=0, waits={"actor": 0.0}).run(40)
    assert summary(empty) == [(35, "clamp", 0, 1)]
    assert empty[0][1].reason == "pool local: 0 nodes, below min_size 1: 0 -> 1 nodes"
    # below min_size while starving: straight to min_size, not one more
    two = options(pools={"local": {"min_size": 3, "max_size": 5}})
    assert summary(Cluster(ScalingPolicy(two), nodes=1).run(40)) == [(35, "clamp", 1, 3)]


def test_cooldown_spaces_the_advice_of_a_pool():
    unheeded = Cluster(ScalingPolicy(options()), nodes=2, waits={"actor": 0.2}).run(200)
    # the node was not started: the same advice again once the cooldown is over
    assert summary(unheeded) == [(35, "up", 2, 3), (95, "up", 2, 3), (155, "up", 2, 3)]
    heeded = Cluster(ScalingPolicy(options(cooldown_s=20)), nodes=2, waits={"actor": 0.2})
    assert summary(heeded.run(300, follow=True)) == [(35, "up", 2, 3), (55, "up", 3, 4)]
    assert len(heeded.nodes) == 4  # max_size: no more advice


def test_each_pool_is_sized_on_its_own():
    opts = options(pools={"a": {"min_size": 1, "max_size": 3},
                          "b": {"min_size": 2, "max_size": 2}})
    cluster = Cluster(ScalingPolicy(opts), nodes=1, pool="a", waits={"actor": 0.2})
    cluster.add_node("b")
    cluster.add_node("b")
    cluster.add_node("c")  # a pool the autoscaler does not size
    advice = cluster.run(40)
    assert [(a.pool, a.branch, a.current_size, a.target_size) for _, a in advice] == \
        [("a", "up", 1, 2)]


def test_silent_and_stopping_nodes_are_not_counted():
    cluster = Cluster(ScalingPolicy(options(cooldown_s=0)), nodes=3, waits={"actor": 0.07})
    assert cluster.run(60) == []
    cluster.remove_node()  # stops reporting: counted until its last status is 30 s old
    advice = cluster.run(60)
    assert advice == [] and len(cluster.policy.readings["local"].nodes) == 2
    assert "raas.local/2" not in cluster.policy.seen  # forgotten
    cluster.stopping.add("raas.local/1")
    cluster.run(5)
    assert [s.status.component_id for s in cluster.policy.readings["local"].nodes] == \
        ["raas.local/0"]


def test_no_live_trainer_no_advice():
    opts = options()
    nodes_only = Cluster(ScalingPolicy(opts), nodes=6, waits={})
    assert nodes_only.run(300) == []  # even outside max_size: nothing to judge by
    cluster = Cluster(ScalingPolicy(options(cooldown_s=0)), nodes=6, waits={"actor": 0.07})
    assert summary(cluster.run(35)) == [(35, "clamp", 6, 4)]  # cooldown 0: every 5 s
    cluster.waits = {}  # the trainer is gone
    cluster.waiting = {}
    late = cluster.run(300)
    # clamps while its last status (35 s) is at most 30 s old, then silence
    assert [t for t, _ in late] == [40, 45, 50, 55, 60, 65]
    assert "local" not in cluster.policy.readings


def test_no_advice_until_statuses_span_stale_after_s():
    policy = ScalingPolicy(options(stale_after_s=20))
    cluster = Cluster(policy, nodes=2, waits={"actor": 0.5})
    assert cluster.run(20) == []  # statuses from 5 s to 20 s: 15 s
    assert summary(cluster.run(5)) == [(25, "up", 2, 3)]


# --- the waiting fraction ---------------------------------------------------------------
def test_the_waiting_fraction_is_over_the_window_not_the_run():
    full = options(pools={"local": {"min_size": 1, "max_size": 3}}, window_s=60)
    cluster = Cluster(ScalingPolicy(full), nodes=3, waits={"actor": 0.5})
    assert cluster.run(600) == []  # starved, but no room to grow
    cluster.waits["actor"] = 0.0
    advice = cluster.run(60)
    # over the last minute it waited 2.5 s at 655 s (5 s at 650 s: 8 %); since the start,
    # 300 s of 655 s
    assert summary(advice) == [(655, "down", 3, 2)]
    assert advice[0][1].wait_fraction == pytest.approx(2.5 / 60)


def test_a_single_status_is_judged_by_the_trainers_own_figure():
    policy = ScalingPolicy(options(stale_after_s=30))
    for t in (0, 10_000, 20_000, 30_000):  # a node that reports, a trainer seen once
        policy.observe(ComponentStatus(component_id="n/0", kind="raas", host="h",
                                       pool="local", at_ms=T0 + t))
    policy.observe(trainer("actor", 0.0, T0 + 30_000, metrics={"trainer/wait_fraction": 0.4}))
    assert [(a.branch, a.wait_fraction) for a in policy.decide(T0 + 30_000)] == [("up", 0.4)]
    silent = ScalingPolicy(options())
    silent.observe(trainer("actor", 0.0, T0))
    silent.observe(trainer("actor", 0.0, T0 + 40_000, started_at_ms=1))  # restarted
    assert silent.decide(T0 + 40_000) == []  # one status of the new life, no figure


def test_a_restarted_trainer_starts_its_window_again():
    policy = ScalingPolicy(options())
    policy.observe(trainer("actor", 100.0, T0, started_at_ms=1))
    policy.observe(trainer("actor", 105.0, T0 + 10_000, started_at_ms=1))
    policy.observe(trainer("actor", 0.0, T0 + 20_000, started_at_ms=2))
    policy.observe(trainer("actor", 1.0, T0 + 30_000, started_at_ms=2))
    seen = policy.seen["trainer.actor/0"]
    assert len(seen.samples) == 2 and policy.read("local", policy.options.pools["local"],
                                                   T0 + 30_000).wait == pytest.approx(0.1)
    policy.observe(trainer("actor", 0.5, T0 + 25_000, started_at_ms=2))  # older: ignored
    assert seen.samples[-1].at_ms == T0 + 30_000


def test_the_trainer_that_waits_most_drives_unless_the_pool_names_its_own():
    waits = {"solver": 0.2, "verifier": 0.0}
    advice = Cluster(ScalingPolicy(options()), nodes=2, waits=waits).run(40)
    assert summary(advice) == [(35, "up", 2, 3)] and "trainer solver" in advice[0][1].reason
    own = options(pools={"local": {"min_size": 1, "max_size": 4, "policies": ["verifier"]}})
    assert summary(Cluster(ScalingPolicy(own), nodes=2, waits=waits).run(40)) == \
        [(35, "down", 2, 1)]
    shared = options(policies=["verifier"])
    assert summary(Cluster(ScalingPolicy(shared), nodes=2, waits=waits).run(40)) == \
        [(35, "down", 2, 1)]
    none = options(policies=["critic"])
    assert Cluster(ScalingPolicy(none), nodes=2, waits=waits).run(100) == []


# --- options ----------------------------------------------------------------------------
@pytest.mark.parametrize("bad, message", [
    ({"lower": 0.1, "upper": 0.1}, "lower (0.1) must be below upper (0.1)"),
    ({"lower": 0.2}, "lower (0.2) must be below upper (0.1)"),
    ({"pools": {"local": {"min_size": 5, "max_size": 4}}}, "min_size 5 is above max_size 4"),
    ({"pools": {"local": {"min_size": 1}}}, "max_size"),
    ({"pools": {}}, "pools"),
    ({"upper": 1.5}, "upper"),
    ({"cooldown": 5}, "cooldown"),
])
def test_bad_options_are_refused_with_the_reason(bad, message):
    with pytest.raises(ValidationError) as e:
        options(**bad)
    assert message in str(e.value)


def test_the_topology_names_the_option_at_fault():
    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data["processors"]["autoscaler"] = {
        "kind": "autoscaler", "inputs": ["status"], "outputs": ["scaling"],
        "options": {"pools": {"local": {"max_size": 2}}, "lower": 0.3}}
    with pytest.raises(ValueError, match="processors.autoscaler.options: lower"):
        parse_topology(data)


def commented_example() -> dict:
    """The ``autoscaler:`` entry commented out in topology/default.yaml, as YAML."""
    lines = (REPO / "topology" / "default.yaml").read_text().splitlines()
    start = lines.index("  # autoscaler:")
    block = []
    for line in lines[start:]:
        if not line.startswith("  # ") or (block and not line.startswith("  #   ")):
            break
        block.append("  " + line[4:])
    return yaml.safe_load("\n".join(block))


def test_the_example_in_the_default_topology_is_valid():
    example = commented_example()
    assert example["autoscaler"]["kind"] == "autoscaler"
    data = yaml.safe_load((REPO / "topology" / "default.yaml").read_text())
    data["processors"].update(example)
    topo = parse_topology(data)
    spec = topo.processors["autoscaler"]
    assert topo.topic("status").schema_type is ComponentStatus
    assert topo.topic("scaling").schema_type is ScalingAdvice
    opts = AutoscalerOptions(**spec.options)
    assert opts.pools["local"].max_size == 4 and set(opts.pools) <= set(topo.pools)


# --- the processor ----------------------------------------------------------------------
def status_msg(status: ComponentStatus, offset: int) -> Incoming:
    return Incoming("status", 0, offset, status.component_id.encode(), status,
                    timestamp_ms=status.at_ms)


def test_the_processor_writes_advice_to_scaling_keyed_by_pool():
    assert PROCESSOR_KINDS["autoscaler"] is Autoscaler
    assert Autoscaler.Options.model_config.get("extra") == "forbid" and Autoscaler.__doc__
    p = Autoscaler("autoscaler", ["status"], ["scaling"], options())
    offset = 0
    out = []
    for step in range(1, 8):
        t = T0 + step * 5000
        for s in (trainer("actor", 0.3 * 5 * step, t),
                  ComponentStatus(component_id="raas.local/0", kind="raas", host="h",
                                  pool="local", at_ms=t, produced=10 * step),
                  ComponentStatus(component_id="autoscaler/x", kind="processor", host="h",
                                  at_ms=t)):
            assert list(p.process(status_msg(s, offset))) == []
            offset += 1
        out += list(p.flush(t))
    assert [(o.topic, o.key, o.partition) for o in out] == [("scaling", "local", None)]
    a = out[0].record
    assert isinstance(a, ScalingAdvice)
    assert (a.branch, a.current_size, a.target_size) == ("up", 1, 2)
    assert a.produced_rate == pytest.approx(2.0) and a.at_ms == T0 + 35_000
    assert "autoscaler/x" not in p.policy.seen  # processors are not what it sizes
    m = p.metrics()
    assert m["autoscaler/advice_up"] == 1 and m["autoscaler/advice_down"] == 0
    assert m["autoscaler/advice_clamp"] == 0
    assert m["autoscaler/wait_fraction"] == pytest.approx(0.3)
    assert m["autoscaler/nodes/local"] == 1
    assert list(p.flush(T0 + 40_000)) == []  # cooldown


def test_the_processor_takes_the_kafka_timestamp_when_a_status_has_none():
    p = Autoscaler("autoscaler", ["status"], ["scaling"], options())
    s = trainer("actor", 1.0, 0)
    p.process(Incoming("status", 0, 0, None, s, timestamp_ms=T0))
    assert p.policy.seen["trainer.actor/0"].at_ms == T0
    p.process(Incoming("status", 0, 1, None, trainer("verifier", 1.0, 0), timestamp_ms=0))
    assert "trainer.verifier/0" not in p.policy.seen  # no time at all: cannot be judged
    with pytest.raises(ValueError, match="exactly one topic"):
        Autoscaler("autoscaler", ["status"], [], options())
    assert p.metrics() == {"autoscaler/advice_up": 0.0, "autoscaler/advice_down": 0.0,
                           "autoscaler/advice_idle": 0.0,
                           "autoscaler/advice_clamp": 0.0}
