"""Task lag targets and routing by measured throughput: decision logic without a broker."""

from __future__ import annotations

import math
import random
from collections.abc import Callable

import pytest

from astraflow.dataflow.lag_target import LagTargets, Rate, route_by_wait


def test_rate_is_a_smoothed_slope_over_windows_of_at_least_min_window():
    r = Rate(half_life_s=1.0, min_window_s=1.0)
    r.update(0.0, 0)
    r.update(0.5, 100)  # too short a window: kept for later
    assert r.value is None
    r.update(1.0, 10)
    assert r.value == pytest.approx(10.0)
    r.update(2.0, 40)  # 30/s, weight 0.5 at one half-life
    assert r.value == pytest.approx(20.0)


def test_rate_skips_idle_windows_and_restarts_when_the_count_falls():
    r = Rate(half_life_s=1.0, min_window_s=1.0)
    r.update(0.0, 0)
    r.update(1.0, 5)
    r.update(2.0, 5, busy=False)  # nothing to do: says nothing of the rate
    assert r.value == pytest.approx(5.0)
    r.update(3.0, 0)  # a restarted counter
    r.update(4.0, 5)
    assert r.value == pytest.approx(5.0)


def feed(t: LagTargets, label: str, tasks_per_s: float, versions_per_s: float,
         seconds: int = 30) -> None:
    """Roll out ``tasks_per_s`` with 3 in flight, train ``versions_per_s``."""
    for s in range(seconds + 1):
        t.observe(float(s), {label: {0: int(s * tasks_per_s)}}, {label: {0: 3}},
                  {"actor": int(s * versions_per_s)})


def test_target_starts_at_queue_factor_times_capacity():
    t = LagTargets({"local": 4}, {"actor": 4}, queue_factor=2.0)
    assert t.targets() == {"local": 8} and t.rate("local") is None and t.budget_s() is None


def test_target_is_half_the_staleness_bound_of_throughput():
    t = LagTargets({"local": 1}, {"actor": 4}, queue_factor=2.0, poll_interval_s=0.5)
    feed(t, "local", tasks_per_s=20, versions_per_s=0.5)
    assert t.rate("local") == pytest.approx(20, rel=0.01)
    # 4 versions at 0.5/s = 8 s of staleness; half: 4 s of 20 tasks/s
    assert t.budget_s() == pytest.approx(4.0, rel=0.01)
    assert t.target("local") == 80


def test_target_floor_keeps_every_slot_busy_between_reads():
    t = LagTargets({"local": 4}, {"actor": 1}, queue_factor=2.0, poll_interval_s=0.5)
    feed(t, "local", tasks_per_s=2, versions_per_s=5)  # budget 0.1 s: 0.2 tasks
    assert t.target("local") == math.ceil(2 * (4 + 2 * 0.5))


def test_target_holds_at_most_max_queue_seconds_of_work():
    t = LagTargets({"local": 1}, {"actor": 4}, max_queue_s=10)
    feed(t, "local", tasks_per_s=20, versions_per_s=0.1)  # budget about 20 s
    assert t.target("local") == 200


def test_a_fixed_target_is_used_as_it_is():
    t = LagTargets({"local": 1}, {"actor": 4}, fixed={"local": 7})
    feed(t, "local", tasks_per_s=20, versions_per_s=1)
    assert t.target("local") == 7


def test_routing_by_wait_shares_tasks_in_proportion_to_rates():
    picks = route_by_wait({0: 0, 1: 0, 2: 0}, {0: 10.0, 1: 6.0, 2: 3.0}, 19)
    assert [picks.count(p) for p in (0, 1, 2)] == [10, 6, 3]


def test_routing_without_rates_is_least_loaded():
    assert route_by_wait({0: 2, 1: 0, 2: 1}, {}, 3) == [1, 1, 2]


def test_a_partition_never_measured_counts_at_the_best_rate():
    picks = route_by_wait({0: 2, 1: 2, 2: 2}, {0: 10.0, 1: 2.0}, 4)
    assert picks.count(2) == 2 and picks.count(0) == 2  # ties go to the faster


def test_a_partition_judged_slow_still_gets_a_task_behind_long_queues():
    picks = route_by_wait({0: 2, 1: 2}, {0: 10.0, 1: 0.0}, 30)
    assert picks.count(1) == 1  # its rate counts as a tenth of the mean: measured again


def test_every_node_keeps_a_task_running_and_one_waiting_whatever_its_rate():
    # a rate measured over a few heavy-tailed tasks says little: a node that just finished
    # a long one looks slow, and must not sit idle while the others have queues
    assert route_by_wait({0: 5, 1: 0}, {0: 10.0, 1: 0.1}, 1) == [1]
    assert route_by_wait({0: 5, 1: 1, 2: 0}, {0: 10.0, 1: 0.1, 2: 0.1}, 3) == [2, 1, 2]
    # beyond that, by rate
    assert route_by_wait({0: 2, 1: 2}, {0: 10.0, 1: 0.1}, 3) == [0, 0, 0]


