"""Same-stream alias reclaim and lazy unmaps (Note [Alias reclaim], csrc/core/detail/aliases.cpp).

A granule freed on stream S whose fence is still pending may be stitched into
a new block on S at once: its handle is mapped at the new address too, and the
old address is unmapped later, behind a device barrier (Note [Pending unmaps]:
a fence on S is not enough, another stream may still read there). These
scenarios run on
a sim backend whose events never complete by polling (event_delay=10**9), the
extreme of a GPU that lags behind the host."""

import pytest

from torchmem._loader import _C

MiB = 1 << 20
NEVER = 10**9


def make(limit=0, capacity=64 * MiB, event_delay=NEVER, host_memory=False, **config):
    sim = _C.SimBackend(capacity=capacity, event_delay=event_delay, host_memory=host_memory)
    pool = _C.Pool(sim, dict(dict(stitch_above=0.0, stitch_above_limit=0.0, backed_fit=False, run_below=0.0), **config, limit_bytes=limit, debug_checks=True))
    return sim, pool


def stitch_scene(pool, stream=1, other=1):
    """a (4 granules) freed, b live after it; a 10 MiB request needs 5 new granules."""
    a = pool.allocate(8 * MiB, stream=stream)
    b = pool.allocate(8 * MiB, stream=stream)
    pool.free(a)
    c = pool.allocate(10 * MiB, stream=other)
    return a, b, c


def test_same_stream_aliases_pending_granules():
    sim, pool = make(limit=40 * MiB)
    a, b, c = stitch_scene(pool)
    assert c
    s = pool.stats()
    # One granule created within held <= in use, four aliased from a's hole.
    assert s["num_reclaims"] == 4
    assert s["backend"]["create_calls"] == 9
    assert s["backend"]["unmap_calls"] == 0          # old places pending, fences not done
    assert s["backend"]["map_calls"] == 8 + 1 + 4    # handles mapped at their second place
    assert s["reserved_bytes"]["all"]["current"] == 18 * MiB  # each handle counted once
    assert s["reserved_bytes"]["all"]["peak"] == 18 * MiB
    assert sim.device_used() == 18 * MiB
    assert a not in [seg["address"] for seg in pool.snapshot()["segments"]]
    pool.check_invariants()
    # empty_cache takes one device barrier and finishes the pending unmaps.
    pool.release_cached()
    s = pool.stats()
    assert s["backend"]["unmap_calls"] == 4
    assert s["backend"]["device_sync_calls"] == 1
    pool.check_invariants()


def test_alias_reclaim_off_creates_instead():
    sim, pool = make(limit=40 * MiB, alias_reclaim=False)
    assert stitch_scene(pool)[2]
    s = pool.stats()
    assert s["num_reclaims"] == 0 and s["backend"]["create_calls"] == 13
    assert sim.device_used() == 26 * MiB


def test_other_stream_needs_the_completed_fence():
    sim, pool = make(limit=40 * MiB)
    assert stitch_scene(pool, stream=1, other=2)[2]
    s = pool.stats()
    assert s["num_reclaims"] == 0 and s["backend"]["create_calls"] == 13
    pool.check_invariants()


def test_granule_freed_on_two_streams_is_not_aliased():
    sim, pool = make()
    x = pool.allocate(3 * MiB, stream=1)   # granules 0-1
    y = pool.allocate(3 * MiB, stream=2)   # granules 1-2 (shares granule 1 with x)
    pool.allocate(2 * MiB, stream=1)       # granule 3, stays live
    pool.free(x)                           # granule 0: stream 1 only
    pool.free(y)                           # granule 1: streams 1 and 2; granule 2: stream 2 only
    assert pool.allocate(8 * MiB, stream=2)
    s = pool.stats()
    # Three granules created (held <= in use), one aliased: granule 2, not 1.
    assert s["num_reclaims"] == 1
    assert s["backend"]["create_calls"] == 4 + 3
    pool.check_invariants()


def test_small_heap_granules_are_not_aliased():
    sim, pool = make()
    pool.free(pool.allocate(512 * 1024, stream=1))  # a small-heap page, emptied on stream 1
    assert pool.allocate(2 * MiB, stream=1)         # large heap: needs one granule
    s = pool.stats()
    assert s["num_reclaims"] == 0 and s["backend"]["create_calls"] == 2
    pool.check_invariants()


