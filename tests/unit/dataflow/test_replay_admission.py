"""Replay at batch serving and admission decisions: decision logic without a broker."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from astraflow.config.topology import TopologyError, load_topology, parse_topology
from astraflow.dataflow import PROCESSOR_KINDS, Incoming
from astraflow.dataflow.admission import (
    Admission,
    AdmissionOptions,
    AdmissionPolicy,
    Observation,
    pool_bounds,
    task_groups,
    trainer_batches,
    trainer_bounds,
    transit_inputs,
)
from astraflow.dataflow.batcher import Batcher, BatcherOptions, ReplayBuffer
from astraflow.dataflow.versions import StaticVersions
from astraflow.wire.records import Batch, Task
from tests.unit.dataflow.test_processors import group, seq

REPO = Path(__file__).resolve().parents[3]


def fresh(i: int, version: int = 0, rewards: tuple[float, ...] = (1.0, 0.0)):
    g = group(f"g{i}", *(seq("actor", [-1, version], r) for r in rewards))
    return Incoming("samples.actor", 0, i, g.group_id.encode(), g)


def batcher(versions: StaticVersions | None = None, **options) -> Batcher:
    return Batcher("b", ["samples.actor"], ["batches.actor"], BatcherOptions(**options),
                   versions=versions)


def feed(b: Batcher, items) -> list[Batch]:
    out = []
    for m in items:
        b.process(m)
        out += [o.record for o in b.flush(0)]
    return out


# --- replay -----------------------------------------------------------------------------
def test_replay_off_by_default_keeps_plain_batches():
    b = batcher(batch_size=4)
    batches = feed(b, [fresh(i) for i in range(12)])
    assert [len(x.groups) for x in batches] == [4, 4, 4]
    assert all(x.replayed == 0 for x in batches)
    assert "batcher/replayed" not in b.metrics()


def test_replay_ratio_bounds_replayed_groups_per_batch():
    b = batcher(batch_size=8, replay_ratio=0.25, replay_seed=1)
    batches = feed(b, [fresh(i) for i in range(8 + 6 * 5)])
    # first batch: empty buffer, all fresh; then 6 fresh + 2 replayed each
    assert [(len(x.groups), x.replayed) for x in batches] == [(8, 0)] + [(8, 2)] * 5
    for x in batches:
        fresh_ids = [g.group_id for g in x.groups[: len(x.groups) - x.replayed]]
        replay_ids = [g.group_id for g in x.groups[len(x.groups) - x.replayed:]]
        assert not set(fresh_ids) & set(replay_ids)
        assert all(g.meta.get("replay_uses") for g in x.groups[len(x.groups) - x.replayed:])
        assert all("replay_uses" not in g.meta for g in x.groups[: len(x.groups) - x.replayed])
        # replayed groups were committed already: source offsets cover the fresh ones only
        assert sum(r.end - r.start for r in x.source_offsets) == len(fresh_ids)
    every_fresh = Counter(g.group_id for x in batches for g in x.groups[: len(x.groups) -
                                                                         x.replayed])
    assert every_fresh == Counter(f"g{i}" for i in range(38))  # each fresh group served once
    m = b.metrics()
    assert m["batcher/replayed"] == 10 and m["batcher/batches"] == 6


def test_replay_ratio_rounds_down_and_never_fills_a_whole_batch():
    assert batcher(batch_size=8, replay_ratio=0.3).replay_quota == 2
    assert batcher(batch_size=2, replay_ratio=0.25).replay_quota == 0
    assert batcher(batch_size=4, replay_ratio=0.99).replay_quota == 3
    with pytest.raises(ValueError):
        BatcherOptions(replay_ratio=1.0)


def test_replay_buffer_capacity_drops_the_oldest():
    buf = ReplayBuffer(capacity=3, selection="recent")
    buf.add(fresh(i).record for i in range(5))
    assert len(buf) == 3 and buf.evicted_full == 2
    assert {e.group.group_id for e in buf.entries} == {"g2", "g3", "g4"}
    b = batcher(batch_size=4, replay_ratio=0.5, replay_capacity=5)
    feed(b, [fresh(i) for i in range(40)])
    assert len(b.replay) == 5 and b.metrics()["batcher/replay_buffer"] == 5


def test_selection_rules():
    groups = [
        group("low", seq("actor", [-1, 0], 0.0), seq("actor", [-1, 0], 0.0)),
        group("high", seq("actor", [-1, 0], 1.0), seq("actor", [-1, 0], 1.0)),
        group("mixed", seq("actor", [-1, 0], 1.0), seq("actor", [-1, 0], 0.0)),
        group("mid", seq("actor", [-1, 0], 0.5), seq("actor", [-1, 0], 0.6)),
    ]

    def pick(selection, n, **kw):
        buf = ReplayBuffer(10, selection, **kw)
        buf.add(groups)
        return [g.group_id for g in buf.select(n)]

    assert pick("recent", 2) == ["mid", "mixed"]
    assert pick("high_reward", 2) == ["high", "mid"]
    assert pick("max_variance", 1) == ["mixed"]
    uniform = Counter(gid for seed in range(200) for gid in pick("uniform", 1, seed=seed))
    assert set(uniform) == {"low", "high", "mixed", "mid"}  # every group can come up
    assert min(uniform.values()) > 20
    assert len(set(pick("uniform", 4, seed=3))) == 4  # without replacement


def test_replay_max_uses():
    buf = ReplayBuffer(10, "recent", max_uses=2)
    buf.add([fresh(0).record])
    assert [g.meta["replay_uses"] for g in buf.select(1) + buf.select(1)] == ["1", "2"]
    assert buf.select(1) == [] and len(buf) == 0


def test_stale_groups_are_evicted_from_replay_and_never_served():
    versions = StaticVersions({"actor": 0})
    b = batcher(versions, batch_size=4, replay_ratio=0.5, max_staleness=1)
    batches = feed(b, [fresh(i, version=0) for i in range(4)])
    assert len(batches) == 1 and len(b.replay) == 4
    versions.versions["actor"] = 1  # v0 groups are 1 behind: still replayable
    batches = feed(b, [fresh(i, version=1) for i in range(4, 6)])
    assert len(batches) == 1 and batches[0].replayed == 2
    versions.versions["actor"] = 2  # v0 groups are now 2 behind: evicted, never replayed
    batches = feed(b, [fresh(i, version=2) for i in range(6, 10)])
    assert b.metrics()["batcher/replay_evicted_stale"] == 4
    for x in batches:
        for g in x.groups[len(x.groups) - x.replayed:]:
            assert min(s.min_version for s in g.sequences) >= 1
    # nothing left but v1/v2 groups, and those stay within the bound
    assert all(e.group.sequences[0].min_version >= 1 for e in b.replay.entries)
    versions.versions["actor"] = 10
    assert feed(b, [fresh(10, version=10)]) == []
    assert len(b.replay) == 0  # everything is now too old


def test_replay_without_a_full_buffer_fills_with_fresh_groups():
    b = batcher(batch_size=4, replay_ratio=0.75, replay_selection="recent")
    batches = feed(b, [fresh(i) for i in range(6)])
    # 4 fresh first; then the quota is 3 with 4 buffered: 1 fresh + 3 replayed
    assert [(len(x.groups), x.replayed) for x in batches[:2]] == [(4, 0), (4, 3)]


# --- admission decisions ----------------------------------------------------------------
def test_admission_admits_up_to_the_pool_bound():
    policy = AdmissionPolicy({"local": 6}, {"actor": 4})
    d = policy.decide({"local": {0: 1, 1: 0, 2: 1}}, {"actor": 0}, waiting=10)
    assert d.state == "admitting" and d.admit == 4
    assert Counter(d.partitions) == Counter({1: 2, 0: 1, 2: 1})  # least loaded first
    d = policy.decide({"local": {0: 2, 1: 2, 2: 2}}, {"actor": 0}, waiting=10)
    assert d.admit == 0 and d.state == "holding" and "pool local: 6/6" in d.reason
    d = policy.decide({"local": {0: 0, 1: 0, 2: 0}}, {}, waiting=2)
    assert d.admit == 2 and d.state == "admitting"
    d = policy.decide({"local": {0: 0}}, {}, waiting=0)
    assert d.admit == 0 and d.state == "admitting"  # open, nothing to let through


def test_admission_holds_while_a_trainer_is_behind():
    policy = AdmissionPolicy({"local": 6}, {"solver": 4, "verifier": 2})
    d = policy.decide({"local": {0: 0}}, {"solver": 4, "verifier": 2}, waiting=3)
    assert d.admit == 3  # at the bound: still admitted
    d = policy.decide({"local": {0: 0}}, {"solver": 1, "verifier": 3}, waiting=3)
    assert d.admit == 0 and d.state == "holding" and d.reason.startswith("trainer verifier")


def test_the_staleness_budget_counts_tasks_in_flight_with_the_queued_batches():
    # max_staleness 4, 8 groups a batch: (4 - L) x 8 tasks may be in flight in all
    policy = AdmissionPolicy({"local": 100}, {"actor": 4}, trainer_batches={"actor": 8})
    d = policy.decide({"local": {0: 10, 1: 10}}, {"actor": 1}, waiting=50)
    assert d.admit == 4 and d.state == "admitting"  # 20 + 4 = (4 - 1) x 8
    d = policy.decide({"local": {0: 12, 1: 12}}, {"actor": 1}, waiting=50)
    assert d.admit == 0 and d.state == "holding"
    assert d.reason == ("trainer actor: 1 batches queued and 24 tasks in flight fill its "
                        "4 versions of 8 groups")
    d = policy.decide({"local": {0: 0}}, {"actor": 4}, waiting=5)
    assert d.admit == 0  # the queue alone fills the bound
    # the tightest trainer decides; one without a batch size keeps the queue bound alone
    policy = AdmissionPolicy({"local": 100}, {"solver": 4, "verifier": 2, "other": 1},
                             trainer_batches={"solver": 8, "verifier": 4, "ghost": 1})
    assert policy.trainer_batches == {"solver": 8, "verifier": 4}
    d = policy.decide({"local": {0: 3}}, {"solver": 0, "verifier": 1, "other": 1}, waiting=9)
    assert d.admit == 1 and d.state == "admitting"  # verifier: (2 - 1) x 4 - 3


def test_groups_on_their_way_to_the_batcher_count_and_free_the_batch_they_will_fill():
    # max_staleness 2, 4 groups a batch, 1 batch queued: the new task's group is trained
    # from a version L + floor((P + T) / B) past the newest, so P + T + 1 <= (2 - 1 + 1) x 4
    policy = AdmissionPolicy({"local": 100}, {"actor": 2}, trainer_batches={"actor": 4})
    d = policy.decide({"local": {0: 3}}, {"actor": 1}, waiting=9, transit={"actor": 0})
    assert d.admit == 5  # 3 + 0 + 5 = 8: one batch more than without the count
    d = policy.decide({"local": {0: 3}}, {"actor": 1}, waiting=9, transit={"actor": 4})
    assert d.admit == 1  # a whole batch on its way holds a version of the budget
    d = policy.decide({"local": {0: 3}}, {"actor": 1}, waiting=9, transit={"actor": 5})
    assert d.admit == 0 and d.state == "holding"
    assert d.reason == ("trainer actor: 1 batches queued and 3 tasks in flight and 5 groups "
                        "on their way fill its 2 versions of 4 groups")
    # the worst case it guards: each admitted task's group lands at most max_staleness
    # batches past the newest version, whatever the split between P and T
    for queued in range(3):
        for p in range(9):
            for t in range(9):
                n = policy.decide({"local": {0: p}}, {"actor": queued}, waiting=20,
                                  transit={"actor": t}).admit
                for k in range(n):  # the k-th admitted has p + t + k groups ahead
                    assert queued + (p + t + k) // 4 <= 2
                if n == 0 and queued <= 2:  # and one more would have been too many
                    assert queued + (p + t) // 4 > 2
    # a policy whose groups on their way are not known keeps the rule without them
    d = policy.decide({"local": {0: 3}}, {"actor": 1}, waiting=9, transit={"other": 0})
    assert d.admit == 1  # (2 - 1) x 4 - 3


def test_the_groups_on_their_way_are_read_on_every_processor_between_nodes_and_batches():
    topo = load_topology(REPO / "topology" / "solver-verifier.yaml")
    run = topo.run
    assert transit_inputs(topo, "verifier") == [
        ("trajectories.raw", f"{run}.staleness"), ("trajectories", f"{run}.router"),
        ("samples.verifier", f"{run}.balance-verifier"),
        ("samples.verifier.balanced", f"{run}.batcher-verifier")]
    assert transit_inputs(topo, "solver") == [
        ("trajectories.raw", f"{run}.staleness"), ("trajectories", f"{run}.router"),
        ("samples.solver", f"{run}.batcher-solver")]
    # the processors before the nodes (admission) are not on the way
    assert all(t != "tasks.source" for t, _ in transit_inputs(topo, "solver"))
    assert transit_inputs(topo, "nobody") == []


def test_replayed_groups_leave_fewer_fresh_groups_a_batch_for_the_budget():
    topo = load_topology(REPO / "topology" / "replay.yaml")
    (spec,) = [s for s in topo.processors.values() if s.kind == "batcher"]
    size, ratio = spec.options["batch_size"], spec.options["replay_ratio"]
    assert trainer_batches(topo, AdmissionOptions()) == {"actor": size - int(ratio * size)}


def test_the_pipeline_budget_takes_each_policys_batch_size_from_its_batcher():
    topo = load_topology(REPO / "topology" / "smollm2-solver-verifier.yaml")
    batchers = {s.options["policy"]: s.options["batch_size"]
                for s in topo.processors.values() if s.kind == "batcher"}
    assert len(batchers) == 2
    assert trainer_batches(topo, AdmissionOptions()) == batchers
    assert trainer_batches(topo, AdmissionOptions(staleness_budget="in_flight")) == batchers
    assert trainer_batches(topo, AdmissionOptions(staleness_budget="queue")) == {}


def test_the_admission_reads_the_processors_options_typed_as_the_file_sets_them():
    """Each processor's options through its model: a batcher's batch size and a filter's
    bound count where the file sets them; the models' defaults fill the rest."""
    from types import SimpleNamespace

    from astraflow.config.topology import ProcessorSpec
    from astraflow.dataflow.admission import max_staleness_of

    topo = SimpleNamespace(processors={
        "b1": ProcessorSpec(kind="batcher", inputs=["s"], options={
            "policy": "a", "batch_size": 10, "replay_ratio": 0.2}),
        "b2": ProcessorSpec(kind="batcher", inputs=["s"], options={"policy": "b"}),
        "f": ProcessorSpec(kind="staleness_filter", inputs=["t"], options={
            "policies": ["b"], "max_staleness": 3}),
        "g": ProcessorSpec(kind="staleness_filter", inputs=["t"]),  # actor, bound unset
    })
    assert trainer_batches(topo, AdmissionOptions()) == {"a": 8}  # b: the queue bound alone
    assert max_staleness_of(topo, "b") == 3
    assert max_staleness_of(topo, "actor") is None
    assert topo.processors["g"].typed_options().policies == ["actor"]


