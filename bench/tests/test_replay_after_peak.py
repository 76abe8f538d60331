"""bench/replay_after_peak.py: the event it counts from, and its rows, on small made-up traces (CPU)."""

import numpy as np

from bench_support import load_bench
from torchmem.analysis import patterns
from torchmem.analysis import trace as trace_io

replay_after_peak = load_bench("replay_after_peak")

MiB = 1 << 20
A, F = trace_io.ALLOC, trace_io.FREE_REQUESTED


def test_the_peak_is_the_first_event_at_the_largest_live_request():
    events = [
        (A, 0x1000, 4 * MiB, 0),
        (A, 0x2000, 4 * MiB, 0),  # 8 MiB live
        (F, 0x1000, 0, 0),
        (A, 0x3000, 2 * MiB, 0),  # 6 MiB
        (A, 0x4000, 2 * MiB, 0),  # 8 MiB again: not the first time
        (F, 0x9999, 0, 0),  # a free of nothing live changes nothing
    ]
    assert trace_io.peak_requested_at(events) == (1, 8 * MiB)


def test_the_script_prints_a_row_per_budget_and_policy(capsys):
    assert replay_after_peak.main(["vision", "--budgets", "1.05", "1.1", "--configs", "-", "backed_fit=false"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| vision")]
    labels = [row.split("|")[4].strip() for row in rows]
    assert labels == ["torchmem", "torchmem (backed_fit=false)", "expandable"] * 2
    assert all(row.split("|")[8].strip() == "0" for row in rows)  # no OOM at either budget


def test_a_churn_pattern_stands_in_for_a_trace():
    events = replay_after_peak.load_events("pattern:kv_cache:10")
    assert events.dtype == np.int64 and len(events) == 64 + 2 * 10  # 64 live tensors, then an alloc and a free a step
    default = np.asarray(patterns.replay_events("kv_cache", 400))
    assert (replay_after_peak.load_events("pattern:kv_cache") == default).all()