def test_aliased_handle_shares_bytes_and_keeps_live_data():
    sim, pool = make(limit=40 * MiB, host_memory=True)
    a = pool.allocate(8 * MiB, stream=1)
    b = pool.allocate(8 * MiB, stream=1)
    sim.write_pattern(a, 8 * MiB, 1)
    sim.write_pattern(b, 8 * MiB, 2)
    pool.free(a)
    c = pool.allocate(10 * MiB, stream=1)
    assert pool.stats()["num_reclaims"] == 4
    # The old place is still mapped in the backend and shows a's old bytes
    # until c writes through the new place: the same physical memory.
    assert sim.check_pattern(a, 2 * MiB, 1)
    sim.write_pattern(c, 10 * MiB, 3)
    assert not sim.check_pattern(a, 2 * MiB, 1)
    assert sim.check_pattern(b, 8 * MiB, 2)
    assert sim.check_pattern(c, 10 * MiB, 3)
    pool.release_cached()
    assert sim.check_pattern(b, 8 * MiB, 2) and sim.check_pattern(c, 10 * MiB, 3)
    pool.check_invariants()


def test_best_fit_over_a_pending_place_gives_way_to_one_that_needs_no_wait():
    sim, pool = make(limit=40 * MiB)
    a, b, c = stitch_scene(pool)
    # a's hole is the best fit, but its granules are pending unmap with the
    # barrier not taken yet: mapping there would wait for the whole device, so
    # the next fit (the tail) wins.
    d = pool.allocate(8 * MiB, stream=1)
    assert d and d != a
    s = pool.stats()
    assert s["backend"]["unmap_calls"] == 0 and s["backend"]["device_sync_calls"] == 0
    pool.check_invariants()


def test_mapping_at_a_pending_place_waits_for_the_device():
    sim, pool = make()
    pool.create_private_pool(7)
    x = pool.allocate(8 * MiB, stream=1)          # large heap, granules 0-3
    pool.free(x)                                  # all of it merges into the tail
    assert pool.allocate(8 * MiB, stream=1, pool=7)  # aliases granules 0-3 away
    assert pool.stats()["num_reclaims"] == 4
    # The large heap's only free block starts on the pending places: no fit
    # avoids them, so the pool takes a device barrier, unmaps, then maps.
    assert pool.allocate(4 * MiB, stream=1) == x
    s = pool.stats()
    assert s["backend"]["device_sync_calls"] == 1
    assert s["backend"]["unmap_calls"] >= 2
    pool.check_invariants()


def test_completed_fences_do_not_retire_pending_places():
    # The free's own fence completing says nothing about other streams: the old
    # places stay mapped until a barrier, and every unmap happens behind one.
    sim, pool = make(limit=64 * MiB, event_delay=3)
    a = pool.allocate(8 * MiB, stream=1)
    keep = pool.allocate(8 * MiB, stream=1)
    pool.free(a)
    assert pool.allocate(10 * MiB, stream=1)
    s = pool.stats()
    assert s["num_reclaims"] == 4 and s["backend"]["unmap_calls"] == 0
    for _ in range(8):
        pool.allocate(4 * MiB, stream=1)
    s = pool.stats()
    assert s["backend"]["unmap_calls"] == 0 or s["backend"]["device_sync_calls"] >= 1
    pool.release_cached()
    s = pool.stats()
    assert s["backend"]["unmap_calls"] >= 4 and s["backend"]["device_sync_calls"] >= 1
    assert keep
    pool.check_invariants()


def test_private_pool_with_pending_places_is_dropped_after_they_finish():
    sim, pool = make(limit=40 * MiB)
    pool.create_private_pool(7)
    p = pool.allocate(8 * MiB, stream=1, pool=7)
    pool.allocate(8 * MiB, stream=1)
    pool.free(p)
    assert pool.stats()["num_reclaims"] == 0   # frozen while in use (Note [Private pools])
    pool.release_private_pool(7)
    assert pool.allocate(10 * MiB, stream=1)   # aliases pool 7's granules
    assert pool.stats()["num_reclaims"] == 4
    pool.check_invariants()
    pool.release_cached()                      # finishes the pending unmaps, drops pool 7
    pool.check_invariants()
    with pytest.raises(ValueError):
        pool.allocate(MiB, pool=7)