@pytest.mark.parametrize("budget", ["pipeline", "in_flight"])
def test_only_the_pipeline_budget_reads_the_lag_on_the_way_to_the_batchers(budget):
    topo = load_topology(REPO / "topology" / "smollm2.yaml")
    spec = topo.processors["admission"]
    admission = Admission("admission", spec.inputs, spec.outputs,
                          AdmissionOptions(staleness_budget=budget))
    side = admission.side_access(topo)
    on_the_way = {topo.group_of(p) for p in ("staleness", "router", "batcher")}
    assert set(side.lag_groups) >= {topo.raas_group("local"), topo.trainer_group("actor")}
    if budget == "pipeline":
        assert on_the_way <= set(side.lag_groups)
        assert {"trajectories.raw", "samples.actor", "weights.actor"} <= set(side.reads)
    else:
        assert not on_the_way & set(side.lag_groups)
        assert set(side.reads) == {"tasks", "batches.actor"}


def test_admission_every_pool_must_have_room():
    policy = AdmissionPolicy({"fast": 8, "slow": 2})
    d = policy.decide({"fast": {0: 0, 1: 0}, "slow": {0: 1, 1: 0}}, {}, waiting=5)
    assert d.admit == 1 and d.headroom == 1
    d = policy.decide({"fast": {0: 0, 1: 0}, "slow": {0: 1, 1: 1}}, {}, waiting=5)
    assert d.admit == 0 and "pool slow" in d.reason


