"""Staleness filter, router and batcher: their decision logic without a broker (on one:
``tests/integration/dataflow/test_processors.py``)."""

from __future__ import annotations

from astraflow.dataflow import Incoming
from astraflow.dataflow.batcher import Batcher, BatcherOptions
from astraflow.dataflow.router import PolicyRouter, split_by_policy
from astraflow.dataflow.staleness import StalenessFilter, StalenessOptions, staleness
from astraflow.dataflow.versions import StaticVersions
from astraflow.wire.records import Batch, Sequence, TrajectoryGroup


def seq(policy: str, versions: list[int], reward: float = 1.0) -> Sequence:
    n = len(versions)
    return Sequence(policy=policy, token_ids=list(range(n)),
                    loss_mask=[int(v >= 0) for v in versions], logprobs=[0.0] * n,
                    versions=versions, reward=reward, sample_index=0, finish_reason="stop")


def group(gid: str, *seqs: Sequence) -> TrajectoryGroup:
    return TrajectoryGroup(group_id=gid, prompt_id=gid, task_id=gid, workflow="w", source="s",
                           raas_id="r", pool="p", sequences=list(seqs),
                           rewards=[s.reward for s in seqs])


def incoming(rec, offset: int = 0, partition: int = 0, topic: str = "trajectories.raw"):
    return Incoming(topic, partition, offset, rec.group_id.encode(), rec)


def test_staleness_is_measured_from_the_oldest_generated_token():
    versions = StaticVersions({"actor": 10, "critic": 3})
    assert staleness(group("g", seq("actor", [-1, -1, 7, 9])), versions) == 3
    assert staleness(group("g", seq("actor", [-1, 10])), versions) == 0
    assert staleness(group("g", seq("actor", [-1, 9]), seq("critic", [0, 1])), versions) == 3
    assert staleness(group("g", seq("unknown", [-1, 0])), versions) == 0  # nothing published
    assert staleness(group("g", seq("actor", [-1, -1])), versions) == 0  # nothing generated


def test_staleness_filter_drops_and_counts():
    f = StalenessFilter("st", ["trajectories.raw"], ["trajectories"],
                        StalenessOptions(max_staleness=2), versions=StaticVersions({"actor": 10}))
    kept = list(f.process(incoming(group("ok", seq("actor", [-1, 8, 9])))))
    dropped = list(f.process(incoming(group("old", seq("actor", [-1, 7, 10])))))
    assert [o.topic for o in kept] == ["trajectories"] and dropped == []
    assert f.metrics()["staleness/dropped"] == 1 and f.metrics()["staleness/passed"] == 1
    assert f.metrics()["staleness/max_seen"] == 3


def test_router_splits_each_policy_sequences():
    g = group("g", seq("solver", [-1, 1], 1.0), seq("verifier", [-1, 2], 0.0),
              seq("solver", [-1, 1], 0.5))
    parts = split_by_policy(g)
    assert set(parts) == {"solver", "verifier"}
    assert [s.policy for s in parts["solver"].sequences] == ["solver", "solver"]
    assert parts["solver"].rewards == [1.0, 0.5]
    assert parts["verifier"].rewards == [0.0]
    r = PolicyRouter("r", ["trajectories"], ["samples.solver", "samples.verifier"])
    outs = list(r.process(incoming(g, topic="trajectories")))
    assert sorted(o.topic for o in outs) == ["samples.solver", "samples.verifier"]


def test_batcher_holds_until_full_and_reports_held_offsets():
    b = Batcher("b", ["samples.actor"], ["batches.actor"], BatcherOptions(batch_size=3))
    for i in range(5):
        assert list(b.process(incoming(group(f"g{i}", seq("actor", [-1, 0])), offset=10 + i,
                                       partition=i % 2, topic="samples.actor"))) == []
    out = list(b.flush(0))
    assert len(out) == 1
    batch: Batch = out[0].record
    assert [g.group_id for g in batch.groups] == ["g0", "g1", "g2"]
    ranges = {(r.partition, r.start, r.end) for r in batch.source_offsets}
    assert ranges == {(0, 10, 13), (1, 11, 12)}
    assert b.held_offsets() == {("samples.actor", 1): 13, ("samples.actor", 0): 14}
    b.on_revoke([("samples.actor", 1)])
    assert b.held_offsets() == {("samples.actor", 0): 14}


def test_batcher_drops_groups_gone_stale_while_held():
    versions = StaticVersions({"actor": 1})
    b = Batcher("b", ["samples.actor"], ["batches.actor"],
                BatcherOptions(batch_size=2, max_staleness=1), versions=versions)
    b.process(incoming(group("a", seq("actor", [-1, 0])), topic="samples.actor"))
    assert list(b.flush(0)) == []
    versions.versions["actor"] = 3
    b.process(incoming(group("b", seq("actor", [-1, 3])), offset=1, topic="samples.actor"))
    assert list(b.flush(0)) == []  # "a" is now 3 versions old and was dropped
    assert b.metrics()["batcher/dropped_stale"] == 1

