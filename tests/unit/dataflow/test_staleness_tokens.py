"""The staleness filter on sequences whose tokens span several versions (updates inside a
generation or between an episode's calls): the bound is judged on the oldest token, and
each token's age is reported."""

from __future__ import annotations

from astraflow.config.processors import StalenessOptions
from astraflow.dataflow import Incoming
from astraflow.dataflow.staleness import StalenessFilter, staleness, token_lags
from astraflow.dataflow.versions import StaticVersions
from tests.unit.dataflow.test_data_algorithms import group

SPANNING = [-1, -1] + [3] * 4 + [5] * 8 + [6] * 4  # a prompt, then three versions


def test_a_group_spanning_versions_is_judged_on_its_oldest_token():
    g = group("p", [1.0, 0.0], versions=SPANNING)
    versions = StaticVersions({"actor": 7})
    assert staleness(g, versions) == 4  # 7 - 3: not 7 - 6 (newest), nor a mean
    assert sorted(set(token_lags(g, versions))) == [1, 2, 4]
    assert len(token_lags(g, versions)) == 2 * 16
    assert token_lags(g, StaticVersions({})) == []  # nothing published yet

    passing = StalenessFilter("s", ["trajectories.raw"], ["trajectories"],
                              StalenessOptions(max_staleness=4), versions=versions)
    dropping = StalenessFilter("s", ["trajectories.raw"], ["trajectories"],
                               StalenessOptions(max_staleness=3), versions=versions)
    msg = Incoming("trajectories.raw", 0, 0, b"p", g)
    assert len(list(passing.process(msg))) == 1
    assert list(dropping.process(msg)) == []
    m = dropping.metrics()
    assert m["staleness/dropped"] == 1 and m["staleness/max_seen"] == 4
    assert m["staleness/token_lag_mean"] == (4 * 4 + 8 * 2 + 4 * 1) / 16
    assert m["staleness/token_lag_max"] == 4