def test_admission_key_routing_leaves_partitioning_to_the_producer():
    d = AdmissionPolicy({"p": 3}, route="key").decide({"p": {0: 0}}, {}, waiting=5)
    assert d.partitions == [None, None, None]


def _two_pool_topology(share_b: bool):
    return parse_topology({
        "run": "r",
        "topics": {"tasks.source": {}, "tasks": {"partitions": 5}, "samples.actor": {},
                   "batches.actor": {}},
        "processors": {
            "admit": {"kind": "admission", "inputs": ["tasks.source"], "outputs": ["tasks"]},
            "batch": {"kind": "batcher", "inputs": ["samples.actor"],
                      "outputs": ["batches.actor"],
                      "options": {"policy": "actor"}}},
        "policies": {"actor": {"model": "m", "max_staleness": 3}},
        "pools": {"a": {"nodes": 3},
                  "b": {"nodes": 2, "tasks_per_transaction": 4, "share_tasks": share_b}},
    })


def test_bounds_are_derived_from_pools_and_staleness():
    topo = _two_pool_topology(share_b=False)
    assert pool_bounds(topo, AdmissionOptions()) == {"a": 6, "b": 16}
    assert pool_bounds(topo, AdmissionOptions(queue_factor=1.5, pools=["a"])) == {"a": 5}
    assert pool_bounds(topo, AdmissionOptions(pool_capacity=4)) == {"a": 8, "b": 8}
    assert pool_bounds(topo, AdmissionOptions(max_pool_lag=7)) == {"a": 7, "b": 7}
    assert trainer_bounds(topo, AdmissionOptions()) == {"actor": 3}
    assert trainer_bounds(topo, AdmissionOptions(max_staleness=6)) == {"actor": 6}
    assert trainer_bounds(topo, AdmissionOptions(max_trainer_lag=1)) == {"actor": 1}
    assert trainer_bounds(topo, AdmissionOptions(policies=["other"])) == {}  # no topic
    bare = parse_topology({"run": "r", "topics": {"tasks.source": {}, "tasks": {}}})
    assert pool_bounds(bare, AdmissionOptions()) == {"default": 2}
    assert trainer_bounds(bare, AdmissionOptions()) == {}


