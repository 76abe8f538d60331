"""Note [When to stitch] on synthetic patterns (torchmem/analysis/patterns.py): with the
device far from full, a workload whose working set is stable makes (almost) no
driver calls once warm, never a move (a new granule only when the live set
reaches a new high, as any allocator must); under a tight budget it still fits,
by stitching.

Steady state = the calls made by the second half of the replay (the replay's
own steady_driver_calls, Note [Steady state] in csrc/replay/replay.h; checked
here against the same run stopped halfway)."""

import numpy as np
import pytest

from torchmem.analysis import patterns
from torchmem._loader import _C

STEPS = 60_000


def replay(events, **kwargs):
    return _C.replay(np.asarray(events, dtype=np.int64), "torchmem", capacity=80 << 30, **kwargs)


def driver_calls(result):
    calls = result["backend_calls"]
    return calls["create_calls"] + calls["map_calls"] + calls["unmap_calls"] + calls["release_calls"]


@pytest.mark.parametrize("pattern", patterns.PATTERNS)
def test_stable_working_set_makes_no_driver_calls_once_warm(pattern):
    events = patterns.replay_events(pattern, STEPS, seed=1)
    full = replay(events, event_delay=10)
    half = replay(events, event_delay=10, stop_at=len(events) // 2 - 1)  # events before the halfway one
    assert full["ooms"] == 0 and full["reclaims"] == 0
    steady = driver_calls(full) - driver_calls(half)
    assert full["steady_driver_calls"] == steady
    assert steady <= 1e-3 * STEPS / 2, f"{pattern}: {steady} driver calls in the second half"
    assert full["steady_backend_us"] <= full["modeled_backend_us"]
    for name in ("unmap_calls", "release_calls"):
        assert full["backend_calls"][name] == 0, (pattern, name)


@pytest.mark.parametrize("pattern", patterns.PATTERNS)
def test_tight_budget_still_fits_by_stitching(pattern):
    events = patterns.replay_events(pattern, STEPS, seed=1)
    loose = replay(events)
    limit = int(1.10 * loose["peak_requested"]) // (2 << 20) * (2 << 20) + (4 << 20)
    # Fits by size, stitching what they miss: the tightest packing (backed placement trades
    # some of it for fewer moves; its churn min-cap is held against the expandable model's in
    # tests/test_expandable_model.py).
    tight = _C.replay(np.asarray(events, dtype=np.int64), "torchmem", limit=limit, capacity=80 << 30,
                      pool_config={"backed_fit": False})
    assert tight["ooms"] == 0, (pattern, limit, tight["peak_requested"])
    assert tight["peak_reserved"] <= limit


def test_unknown_pattern_is_refused():
    with pytest.raises(ValueError, match="unknown pattern 'zigzag'"):
        patterns.sizes_and_slots("zigzag", 10)