def simulate(speeds: dict[int, float], seconds: float = 120.0, dt: float = 0.05,
             poll_s: float = 0.5, supply_per_s: float = 1e9, starts: dict[int, float] | None = None,
             target_at: Callable[[float, int], int] | None = None, caps: bool = True
             ) -> tuple[dict[int, int], dict[int, list[int]]]:
    """Nodes, one per partition, each finishing a task every 0.1 s / speed from its
    start time on; an admission reading lags every ``poll_s``, with tasks arriving at
    ``supply_per_s``, routing by wait (``caps``: within the partition caps).
    ``target_at(t, target)`` overrides the target. Returns tasks done per partition and
    the in-flight counts seen at each read."""
    starts = starts or {}
    supplied = 0.0
    targets = LagTargets({"g": len(speeds)}, {"actor": 4}, poll_interval_s=poll_s)
    queue = {p: 0 for p in speeds}
    progress = {p: 0.0 for p in speeds}
    done = {p: 0 for p in speeds}
    seen: dict[int, list[int]] = {p: [] for p in speeds}
    t, next_read = 0.0, 0.0
    while t < seconds:
        supplied = min(supplied + supply_per_s * dt, 1e6)
        for p, speed in speeds.items():
            if queue[p] and t >= starts.get(p, 0.0):
                progress[p] += dt * speed / 0.1
                while progress[p] >= 1 and queue[p]:
                    progress[p] -= 1
                    queue[p] -= 1
                    done[p] += 1
        if t >= next_read:
            next_read = t + poll_s
            targets.observe(t, {"g": dict(done)}, {"g": dict(queue)}, {"actor": int(t)})
            target = targets.target("g")
            target = target_at(t, target) if target_at else target
            room = min(int(supplied), target - sum(queue.values()))
            limits = targets.partition_caps("g") if caps else None
            for p in route_by_wait(queue, targets.partition_rates("g"), max(0, room),
                                   caps=limits):
                queue[p] += 1
                supplied -= 1
            for p in speeds:
                seen[p].append(queue[p])
        t += dt
    return done, seen