def test_pools_sharing_tasks_are_one_group_with_their_summed_capacity():
    shared = _two_pool_topology(share_b=True)
    assert shared.raas_groups() == {"r.raas": ["a", "b"]}
    assert [(g.label, g.group, g.capacity) for g in task_groups(shared, AdmissionOptions())] \
        == [("a+b", "r.raas", 11)]
    assert pool_bounds(shared, AdmissionOptions()) == {"a+b": 22}
    own = _two_pool_topology(share_b=False)
    assert own.raas_groups() == {"r.raas": ["a"], "r.raas.b": ["b"]}
    assert own.raas_group("b") == "r.raas.b" and own.raas_group("a") == "r.raas"


def test_more_sharing_nodes_than_task_partitions_fail_at_load():
    with pytest.raises(TopologyError, match="topics.tasks.partitions: 3 partitions for the 5 "
                                            "nodes of pools a, b"):
        parse_topology({"run": "r", "topics": {"tasks": {}},
                        "pools": {"a": {"nodes": 3}, "b": {"nodes": 2}}})
    parse_topology({"run": "r", "topics": {"tasks": {}},  # own groups: 3 each is fine
                    "pools": {"a": {"nodes": 3}, "b": {"nodes": 2, "share_tasks": False}}})


# --- the processor, with scripted lags --------------------------------------------------
class ScriptedLags:
    def __init__(self):
        self.obs = Observation({"local": {0: 0, 1: 0}}, {"actor": 0})
        self.reads = 0
        self.fail = False

    def observe(self) -> Observation:
        self.reads += 1
        if self.fail:
            from confluent_kafka import KafkaException
            raise KafkaException("broker gone")
        return self.obs

    def close(self) -> None:
        pass


