"""Which partitions the loop's consumer fetches from: pause and resume requests (from any
thread) applied to the assignment, without a broker."""

from __future__ import annotations

import threading

from confluent_kafka import TopicPartition

from astraflow.kafka.pausing import Pauses


class Assigned:
    """A consumer's assignment and the pause/resume calls made on it."""

    def __init__(self, *tps: tuple[str, int]) -> None:
        self.tps = [TopicPartition(t, p) for t, p in tps]
        self.calls: list[tuple[str, list[tuple[str, int]]]] = []

    def assignment(self) -> list[TopicPartition]:
        return list(self.tps)

    def pause(self, tps) -> None:
        self.calls.append(("pause", [(tp.topic, tp.partition) for tp in tps]))

    def resume(self, tps) -> None:
        self.calls.append(("resume", [(tp.topic, tp.partition) for tp in tps]))


def test_a_request_is_applied_to_the_assigned_partitions_before_the_next_poll():
    c = Assigned(("a", 0), ("a", 1), ("b", 0))
    pauses = Pauses()
    pauses.apply(c)  # the first assignment: everything fetched from
    assert c.calls == [("resume", [("a", 0), ("a", 1), ("b", 0)])] and pauses.paused == {}
    c.calls.clear()
    pauses.apply(c)  # nothing changed: the consumer is not asked again
    assert c.calls == []

    # asked from another thread, applied on the loop's
    asker = threading.Thread(target=pauses.pause, args=("a", [1]))
    asker.start()
    asker.join()
    assert c.calls == [] and pauses.paused == {}
    pauses.apply(c)
    assert pauses.paused == {"a": {1}}
    assert c.calls == [("pause", [("a", 1)]), ("resume", [("a", 0), ("b", 0)])]


def test_an_all_partitions_pause_covers_partitions_assigned_later():
    c = Assigned(("a", 0))
    pauses = Pauses()
    pauses.pause("a")
    pauses.apply(c)
    assert pauses.paused == {"a": None} and c.calls == [("pause", [("a", 0)])]
    c.calls.clear()
    c.tps.append(TopicPartition("a", 2))  # a rebalance gives it one more partition
    pauses.assignment_changed()
    pauses.apply(c)
    assert c.calls == [("pause", [("a", 0), ("a", 2)])]


def test_resuming_some_partitions_of_an_all_partitions_pause_keeps_the_rest_paused():
    c = Assigned(("a", 0), ("a", 1), ("a", 2), ("b", 0))
    pauses = Pauses()
    pauses.pause("a")
    pauses.resume("a", [1])
    pauses.apply(c)
    assert pauses.paused == {"a": {0, 2}}
    assert c.calls == [("pause", [("a", 0), ("a", 2)]), ("resume", [("a", 1), ("b", 0)])]


def test_a_topic_with_no_partition_left_paused_is_forgotten():
    c = Assigned(("a", 0), ("a", 1))
    pauses = Pauses()
    pauses.pause("a", [0])
    pauses.pause("a", [1])
    pauses.apply(c)
    assert pauses.paused == {"a": {0, 1}}
    pauses.resume("a", [0, 1])
    pauses.apply(c)
    assert pauses.paused == {}
    assert c.calls[-1] == ("resume", [("a", 0), ("a", 1)])

    # resume all of one paused in part; pause all over a partial pause
    pauses.pause("a", [1])
    pauses.resume("a")
    pauses.apply(c)
    assert pauses.paused == {}
    pauses.pause("a", [1])
    pauses.pause("a")
    pauses.pause("a", [0])  # already covered: still all
    pauses.apply(c)
    assert pauses.paused == {"a": None}


def test_split_names_what_to_pause_and_what_to_fetch_from():
    pauses = Pauses()
    pauses.paused = {"a": {1}, "b": None}
    tps = [TopicPartition("a", 0), TopicPartition("a", 1), TopicPartition("b", 3),
           TopicPartition("c", 0)]
    to_pause, to_resume = pauses.split(tps)
    assert [(t.topic, t.partition) for t in to_pause] == [("a", 1), ("b", 3)]
    assert [(t.topic, t.partition) for t in to_resume] == [("a", 0), ("c", 0)]
