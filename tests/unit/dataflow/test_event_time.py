"""Event time without a broker: the versions a stream clock answers as of each record's time (what
``replay process`` judges staleness with)."""

from __future__ import annotations

from astraflow.dataflow.event_time import StreamClock, VersionsAtTime


def test_versions_are_answered_as_of_the_clock():
    clock = StreamClock()
    versions = VersionsAtTime(clock, {"actor": [(2000, 1), (1000, 0), (3000, 2)]})
    seen = []
    for ts in (500, 1000, 1999, 2500, 9000):
        clock.at_record(ts)
        seen.append(versions.latest("actor"))
    assert seen == [None, 0, 0, 1, 2]
    assert versions.latest("critic") is None
    clock.at_record(1500)  # a record from another partition, earlier in time
    assert versions.latest("actor") == 0 and clock.stream_ms == 9000
    assert clock.at_stream() == 9000 and versions.latest("actor") == 2


def test_a_version_published_out_of_order_never_lowers_the_answer():
    clock = StreamClock()
    versions = VersionsAtTime(clock, {"actor": [(1000, 3), (2000, 2)]})
    clock.at_record(2500)
    assert versions.latest("actor") == 3