class Control:
    def __init__(self):
        self.calls: list[tuple[str, str]] = []

    def pause(self, topic, partitions=None):
        self.calls.append(("pause", topic))

    def resume(self, topic, partitions=None):
        self.calls.append(("resume", topic))


def task_msg(i: int, partition: int = 0) -> Incoming:
    t = Task(task_id=f"t{i}", prompt_id=f"p{i}", workflow="w", payload="{}", source="s")
    return Incoming("tasks.source", partition, i, f"p{i}".encode(), t)


def test_admission_processor_holds_and_resumes():
    lags = ScriptedLags()
    a = Admission("admit", ["tasks.source"], ["tasks"], AdmissionOptions(poll_interval_s=0.5,
                                                                         max_held=6),
                  lags=lags, policy=AdmissionPolicy({"local": 4}, {"actor": 2}))
    a.control = Control()
    assert a.state() == "holding"  # nothing observed yet
    for i in range(8):
        a.process(task_msg(i, partition=i % 2))
    out = list(a.flush(1000))
    assert [o.record.task_id for o in out] == ["t0", "t1", "t2", "t3"]
    assert {o.topic for o in out} == {"tasks"} and all(o.partition in (0, 1) for o in out)
    assert a.state() == "admitting"
    assert a.held_offsets() == {("tasks.source", 0): 4, ("tasks.source", 1): 5}
    # the next read is not due yet: nothing more, even if the pool drained
    lags.obs = Observation({"local": {0: 0, 1: 0}}, {"actor": 0})
    assert list(a.flush(1200)) == [] and lags.reads == 1
    # pool full -> hold; the waiting tasks stay held, the input is paused beyond max_held
    lags.obs = Observation({"local": {0: 2, 1: 2}}, {"actor": 0})
    for i in range(8, 10):
        a.process(task_msg(i))
    assert list(a.flush(1500)) == []
    assert a.state() == "holding" and a.control.calls == [("pause", "tasks.source")]
    m = a.metrics()
    assert m["admission/held"] == 6 and m["admission/pool_lag"] == 4
    assert m["admission/bound_pool"] == 4 and m["admission/holding"] == 1
    assert m["admission/input_paused"] == 1
    # trainer behind: hold even though the pool has room
    lags.obs = Observation({"local": {0: 0, 1: 0}}, {"actor": 3})
    assert list(a.flush(2000)) == [] and a.metrics()["admission/trainer_lag"] == 3
    # a failed read holds too
    lags.fail = True
    assert list(a.flush(2500)) == [] and a.metrics()["admission/lag_errors"] == 1
    # everything drained: admit again, resume the input below max_held / 2
    lags.fail = False
    lags.obs = Observation({"local": {0: 0, 1: 0}}, {"actor": 0})
    out = list(a.flush(3000))
    assert [o.record.task_id for o in out] == ["t4", "t5", "t6", "t7"]
    assert a.control.calls[-1] == ("resume", "tasks.source")
    assert a.metrics()["admission/admitted"] == 8
    # revoked partitions forget their held tasks (they are redelivered)
    a.on_revoke([("tasks.source", 0)])
    assert a.held_offsets() == {}


