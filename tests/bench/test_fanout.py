"""bench/fanout.py: its percentiles, /proc parsing, byte accounting and verdicts (no Kafka)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.conftest import load_bench

bench = load_bench("fanout")


def test_percentile_interpolates_between_ranks():
    assert bench.percentile([3.0], 50) == 3.0
    assert bench.percentile([4.0, 1.0, 3.0, 2.0], 50) == 2.5
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 100) == 5.0
    assert bench.percentile([1.0, 2.0, 3.0, 4.0, 5.0], 0) == 1.0
    assert bench.percentile([0.0, 10.0], 90) == pytest.approx(9.0)
    with pytest.raises(ValueError):
        bench.percentile([], 50)


def test_cpu_seconds_from_proc_stat_with_a_command_name_holding_spaces():
    # fields 14 and 15 (utime, stime) count after the parenthesised name
    fields = ["S", "1", "1", "1", "0", "-1", "4194560", "10", "0", "0", "0", "250", "50"]
    text = "4242 (java (a b)) " + " ".join(fields + ["0"] * 30)
    assert bench.proc_cpu_seconds(text, 100) == pytest.approx(3.0)
    own = Path(f"/proc/{os.getpid()}/stat").read_text()
    assert bench.proc_cpu_seconds(own, os.sysconf("SC_CLK_TCK")) > 0


def test_io_counter_is_read_by_name():
    text = "rchar: 10\nwchar: 2048\nsyscr: 3\n"
    assert bench.proc_io_field(text, "wchar") == 2048
    with pytest.raises(KeyError, match="read_bytes"):
        bench.proc_io_field(text, "read_bytes")


def test_machine_busy_counts_idle_and_iowait_as_not_busy():
    before = "cpu  100 0 100 800 0 0 0 0 0 0"
    after = "cpu  250 0 150 900 100 0 0 0 0 0"  # 200 busy, 200 idle or waiting
    assert bench.machine_busy(before, after) == pytest.approx(0.5)
    assert bench.machine_busy(before, before) == 0.0


def test_amplification_is_bytes_served_over_what_the_followers_need():
    assert bench.amplification(4_000_000, 4, 1_000_000) == 1.0
    assert bench.amplification(6_000_000, 4, 1_000_000) == 1.5
    assert bench.amplification(0, 0, 1_000_000) == 0.0


def test_growth_is_superlinear_only_when_time_outgrows_n_at_the_largest_n():
    ns = [1, 4, 16, 64]
    assert bench.growth_verdict(ns, [1.0, 1.3, 2.5, 7.3]) == \
        "linear or better (time x2.9 for x4 followers)"
    assert bench.growth_verdict(ns, [1.0, 1.3, 3.7, 30.0]).startswith("superlinear (time x8.1")
    assert bench.growth_verdict(ns, [0.4, 0.2, 0.2, 0.8]).startswith("linear or better")
    assert bench.growth_verdict([4], [1.0]) == "too few points"


def _row(brokers, n, fetched_max, busy=0.1, host=0.5, variant="baseline"):
    return {"brokers": brokers, "variant": variant, "followers": n,
            "fetched_max_s": fetched_max, "broker_busy_max": busy, "machine_busy": host}


def test_saturation_notes_name_the_saturated_broker_and_which_cluster_gave_out_first():
    rows = [_row(1, 4, 0.2), _row(1, 64, 4.0, busy=0.95), _row(3, 64, 1.0, host=0.97),
            _row(3, 64, 0.5, variant="rack-fetch")]
    notes = bench.saturation_notes(rows)
    assert any("1 broker(s), baseline, N=64: a broker used 0.95 cores" in n for n in notes)
    assert "in 1 of 4 rows the machine's CPUs were at least 97% busy" in notes[1]
    assert notes[-1].endswith("a single broker saturates first")
    idle = bench.saturation_notes([_row(1, 64, 1.0, busy=0.2), _row(3, 64, 0.5)])
    assert idle[-1].endswith("three were faster, yet the single broker used 0.20 cores at "
                             "most: not a broker limit")
    same = bench.saturation_notes([_row(1, 64, 1.0), _row(3, 64, 0.9)])
    assert same == ["N=64: fetched by all in 1.00s on 1 broker, 0.90s on 3: one broker is "
                    "not the bottleneck (three fetch no faster)"]


def test_summary_accounts_bytes_and_times_per_version():
    p = bench.Phase(1, "baseline", 2)
    p.published = {1: 100.0, 2: 200.0}
    p.blob_bytes, p.sparsity, p.publish_s = [1_000_000, 1_000_000], [0.99, 0.99], [0.5, 0.5]
    # (kind, follower, version, seen, fetched, held, apply s, bytes)
    p.records = [("held", 0, 1, 100.0, 100.5, 101.0, 0.4, 1_000_100),
                 ("held", 1, 1, 100.0, 101.0, 101.5, 0.4, 1_000_100),
                 ("held", 0, 2, 200.0, 200.5, 201.0, 0.4, 1_000_100),
                 ("held", 1, 2, 200.0, 201.0, 202.0, 0.4, 1_000_100)]
    p.broker_cpu_s, p.broker_wchar, p.window_s = [1.2], [5_000_000], 4.0
    p.broker_idle_cpu_s = [0.2]  # 0.05 CPU-s a second while idle, over the 4 s
    p.loopback_s = [0.01, 0.02, 0.01, 0.02]
    row = bench.summarize(p)
    assert row["served_bytes_per_version"] == 2_000_200
    assert row["amplification"] == pytest.approx(1.0001)
    assert (row["fetched_max_s"], row["held_max_s"]) == (1.0, 2.0)
    assert row["fetched_p50_s"] == 0.75
    assert row["broker_cpu_s_per_version"] == pytest.approx(0.5)
    assert row["broker_cpu_raw_s_per_version"] == pytest.approx(0.6)
    assert row["broker_busy_max"] == pytest.approx(0.3)
    assert row["aggregate_mb_s"] == pytest.approx(2.0002)  # 2 MB in 1 s a version
    assert row["broker_mb_per_cpu_s"] == pytest.approx(4.0004)
    assert row["loopback_max_s"] == 0.02
    assert "served MB/v" in bench.table([row]).splitlines()[0]


def test_remedies_run_at_the_largest_n_and_rack_fetch_only_on_three_brokers():
    one = bench.phases_for(1, [1, 4], remedies=True)
    assert [(p.variant, p.followers, p.apply) for p in one] == [
        ("baseline", 1, True), ("baseline", 4, True), ("fetch-only", 4, False),
        ("partitions3", 4, False), ("fetch32MiB", 4, False)]
    three = bench.phases_for(3, [2], remedies=True)
    assert [p.variant for p in three][-1] == "rack-fetch" and three[-1].rack
    assert [p.variant for p in bench.phases_for(3, [2], remedies=False)] == ["baseline"]
    fetch_only = bench.phases_for(1, [4], remedies=True, apply=False)
    assert [p.variant for p in fetch_only] == ["baseline", "partitions3", "fetch32MiB"]
    assert not any(p.apply for p in fetch_only)


def test_loopback_copy_delivers_every_byte_to_every_socket():
    sent: list[bytes] = []

    def send(conn, payload):
        sent.append(payload)
        conn.sendall(payload)

    times = bench.loopback_copy(1 << 20, 3, send=send)
    assert len(times) == 3 and all(t > 0 for t in times)
    assert [len(p) for p in sent] == [1 << 20] * 3  # each socket was sent the whole payload


@pytest.mark.parametrize("send, got", [
    (lambda conn, payload: conn.sendall(payload[:-1]), (1 << 16) - 1),  # one byte short
    (lambda conn, payload: conn.sendall(bytes([payload[0] ^ 1]) + payload[1:]), 1 << 16),
])
def test_loopback_copy_refuses_a_short_or_altered_delivery(send, got):
    with pytest.raises(RuntimeError, match=rf"3 of 3 sockets did not receive the 65536 bytes "
                                           rf"sent \(one got {got} bytes"):
        bench.loopback_copy(1 << 16, 3, send=send)


def test_bad_flags_fail_naming_the_flag(capsys):
    with pytest.raises(SystemExit):
        bench.parse_args(["--brokers", "2"])
    assert "--brokers" in capsys.readouterr().err


def test_marginal_broker_cost_is_the_slope_of_cpu_over_bytes_served():
    assert bench.linear_fit([0.0, 1.0, 2.0], [1.0, 3.0, 5.0]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError):
        bench.linear_fit([1.0, 1.0], [1.0, 2.0])
    rows = [{"brokers": 1, "variant": "baseline", "followers": n,
             "served_bytes_per_version": n * 2e6, "broker_cpu_s_per_version": 0.1 + 0.004 * n}
            for n in (1, 4, 16)]
    (note,) = bench.marginal_notes(rows + [{**rows[0], "variant": "rack-fetch"}])
    assert note == ("1 broker(s): broker CPU a version = 0.100s + 2.00 ms per MB served: "
                    "500 MB served per broker CPU-second at the margin")
