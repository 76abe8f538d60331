"""bench/offload_timeline.py's per-step summary of the moved tensors
(summarize_moved), on worked numbers; CPU only. The bench is a script, imported
by path; it imports torch only in main()."""

import pytest

from bench_support import load_bench

GiB = 1 << 30
bench = load_bench("offload_timeline")


def record(save, out_end, issue, in_end, need, resume, nbytes=GiB // 2, urgent=False):
    return {"bytes": nbytes, "save": save, "out_end": out_end, "fetch_issue_gpu": issue,
            "fetch_issue_host": issue - 1.0 if issue is not None else None, "in_end": in_end,
            "need": need, "resume": resume, "urgent": urgent}


def test_two_moved_tensors():
    # Forward ends at 12 ms; the first copy out ends before, the second after it.
    records = [record(1.0, 10.0, 20.0, 30.0, 40.0, 40.01),
               record(2.0, 21.0, 25.0, 45.0, 35.0, 45.2, urgent=True)]
    s = bench.summarize_moved(records, 12.0)
    assert s["moved"] == 2 and s["moved_bytes"] == GiB
    assert s["first_save_ms"] == 1.0 and s["last_out_end_ms"] == 21.0
    assert s["out_gbps"] == pytest.approx(GiB / 0.020 / 1e9)
    assert s["out_done_at_fwd_end"] == GiB // 2
    assert s["first_fetch_issue_gpu_ms"] == 20.0 and s["first_fetch_issue_host_ms"] == 19.0
    assert s["last_in_end_ms"] == 45.0 and s["first_need_ms"] == 35.0
    assert s["stall_ms"] == pytest.approx(0.01 + 10.2)
    assert s["stalled"] == 1  # 10 us is not counted as a stall, 10.2 ms is
    assert s["urgent"] == 1


def test_a_tensor_never_fetched_nor_needed():
    # A step cut short (an exception in backward): moved out, never back.
    s = bench.summarize_moved([record(1.0, 5.0, None, None, None, None)], 12.0)
    assert s["last_in_end_ms"] is None and s["first_need_ms"] is None
    assert s["stall_ms"] == 0 and s["stalled"] == 0 and s["urgent"] == 0


def test_nothing_moved():
    assert bench.summarize_moved([], 12.0) == {"moved": 0}