def test_admission_reports_the_highest_target_it_has_had():
    # targets move at every lag read and statuses sample them: the peak is what bounded
    # the tasks in flight in between
    lags = ScriptedLags()
    lags.obs = Observation({"local": {0: 0}}, {})
    a = Admission("admit", ["tasks.source"], ["tasks"], AdmissionOptions(poll_interval_s=0.5),
                  lags=lags, policy=AdmissionPolicy({"local": 4}))
    for i in range(20):
        a.process(task_msg(i))
    for now, bound in ((1000, 4), (2000, 9), (3000, 3)):
        a.policy.pool_bounds = {"local": bound}
        a.flush(now)
    m = a.metrics()
    assert m["admission/bound_pool"] == 3 and m["admission/bound_pool/local"] == 3
    assert m["admission/bound_pool_max"] == 9 and m["admission/bound_pool_max/local"] == 9


def test_admission_counts_tasks_it_wrote_but_the_log_does_not_show_yet():
    lags = ScriptedLags()
    a = Admission("admit", ["tasks.source"], ["tasks"], AdmissionOptions(poll_interval_s=0.5),
                  lags=lags, policy=AdmissionPolicy({"local": 4}))
    for i in range(20):
        a.process(task_msg(i))
    lags.obs = Observation({"local": {0: 0}}, {}, tasks_end={0: 100})
    assert len(list(a.flush(1000))) == 4
    # the producer has not written them yet: the pool looks empty, but they are in flight
    assert list(a.flush(2000)) == []
    # written, one rolled out: room for one
    lags.obs = Observation({"local": {0: 3}}, {}, tasks_end={0: 104})
    assert len(list(a.flush(3000))) == 1
    # key routing: the partition is not known, the total still is
    k = Admission("admit", ["tasks.source"], ["tasks"], AdmissionOptions(route="key"),
                  lags=lags, policy=AdmissionPolicy({"local": 4}, route="key"))
    for i in range(20):
        k.process(task_msg(i))
    lags.obs = Observation({"local": {0: 0, 1: 0}}, {}, tasks_end={0: 10, 1: 10})
    assert len(list(k.flush(1000))) == 4
    lags.obs = Observation({"local": {0: 1, 1: 0}}, {}, tasks_end={0: 11, 1: 10})
    assert list(k.flush(2000)) == []
    lags.obs = Observation({"local": {0: 2, 1: 2}}, {}, tasks_end={0: 12, 1: 12})
    assert list(k.flush(3000)) == []
    lags.obs = Observation({"local": {0: 1, 1: 1}}, {}, tasks_end={0: 12, 1: 12})
    assert len(list(k.flush(4000))) == 2


