"""Deleting a run while the group coordinator loads (a broker just started): it is waited
for, so the run's consumer groups are listed and deleted, not silently kept with their
offsets for a run made again under the same name. Against a scripted admin client."""

from __future__ import annotations

import time
from concurrent.futures import Future
from pathlib import Path
from types import SimpleNamespace

import pytest
from confluent_kafka import KafkaError, KafkaException

import astraflow.launch.runs as runs_mod
from astraflow.errors import AstraflowError
from astraflow.launch.runs import Runs, offsets_partition

LOADING = KafkaError(KafkaError.COORDINATOR_LOAD_IN_PROGRESS)


def done(value=None, error: KafkaError | None = None) -> Future:
    f: Future = Future()
    if error is None:
        f.set_result(value)
    else:
        f.set_exception(KafkaException(error))
    return f


class Admin:
    """A broker just started, holding topics of run ``r`` and groups: its coordinator
    leads no partition of ``__consumer_offsets`` for the first ``unled`` probes, loads
    them for the next ``loading`` ones (listing no group meanwhile), then refuses the
    first ``refused`` deletes as a coordinator that moved; a group in ``members`` stays
    non-empty."""

    def __init__(self, unled: int = 0, loading: int = 0, refused: int = 0,
                 members: set[str] = frozenset(), list_error: KafkaError | None = None):
        self.topics = {"r.status", "r.dlq", "r.tasks", "other.status", "other.dlq"}
        self.groups = {"r.raas", "r.admission", "other.raas"}
        self.unled, self.loading, self.refused = unled, loading, refused
        self.members, self.list_error = set(members), list_error
        self.probed, self.probes, self.delete_calls = 0, set(), 0

    @property
    def state(self) -> str:
        if self.probed < self.unled:
            return "unled"
        return "loading" if self.probed < self.unled + self.loading else "ready"

    def list_topics(self, topic=None, timeout=None):
        if topic == "__consumer_offsets":
            return SimpleNamespace(topics={topic: SimpleNamespace(
                error=None, partitions={p: None for p in range(4)})})
        return SimpleNamespace(topics={t: SimpleNamespace(partitions={0: None})
                                       for t in self.topics})

    def describe_consumer_groups(self, groups, request_timeout=None):
        code = {"unled": KafkaError.NOT_COORDINATOR,
                "loading": KafkaError.COORDINATOR_LOAD_IN_PROGRESS}.get(self.state)
        self.probed += 1
        self.probes.update(groups)
        return {g: done(error=KafkaError(code) if code else None) for g in groups}

    def delete_topics(self, names, operation_timeout=None):
        self.topics -= set(names)
        return {n: done() for n in names}

    def list_consumer_groups(self, request_timeout=None):
        if self.list_error is not None:
            return done(SimpleNamespace(valid=[], errors=[self.list_error]))
        if self.state == "unled":  # lists none, without an error
            return done(SimpleNamespace(valid=[], errors=[]))
        if self.state == "loading":
            return done(SimpleNamespace(valid=[], errors=[LOADING]))
        return done(SimpleNamespace(valid=[SimpleNamespace(group_id=g) for g in self.groups],
                                    errors=[]))

    def delete_consumer_groups(self, groups, request_timeout=None):
        self.delete_calls += 1
        out = {}
        for g in groups:
            if self.delete_calls <= self.refused:
                out[g] = done(error=KafkaError(KafkaError.NOT_COORDINATOR))
            elif g in self.members:
                out[g] = done(error=KafkaError(KafkaError.NON_EMPTY_GROUP))
            else:
                self.groups.discard(g)
                out[g] = done()
        return out


@pytest.fixture
def admin(monkeypatch):
    made = {}

    def make(**kw):
        made["admin"] = Admin(**kw)
        monkeypatch.setattr(runs_mod, "make_admin", lambda config: made["admin"])
        monkeypatch.setattr(runs_mod, "time", SimpleNamespace(monotonic=time.monotonic,
                                                              sleep=lambda s: None))
        return Runs(config=None, log_dir=Path("/nonexistent")), made["admin"]
    return make


def test_a_loading_coordinator_is_waited_for_and_the_groups_are_deleted(admin):
    runs, a = admin(unled=2, loading=3, refused=2)
    topics, deleted, kept = runs.delete("r")
    assert sorted(topics) == ["r.dlq", "r.status", "r.tasks"]
    assert sorted(deleted) == ["r.admission", "r.raas"] and kept == {}
    assert a.groups == {"other.raas"} and a.probed == 6 and a.delete_calls == 3
    # one probe per partition of __consumer_offsets, named after the run
    assert {offsets_partition(g, 4) for g in a.probes} == {0, 1, 2, 3}
    assert all(g.startswith("r.coordinator-probe-") for g in a.probes)


def test_the_partition_of_a_group_is_kafkas():
    assert offsets_partition("hello", 1 << 30) == 99162322  # Java: "hello".hashCode()
    assert offsets_partition("polygenelubricants", 7) == 0  # hashCode() == MIN_VALUE
    # Java (jshell) says "r.raas".hashCode() == -985269603, "run-é𝄞.g" -93078134 (UTF-16)
    assert offsets_partition("r.raas", 50) == 985269603 % 50
    assert offsets_partition("run-é𝄞.g", 50) == 93078134 % 50


def test_a_group_with_members_is_kept_and_start_over_refuses(admin, monkeypatch):
    runs, a = admin(members={"r.raas"})
    _, deleted, kept = runs.delete("r")
    assert deleted == ["r.admission"]
    assert kept == {"r.raas": "Broker: The group is not empty"}

    runs, a = admin(members={"r.raas"})
    monkeypatch.setattr(runs_mod, "START_OVER_MEMBERS_S", 0.0)
    with pytest.raises(AstraflowError, match=r"could not start over: consumer group r.raas"):
        runs_mod.start_over("r", config=SimpleNamespace(bootstrap_servers="stub:9092"))


def test_a_coordinator_that_never_loads_or_groups_that_cannot_be_listed_fail_by_name(
        admin, monkeypatch):
    monkeypatch.setattr(runs_mod, "COORDINATOR_WAIT_S", 0.0)
    runs, a = admin(loading=10**6)
    with pytest.raises(AstraflowError, match="did not load __consumer_offsets .* run 'r' "
                                             "was not deleted"):
        runs.delete("r")
    assert a.topics >= {"r.status", "r.dlq", "r.tasks"}  # nothing deleted
    runs, a = admin(list_error=KafkaError(KafkaError.CLUSTER_AUTHORIZATION_FAILED))
    with pytest.raises(AstraflowError, match="listing the consumer groups of run 'r'"):
        runs.delete("r")
    assert a.topics >= {"r.status", "r.dlq", "r.tasks"}
