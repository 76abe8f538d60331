"""The pool's budget at its edges (csrc/core/pool.h): bytes held outside the pool that count
against it (Note [Foreign bytes]), a device with less room than the budget (Note [Device
room], detail/granules.cpp), and allocation from cached memory alone (allocate_cached, the
use_on_oom lenders of Note [External pool allocators])."""

import pytest

from torchmem._loader import _C

MiB = 1 << 20


def make(limit=0, capacity=1 << 30, vmm=True, **config):
    sim = _C.SimBackend(capacity=capacity, vmm=vmm)
    pool = _C.Pool(sim, dict(dict(stitch_above=0.0, stitch_above_limit=0.0, backed_fit=False, run_below=0.0), **config, limit_bytes=limit))
    return sim, pool


@pytest.mark.parametrize("vmm", [True, False])
def test_foreign_bytes_count_against_the_budget(vmm):
    # Note [Foreign bytes]: a MemPool(allocator=X)'s segments share the device's budget
    _, pool = make(limit=32 * MiB, vmm=vmm)
    pool.set_foreign_bytes(24 * MiB)
    small = pool.allocate(6 * MiB)
    assert small  # 6 of the 8 MiB left
    assert pool.allocate(6 * MiB) == 0  # 12 > 8: out, though the pool itself holds 6 MiB of 32
    pool.set_foreign_bytes(40 * MiB)  # more than the limit: nothing new fits
    assert pool.allocate(512) == 0
    pool.set_foreign_bytes(0)
    assert pool.allocate(6 * MiB)  # the whole budget is the pool's again
    assert pool.limit() == 32 * MiB  # the limit itself is untouched
    pool.free(small)
    pool.check_invariants()


def test_foreign_bytes_do_not_matter_without_a_limit():
    _, pool = make(capacity=64 * MiB)
    pool.set_foreign_bytes(1 << 40)  # the device's free memory already tells, so no effect
    assert pool.allocate(16 * MiB)
    pool.check_invariants()


def _device_shared_with_a_neighbour():
    # No limit: the budget is the device's 1 GiB, of which another pool (process) holds 400 MiB
    sim = _C.SimBackend(capacity=1 << 30, vmm=True)
    pool = _C.Pool(sim, dict(stitch_above=0.0, stitch_above_limit=0.0, backed_fit=False, run_below=0.0))
    neighbour = _C.Pool(sim, dict(run_below=0.0))
    return sim, pool, neighbour, neighbour.allocate(400 * MiB)


def test_a_request_the_device_cannot_back_fails_before_creating_granules():
    # Note [Device room]: the budget has room for 400 MiB more, the device only 324 MiB
    sim, pool, neighbour, other = _device_shared_with_a_neighbour()
    a = pool.allocate(300 * MiB)
    before = dict(sim.counters())
    assert pool.allocate(400 * MiB) == 0
    after = sim.counters()
    assert after["create_calls"] == before["create_calls"]  # nothing created only to be given back
    assert after["release_calls"] == before["release_calls"]
    assert pool.stats()["num_ooms"] == 1
    b = pool.allocate(300 * MiB)  # what the device can back still comes
    assert b
    for addr in (a, b):
        pool.free(addr)
    neighbour.free(other)
    pool.check_invariants()


def test_a_device_short_of_room_is_covered_by_stitching_the_cache():
    sim, pool, neighbour, other = _device_shared_with_a_neighbour()
    pool.free(pool.allocate(300 * MiB))  # 300 MiB cached, 324 MiB left on the device
    b = pool.allocate(400 * MiB)  # 200 granules: the device's 162 are not enough alone
    assert b and pool.stats()["num_ooms"] == 0
    assert sim.device_used() <= 1 << 30
    pool.free(b)
    neighbour.free(other)
    pool.check_invariants()


@pytest.mark.parametrize("vmm", [True, False])
def test_allocate_cached_takes_a_cached_block_or_nothing(vmm):
    # a use_on_oom lender (Note [External pool allocators]): never new memory, never its ladder
    sim, pool = make(vmm=vmm)
    assert pool.allocate_cached(4 * MiB) == 0
    assert sim.counters()["create_calls"] == 0 and sim.counters()["segment_alloc_calls"] == 0
    a = pool.allocate(40 * MiB)
    pool.free(a)
    before = dict(sim.counters())
    b = pool.allocate_cached(30 * MiB)
    assert b == a  # the cached block, split
    assert pool.allocate_cached(30 * MiB) == 0  # 10 MiB left: nothing, and the cache stays
    after = sim.counters()
    for name in ("create_calls", "release_calls", "segment_alloc_calls", "segment_free_calls", "unmap_calls"):
        assert after[name] == before[name], name
    assert pool.stats()["num_ooms"] == 0 and pool.stats()["num_alloc_retries"] == 0
    pool.free(b)
    pool.check_invariants()
