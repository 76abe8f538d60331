"""limit_run_granules: short run handles under a limit (Note [Runs under a limit]).

Replays of the bundled traces, whose shapes vary every step, under a budget: with
runs below 95% of the budget capped at 10 granules, the pool makes fewer driver
calls after warm-up than granule-by-granule growth, runs with no OOM, and keeps
its min-cap under the 1.02x goal."""

import pytest

from torchmem.analysis import replay as replay_api
from torchmem.analysis import trace as trace_io
from torchmem.runtime import config

from sim_pool import STITCHING

# Where the pool stitches in the top 5% of its limit and fills fits by size, growth is what
# short runs cut; the defaults (stitch_above_limit=1, backed_fit) are compared to the
# expandable model in tests/test_shapes_that_vary.py.
SHORT_RUNS = {"run_below_limit": 0.95, "limit_run_granules": 10, **STITCHING}


@pytest.mark.parametrize("name", ["gpt2", "llama_ckpt"])
def test_short_runs_cut_the_calls_of_growth_under_a_budget(name):
    trace = trace_io.load(trace_io.bundled_trace(name))
    limit = int(1.12 * trace.peak_requested())
    default = replay_api.replay(trace, "torchmem", limit=limit, config=STITCHING)
    short = replay_api.replay(trace, "torchmem", limit=limit, config=SHORT_RUNS)
    assert default.ooms == 0 and short.ooms == 0
    assert short.steady_driver_calls * 2 <= default.steady_driver_calls, (short.steady_driver_calls,
                                                                          default.steady_driver_calls)


@pytest.mark.parametrize("name", ["gpt2", "kv_generate"])
def test_short_runs_keep_the_min_cap_goal(name):
    found = replay_api.find_min_cap(trace_io.bundled_trace(name), "torchmem", config=SHORT_RUNS)
    assert found["min_cap_ratio"] <= 1.02, found["min_cap_ratio"]


def test_the_option_is_checked_and_off_by_default():
    assert config.Config().limit_run_granules == 0
    assert config.Config(limit_run_granules="10").pool_options()["limit_run_granules"] == 10
    with pytest.raises(ValueError, match="limit_run_granules"):
        config.Config(limit_run_granules=-1)
