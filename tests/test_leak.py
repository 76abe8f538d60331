"""leak_check on a simulated pool: catches planted leaks, passes clean loops, never hides the body's error."""

import pytest

import torchmem
from torchmem.runtime.leak import LeakError
from torchmem.runtime.snapshots import capture_stack
from sim_pool import MiB, make_pool


def _step(pool, leak=None):
    temps = [pool.allocate(size, 0, 0, capture_stack()) for size in (4 * MiB, 1000, 7 * MiB)]
    if leak is not None:
        leak.append(pool.allocate(3 * MiB + 1, 0, 0, capture_stack()))
    for addr in temps:
        pool.free(addr)


@pytest.mark.parametrize("trace_capacity", [10_000, 0], ids=["with-trace", "without-trace"])
def test_clean_loop_passes(trace_capacity):
    pool = make_pool(trace_capacity=trace_capacity)
    long_lived = pool.allocate(2 * MiB)
    with torchmem.leak_check(pool=pool) as report:
        for _ in range(5):
            _step(pool)
    assert report.checked and not report and report.leaked_bytes == 0
    assert pool.block_size(long_lived)


@pytest.mark.parametrize("trace_capacity", [10_000, 0], ids=["with-trace", "without-trace"])
def test_planted_leak_is_caught_with_its_stack(trace_capacity):
    pool = make_pool(trace_capacity=trace_capacity)
    pool.allocate(MiB)  # the trace reaches back to the check's entry only if it is not empty there
    leaked = []
    with pytest.raises(LeakError) as info:
        with torchmem.leak_check(pool=pool):
            for _ in range(3):
                _step(pool, leak=leaked)
    report = info.value.report
    assert isinstance(info.value, RuntimeError)
    assert sorted(block.address for block in report.leaks) == sorted(leaked)
    assert report.leaked_bytes == 3 * (3 * MiB + 1)
    assert report.used_trace == (trace_capacity > 0)
    assert all(block.frames and block.frames[0]["name"] == "_step" for block in report.leaks)
    assert "3 allocation(s)" in str(info.value) and "_step" in str(info.value)


def test_address_reuse_inside_the_block_is_still_a_leak_with_the_trace():
    pool = make_pool()
    old = pool.allocate(4 * MiB)
    with torchmem.leak_check(pool=pool, action="ignore") as report:
        pool.free(old)
        new = pool.allocate(4 * MiB)  # best fit hands back the same address
    assert [block.address for block in report.leaks] == [new]


def test_warn_mode_and_min_bytes():
    pool = make_pool()
    with pytest.warns(RuntimeWarning, match="still alive"):
        with torchmem.leak_check(pool=pool, action="warn"):
            pool.allocate(8 * MiB)
    with torchmem.leak_check(pool=pool, min_bytes=1 * MiB) as report:
        pool.allocate(1000)
    assert not report


def test_the_body_exception_is_not_masked():
    pool = make_pool()
    with pytest.raises(KeyError):
        with torchmem.leak_check(pool=pool) as report:
            pool.allocate(MiB)
            raise KeyError("body")
    assert report.leaks, "the report is still filled in"


def test_bad_action():
    with pytest.raises(ValueError, match="action"):
        torchmem.leak_check(action="explode")