def test_admission_holds_when_every_partition_is_at_its_cap():
    policy = AdmissionPolicy({"local": 20})
    d = policy.decide({"local": {0: 2, 1: 2}}, {}, 10, {0: 1.0, 1: 1.0}, caps={0: 2, 1: 3})
    assert d.admit == 1 and d.partitions == [1]  # only partition 1 had room
    d = policy.decide({"local": {0: 2, 1: 3}}, {}, 10, {0: 1.0, 1: 1.0}, caps={0: 2, 1: 3})
    assert d.admit == 0 and d.state == "holding" and "every partition at its cap" in d.reason


def test_admission_is_a_registered_kind_with_one_output():
    assert PROCESSOR_KINDS["admission"] is Admission
    with pytest.raises(ValueError):
        Admission("a", ["tasks.source"], ["tasks", "other"])


def test_example_topology_bounds():
    from pathlib import Path

    from astraflow.config.topology import load_topology

    topo = load_topology(Path(__file__).resolve().parents[3] / "topology" / "replay.yaml")
    spec = topo.processors["admission"]
    options = AdmissionOptions(**spec.options)
    assert spec.inputs == ["tasks.source"] and spec.outputs == ["tasks"]
    assert pool_bounds(topo, options) == {"local": 4}
    assert trainer_bounds(topo, options) == {"actor": 4}
    assert topo.processors["batcher"].options["replay_ratio"] == 0.25
