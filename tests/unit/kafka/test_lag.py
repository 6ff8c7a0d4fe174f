"""Where a consumer group resumes on a partition, from its committed offset and the log."""

from __future__ import annotations

import pytest

from astraflow.kafka.lag import PartitionLag, resume_offset


@pytest.mark.parametrize(("committed", "start", "end", "resumes"), [
    (None, 0, 5, 0),  # nothing committed: the earliest retained offset
    (3, 0, 5, 3),
    (5, 0, 5, 5),  # at the end: caught up
    (0, 0, 0, 0),
    (1975, 0, 3, 0),  # past the end: the topic deleted and made again
    (2, 4, 9, 4),  # before the start: retention deleted what it had not read
])
def test_a_group_resumes_at_its_committed_offset_when_the_log_holds_it(
        committed, start, end, resumes):
    assert resume_offset(committed, start, end) == resumes
    row = PartitionLag("g", "t", 0, end, committed, start, end - resumes)
    assert row.resumes_at == resumes
