"""torchmem.runtime.probe refuses counts that measure nothing, before it touches the GPU
(its measurements run on the GPU: tests/gpu/test_gpu_surface.py)."""

import pytest

from torchmem.runtime import probe


@pytest.mark.parametrize("repeats,granules", [(0, 1), (1, 0), (-3, 2)])
def test_driver_costs_names_the_count_that_is_wrong(repeats, granules):
    with pytest.raises(ValueError, match=rf"repeats \({repeats}\) and granules \({granules}\)"):
        probe.driver_costs(0, repeats=repeats, granules=granules)


@pytest.mark.parametrize("live,evict", [(-1, 0), (0, -64)])
def test_driver_costs_names_the_condition_that_is_wrong(live, evict):
    with pytest.raises(ValueError, match=rf"live_granules \({live}\) and evict_bytes \({evict}\)"):
        probe.driver_costs(0, live_granules=live, evict_bytes=evict)


def test_allocation_pair_ns_needs_at_least_one_iteration():
    with pytest.raises(ValueError, match=r"iterations \(0\) must be at least 1"):
        probe.allocation_pair_ns(0, iterations=0)
