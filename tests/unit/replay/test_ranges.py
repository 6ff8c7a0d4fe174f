"""Replay's range logic without a broker: a range is what every bound allows within the retained
offsets, the range flags, where the batches of a version end (replay train on a real broker:
tests/integration/replay/test_replay.py)."""

from __future__ import annotations

import pytest

from astraflow.replay.ranges import (
    ReplayError,
    clamp_range,
    parse_offsets,
    parse_time,
    version_ends,
)
from astraflow.wire.records import PartitionOffset
from tests.unit.trainer.test_trainer import make_batch, tiny_model  # noqa: F401 - tiny_model is a fixture


def test_a_range_is_what_every_bound_allows_within_the_retained_offsets():
    marks = {0: (10, 100), 1: (0, 40)}
    assert clamp_range(marks, (None, None), (None, None)).records == 90 + 40
    r = clamp_range(marks, (20, 50), (None, None))
    assert (r.start, r.end) == ({0: 20, 1: 20}, {0: 50, 1: 40})
    r = clamp_range(marks, (None, None), ({0: 30, 1: 5}, {0: 60, 1: 40}))
    assert (r.start, r.end) == ({0: 30, 1: 5}, {0: 60, 1: 40})
    r = clamp_range(marks, (None, None), (None, None), end_by_version={0: 55})
    assert (r.end, r.records) == ({0: 55, 1: 0}, 45)  # partition 1 trained nothing


def test_range_flags_are_parsed_or_refused_clearly():
    assert parse_offsets("100:500") == (100, 500)
    assert parse_offsets(":7") == (None, 7) and parse_offsets("3:") == (3, None)
    with pytest.raises(ReplayError, match="FROM:TO"):
        parse_offsets("100")
    assert parse_time("1795500000000") == 1795500000000
    assert parse_time("2026-11-24T15:00:00") == parse_time("2026-11-24T15:00:00+00:00")
    with pytest.raises(ReplayError, match="ISO time"):
        parse_time("yesterday")


def test_the_batches_of_a_version_end_after_the_last_offset_it_consumed():
    class M:
        def __init__(self, version, offset):
            self.version = version
            self.consumed_offsets = [PartitionOffset(topic="r.batches.actor", partition=0,
                                                     offset=offset)]

    ms = [M(0, 0), M(1, 3), M(2, 5), M(3, 9)]
    assert version_ends(ms, "r.batches.actor", 2) == {0: 5}
    with pytest.raises(ReplayError, match="no version up to 2"):
        version_ends(ms, "other.batches.actor", 2)