def test_three_pools_at_100_60_30_percent_get_shares_of_their_throughput():
    done, seen = simulate({0: 1.0, 1: 0.6, 2: 0.3})
    total = sum(done.values())
    shares = [done[p] / total for p in (0, 1, 2)]
    for share, speed in zip(shares, (1.0, 0.6, 0.3), strict=True):
        assert share == pytest.approx(speed / 1.9, abs=0.03)
    # no node ever ran dry after the start, and the slow one holds the fewest tasks
    for p in (0, 1, 2):
        assert min(seen[p][10:]) >= 1
    late = slice(len(seen[0]) // 2, None)
    assert sum(seen[2][late]) < sum(seen[1][late]) < sum(seen[0][late])


def test_a_node_that_starts_late_is_not_starved_when_tasks_are_scarce():
    # tasks arrive at half what the three nodes could do; the fastest starts 10 s late
    done, _ = simulate({0: 1.0, 1: 0.6, 2: 0.3}, supply_per_s=9.5, starts={0: 10.0})
    assert done[0] > 0.7 * done[1] and min(done[0], done[1]) > done[2] > 0, done
    # with tasks enough, it catches up to the share of its speed after its late start
    done, _ = simulate({0: 1.0, 1: 0.6, 2: 0.3}, starts={0: 10.0})
    assert done[0] > done[1] > done[2] and done[0] > 0.9 * 1.0 / 0.1 * 110, done


def test_a_slow_node_is_capped_at_what_it_rolls_out_in_the_targets_time():
    t = LagTargets({"g": 2}, {"actor": 4}, poll_interval_s=0.5)
    assert t.partition_caps("g") == {}  # nothing measured yet
    for i in range(1, 21):  # partition 0 busy at 10 tasks/s; 1 busy at 0.5/s; 1 version/s
        now = i * 0.5
        t.observe(now, {"g": {0: int(10 * now), 1: int(0.5 * now)}}, {"g": {0: 3, 1: 3}},
                  {"actor": int(now)})
    caps = t.partition_caps("g")
    # the target stands for the staleness budget's work: 4 versions at 1 version/s,
    # halved, 2 s
    horizon = t.target("g") / t.rate("g")
    assert horizon == pytest.approx(2.0, rel=0.15)
    assert caps[1] == 2  # 0.5/s x 2 s = 1, at least a task running and one waiting
    assert caps[0] == pytest.approx(10 * horizon, abs=2)
    assert sum(caps.values()) >= t.target("g")  # the caps never hold the target back
    # routing stops at the caps: the slow node takes nothing more, the rest waits
    picks = route_by_wait({0: caps[0], 1: 2}, t.partition_rates("g"), 10, caps=caps)
    assert picks == []


def test_a_burst_does_not_stay_queued_at_a_slow_node_while_a_fast_one_idles():
    # a fast node (100 tasks/s, draining its queue between two reads, so never measured
    # busy) shares the group with one 30x slower; the target jumps for a second (as when
    # throughput is first measured on a burst) and falls back. Without caps the slow node,
    # measured while the fast one is not, is taken to be as fast as any, gets half the
    # burst, and holds it, counted against the target, while the fast node idles.
    def spike(t: float, target: int) -> int:
        return 400 if 3.0 <= t < 4.0 else target

    speeds = {0: 10.0, 1: 1 / 3}
    alone, _ = simulate({0: 10.0}, target_at=spike)
    done, seen = simulate(speeds, target_at=spike)
    assert done[0] > 0.95 * alone[0] and max(seen[1]) <= 10, (done, alone, max(seen[1]))
    done, seen = simulate(speeds, target_at=spike, caps=False)
    assert done[0] < 0.6 * alone[0] and max(seen[1]) > 100, (done, alone, max(seen[1]))


def test_record_counter_counts_data_records_between_two_committed_offsets():
    from astraflow.dataflow.admission import RecordCounter

    counter = RecordCounter.__new__(RecordCounter)  # the counting, without its consumer
    tp = ("t", 0)
    # data records at 0-4 and 6-8; 5 and 9 are transaction markers; read up to 10
    counter._floor, counter._seen, counter._pos = {tp: 0}, {tp: [0, 1, 2, 3, 4, 6, 7, 8]}, {tp: 10}
    assert counter.between("t", 0, 0, 10) == 8
    assert counter.between("t", 0, 3, 7) == 3  # 3, 4 and 6
    assert counter.between("t", 0, 8, 14) == 1 + 4  # what is unread counts in full
    assert counter.between("t", 0, 5, 5) == 0


def simulate_tail(cap_horizon_s: float | None = None, nodes: int = 8, seconds: float = 120.0,
                  dt: float = 0.05, poll_s: float = 0.5, seed: int = 0,
                  stall: tuple[float, float] = (0.0, 0.0)) -> tuple[int, float, int]:
    """Alike nodes, one per partition, whose tasks take heavy-tailed times (Pareto, minimum
    0.3 s, tail index 1.2, at most 30 s); a version every ``nodes`` tasks done, none
    during ``stall`` (from, to); an admission reading lags every ``poll_s`` and filling up
    to the target within the caps. Returns tasks done, the nodes' idle fraction and the
    most tasks one partition held."""
    rng = random.Random(seed)
    targets = LagTargets({"g": nodes}, {"actor": 4}, poll_interval_s=poll_s,
                         cap_horizon_s=cap_horizon_s)
    queue = dict.fromkeys(range(nodes), 0)
    left = dict.fromkeys(range(nodes), 0.0)  # seconds left of the running task
    done = dict.fromkeys(range(nodes), 0)
    idle, most, t, next_read, versions = 0.0, 0, 0.0, 0.0, 0
    while t < seconds:
        for p in queue:
            if not queue[p]:
                idle += dt
                continue
            if left[p] <= 0:
                left[p] = min(30.0, 0.3 / (1.0 - rng.random()) ** (1 / 1.2))
            left[p] -= dt
            if left[p] <= 0:
                queue[p] -= 1
                done[p] += 1
        if t >= next_read:
            next_read = t + poll_s
            if not stall[0] <= t < stall[1]:
                versions = sum(done.values()) // nodes
            targets.observe(t, {"g": dict(done)}, {"g": dict(queue)}, {"actor": versions})
            room = targets.target("g") - sum(queue.values())
            for p in route_by_wait(queue, targets.partition_rates("g"), max(0, room),
                                   caps=targets.partition_caps("g")):
                queue[p] += 1
            most = max(most, *queue.values())
        t += dt
    return sum(done.values()), idle / (nodes * seconds), most


def test_a_stalled_trainer_does_not_pile_tasks_behind_heavy_tailed_ones():
    # the trainer publishing nothing for 20 s makes the staleness budget in seconds, and
    # so the target, grow; capped only by it, the partitions measured fastest took the
    # burst and their tasks waited behind long ones while other nodes idled (seen in
    # bench/async_vs_sync.py --alpha 1.2: one node busy, seven waiting for a minute)
    for seed in (0, 1, 2):
        steady, _, _ = simulate_tail(seed=seed)
        done, idle, most = simulate_tail(seed=seed, stall=(30.0, 50.0))
        budget, budget_idle, budget_most = simulate_tail(math.inf, seed=seed, stall=(30.0, 50.0))
        assert most <= 5 < 30 < budget_most, (most, budget_most)
        assert idle < 0.01 < 0.05 < budget_idle, (idle, budget_idle)
        assert done >= 0.99 * steady and budget < 0.95 * steady, (done, budget, steady)
