"""bench/replay_steps.py: per-step costs of a repeated real step. The deltas add up to the
whole replay's, the quiet step is the first of a run of free steps to the end, and the
script prints its table for a bundled trace."""

import numpy as np

from bench_support import load_bench
from torchmem.analysis import patterns, replay
from torchmem.analysis import trace as trace_io

replay_steps = load_bench("replay_steps")


def test_step_deltas_add_up_to_the_whole_replay():
    rows, period = patterns.repeat_last_step(trace_io.load(trace_io.bundled_trace("fsdp_train")).events, 3)
    events = np.asarray(rows, dtype=np.int64)
    whole = replay.replay(events, event_delay=10)
    limit = int(whole.peak_requested * 1.05)
    costs, last = replay_steps.step_costs(events, period, limit)
    full = replay.replay(events, limit=limit, event_delay=10)
    assert len(costs) == len(events) // period
    assert sum(c for c, _, _ in costs) == sum(full.backend_calls[k] for k in replay.VMM_CALL_KINDS)
    assert sum(b for _, b, _ in costs) == full.device_barriers == last.device_barriers


def test_quiet_from_is_the_first_step_of_a_free_run_to_the_end():
    assert replay_steps.quiet_from([(5, 1, 0), (0, 0, 3), (2, 0, 0), (0, 0, 1), (0, 0, 0)]) == 3
    assert replay_steps.quiet_from([(0, 0, 0), (0, 1, 0)]) is None
    assert replay_steps.quiet_from([(0, 0, 0)]) == 0


def test_with_room_to_spare_every_repeated_step_is_quiet():
    """FSDP2's recording run two steps longer at 1.10x its peak request: the pool holds its
    layout with no plan, so the repeated steps make no call and take no barrier; the growth
    came before them."""
    rows, period = patterns.repeat_last_step(trace_io.load(trace_io.bundled_trace("fsdp_train")).events, 2)
    events = np.asarray(rows, dtype=np.int64)
    peak = replay.replay(events, event_delay=10).peak_requested
    costs, last = replay_steps.step_costs(events, period, int(1.10 * peak))
    quiet = replay_steps.quiet_from(costs)
    assert quiet is not None and quiet <= len(costs) - 2 and last.ooms == 0
    assert sum(c for c, _, _ in costs) > 0


def test_the_table_for_a_bundled_trace(capsys):
    assert replay_steps.main(["fsdp_train", "--repeats", "2", "--budgets", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fsdp_train: 6 steps of 10544 events")
    assert "| none |" in out


def test_host_time_column_is_a_positive_time_per_allocation(capsys):
    """--host-time adds the replay's host microseconds per allocation of the repeated step: a
    positive figure (the extra steps cost time), and of the order of a microsecond, not of a step."""
    assert replay_steps.main(["fsdp_train", "--repeats", "2", "--budgets", "0", "--host-time"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].endswith("| host us per allocation |")
    us = float(lines[-1].split("|")[-2])
    assert 0 < us < 50
