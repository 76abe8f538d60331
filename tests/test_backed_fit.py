"""backed_fit: a fit that misses granules under a limit moves to where cached granules
already back the request (Note [Backed placement], csrc/core/detail/placement.cpp).

Replays of the bundled traces, whose shapes vary every step, under a budget: with the
option on, the pool makes far fewer driver calls after warm-up and runs with no OOM;
with every check of the pool's invariants after each operation, a churn of mixed sizes
under a tight limit keeps them (the option splits free blocks in their middle)."""

import numpy as np
import pytest

from torchmem.analysis import patterns
from torchmem.analysis import replay as replay_api
from torchmem.analysis import trace as trace_io
from torchmem.runtime import config

from sim_pool import STITCHING, make_pool

# Stitching in the top 5% of the limit, with and without backed placement: what the option
# changes where the pool stitches. The defaults (stitch_above_limit=1, backed_fit on) are held
# against the expandable model in tests/test_shapes_that_vary.py.
BY_SIZE = STITCHING
BACKED = {**STITCHING, "backed_fit": True}


@pytest.mark.parametrize("name, budget", [("gpt2", 1.06), ("llama_ckpt", 1.03), ("llama_ckpt", 1.12)])
def test_backed_placement_cuts_the_calls_of_stitching_under_a_budget(name, budget):
    trace = trace_io.load(trace_io.bundled_trace(name))
    limit = int(budget * trace.peak_requested())
    default = replay_api.replay(trace, "torchmem", limit=limit, event_delay=10, config=BY_SIZE)
    backed = replay_api.replay(trace, "torchmem", limit=limit, event_delay=10, config=BACKED)
    assert default.ooms == 0 and backed.ooms == 0
    assert backed.steady_driver_calls * 3 <= default.steady_driver_calls * 2, (backed.steady_driver_calls,
                                                                               default.steady_driver_calls)
    assert backed.peak_reserved <= limit


@pytest.mark.parametrize("pattern", patterns.PATTERNS)
def test_backed_placement_keeps_the_invariants_under_a_tight_limit(pattern):
    # Every check of the pool's invariants after each operation, down to budgets where
    # requests fail: a window found inside a free block must not split it unless the
    # request is served (a failed one leaves the free blocks merged as they were).
    checked = {"backed_fit": True, "debug_checks": True}
    for seed in range(4):
        events = np.asarray(patterns.replay_events(pattern, 300, seed=seed), dtype=np.int64)
        peak = replay_api.replay(events).peak_requested
        for budget in (1.02, 1.05, 1.1, 1.25):
            result = replay_api.replay(events, limit=int(budget * peak), event_delay=5 * (seed % 3), config=checked)
            assert result.peak_reserved <= int(budget * peak)


def test_backed_placement_keeps_the_invariants_with_a_side_stream():
    checked = {"backed_fit": True, "debug_checks": True}
    for seed in range(3):
        events = np.asarray(patterns.training_steps(4, layers=6, seed=seed, side_stream=7), dtype=np.int64)
        peak = replay_api.replay(events).peak_requested
        for budget in (1.02, 1.05, 1.1):
            result = replay_api.replay(events, limit=int(budget * peak), event_delay=10, config=checked)
            assert result.peak_reserved <= int(budget * peak)


def test_moves_are_counted_and_stitch_less():
    # the counter (torchmem.num_backed_moves in memory_stats) says the option acted
    events = patterns.replay_events("periodic", 200, seed=1)
    peak = replay_api.replay(np.asarray(events, dtype=np.int64)).peak_requested
    limit = int(1.25 * peak) // (2 << 20) * (2 << 20)
    stats = {}
    for backed in (False, True):
        pool = make_pool(limit=limit, event_delay=10, **{**STITCHING, "backed_fit": backed})
        ours = {}
        for action, addr, size, stream in events:
            if action == trace_io.ALLOC:
                ours[addr] = pool.allocate(size, stream)
                assert ours[addr]
            elif addr in ours:
                pool.free(ours.pop(addr))
        pool.check_invariants()
        stats[backed] = pool.stats()
    assert stats[False]["num_backed_moves"] == 0
    assert stats[True]["num_backed_moves"] > 0
    assert stats[True]["num_reclaims"] < stats[False]["num_reclaims"]


def test_the_option_is_checked_and_on_by_default():
    assert config.Config().backed_fit is True
    assert config.Config(backed_fit="false").pool_options()["backed_fit"] is False
    with pytest.raises(ValueError, match="backed_fit"):
        config.Config(backed_fit="sometimes")
