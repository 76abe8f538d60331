"""bench/cache_probe.py's arithmetic and inputs (its callgrind runs take minutes: run by hand)."""

import numpy as np

from bench_support import load_bench

probe = load_bench("cache_probe")

SUMMARY = """==1== Events    : Ir Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw
==1== I   refs:      165,607,071
==1== D   refs:       53,644,083  (40,377,487 rd + 13,266,596 wr)
==1== D1  misses:      1,511,305  ( 1,440,651 rd +     70,654 wr)
"""


def test_totals_reads_instructions_and_l1_misses_from_callgrinds_summary():
    assert probe.totals(SUMMARY) == (165_607_071, 1_511_305)


def test_a_steady_allocation_is_the_difference_of_two_lengths_over_the_allocations_added():
    assert probe.per_allocation((100, 10), (1100, 60), 50) == (20.0, 1.0)


def test_the_events_repeat_one_real_step(tmp_path):
    path, more = str(tmp_path / "events.bin"), str(tmp_path / "more.bin")
    short = probe.write_events("llama_ckpt_train", 10, 2, path)
    long = probe.write_events("llama_ckpt_train", 10, 3, more)
    assert short == int((probe.load_events(path)[:, 0] == 0).sum())
    assert long > short and probe.peak_request(more) == probe.peak_request(path)  # one more step, the same peak


def test_timed_prints_the_pools_own_time_per_allocation(capsys):
    """--timed replays with time_host_ops: every cell is a measured time, the plan's part 0 with no limit.
    A pool that stitches near its limit plans the step (the defaults keep it quiet without a plan)."""
    assert probe.main(["--timed", "--evict-mib", "0", "--budgets", "0", "1.10", "--step", "10",
                       "--config", "stitch_above_limit=0.95,backed_fit=false"]) == 0
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "MiB" in line]
    assert len(rows) == 2
    unlimited, budget = ([float(c.replace(",", "")) for c in row.split("|")[3:6]] for row in rows)
    assert unlimited[0] > 0 and unlimited[1] > 0 and unlimited[2] == 0
    # a plan in force at 1.10x: its host time is measured (a difference of two runs' times,
    # which noise may make negative), where with no limit there is none (exactly 0)
    assert budget[2] != 0