def test_an_in_use_private_pool_keeps_its_free_memory():
    # A graph may replay into any address its pool handed out: while the pool is in use
    # nothing takes its free granules, not even under a budget that then runs out.
    sim, pool = make(limit=24 * MiB)
    pool.create_private_pool(7)
    pool.free(pool.allocate(16 * MiB, stream=1, pool=7))
    pool.release_cached()
    assert sim.device_used() == 16 * MiB  # empty_cache leaves it, as PyTorch's does for a pool in use
    assert pool.allocate(16 * MiB, stream=1) == 0  # out of memory (the core answers 0)
    assert pool.stats()["num_reclaims"] == 0
    again = pool.allocate(16 * MiB, stream=1, pool=7)  # its own requests reuse it
    pool.free(again)
    pool.check_invariants()
    pool.release_private_pool(7)
    assert pool.allocate(16 * MiB, stream=1)  # released: its granules serve others
    pool.check_invariants()


def test_teardown_unmaps_pending_places():
    sim, pool = make(limit=40 * MiB)
    stitch_scene(pool)
    del pool
    assert sim.device_used() == 0
    assert sim.counters()["unmap_calls"] == sim.counters()["map_calls"]


@pytest.mark.parametrize("seed, options", [
    (11, {"event_delay": 50, "streams": 1}),
    (12, {"event_delay": 20, "streams": 3}),
    (13, {"event_delay": 1000, "streams": 2, "limit": 256 * MiB}),
    (14, {"event_delay": 50, "streams": 2, "alias_reclaim": False}),
])
def test_random_ops_with_lagging_fences(seed, options):
    summary = _C._random_ops(seed, 150_000, dict(options, check_every=300))
    assert summary["ops"] == 150_000 and summary["frees"] == summary["allocs"]
    assert summary["reclaims"] > 0


def test_places_behind_a_barrier_are_unmapped_when_a_mapping_needs_them():
    # One barrier makes every pending place safe to unmap, but unmapping them
    # all would cost a call per granule for addresses nothing may map again:
    # each is unmapped when a mapping needs its address, the rest at empty_cache.
    sim, pool = make()
    pool.create_private_pool(7)
    x = pool.allocate(8 * MiB, stream=1)          # large heap, granules 0-3
    pool.free(x)
    assert pool.allocate(8 * MiB, stream=1, pool=7)  # aliases granules 0-3 away
    assert pool.allocate(4 * MiB, stream=1) == x     # needs granules 0-1: the barrier
    s = pool.stats()["backend"]
    assert s["device_sync_calls"] == 1 and s["unmap_calls"] == 2
    assert pool.allocate(8 * MiB, stream=1, pool=7)  # slow path elsewhere: 2-3 stay mapped
    assert pool.stats()["backend"]["unmap_calls"] == 2
    assert pool.allocate(4 * MiB, stream=1) == x + 4 * MiB  # behind the barrier: no new wait
    s = pool.stats()["backend"]
    assert s["device_sync_calls"] == 1 and s["unmap_calls"] == 4
    pool.check_invariants()
    pool.release_cached()
    pool.check_invariants()
    del pool
    assert sim.counters()["unmap_calls"] == sim.counters()["map_calls"]


def test_pending_queue_drops_places_resolved_on_demand():
    # Each round maps at the places the last one left pending (the heap's only
    # free block starts there): 1,196 of 1,200 queued places are resolved on
    # demand. The queue compacts past its threshold (check_invariants bounds
    # its length) and loses none of the places still pending.
    sim, pool = make(capacity=4096 * MiB)
    pool.create_private_pool(7)
    for _ in range(300):
        x = pool.allocate(8 * MiB, stream=1)
        pool.free(x)
        assert pool.allocate(8 * MiB, stream=1, pool=7)
    s = pool.stats()
    assert s["num_reclaims"] == 1200 and s["backend"]["unmap_calls"] == 1196
    pool.check_invariants()
    pool.release_cached()
    assert pool.stats()["backend"]["unmap_calls"] == 1200
    pool.check_invariants()
    del pool
    assert sim.counters()["unmap_calls"] == sim.counters()["map_calls"]
