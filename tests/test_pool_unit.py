"""Unit scenarios of the pool (csrc/core/pool.h) over the simulated backend.

Each test builds a small pool whose behaviour is known exactly (granule
counts, addresses, reclaim counts), and every test ends by asking the pool to
check its own invariants."""

import pytest

from torchmem._loader import _C

MiB = 1 << 20
G = 2 * MiB


def make(limit=0, capacity=1 << 30, vmm=True, event_delay=0, **config):
    sim = _C.SimBackend(capacity=capacity, vmm=vmm, event_delay=event_delay)
    pool = _C.Pool(sim, dict(dict(stitch_above=0.0, stitch_above_limit=0.0, backed_fit=False, run_below=0.0), **config, limit_bytes=limit))
    return sim, pool


def cur(stats, name, kind="all"):
    return stats[name][kind]["current"]


# ---- rounding, heaps, split and merge ---------------------------------------

def test_rounding_to_512():
    _, pool = make()
    for size, rounded in [(1, 512), (512, 512), (513, 1024), (3 * MiB + 1, 3 * MiB + 512)]:
        a = pool.allocate(size)
        assert a % 512 == 0
        assert pool.block_size(a) == rounded
    s = pool.stats()
    assert cur(s, "allocated_bytes") == 512 + 512 + 1024 + 3 * MiB + 512
    assert cur(s, "requested_bytes") == 1 + 512 + 513 + 3 * MiB + 1
    pool.check_invariants()


def test_small_and_large_heaps_are_apart():
    _, pool = make()
    small = pool.allocate(MiB)        # <= small_threshold: small heap
    large = pool.allocate(MiB + 1)    # large heap
    s = pool.stats()
    assert cur(s, "allocation", "small_pool") == 1 and cur(s, "allocation", "large_pool") == 1
    assert cur(s, "allocated_bytes", "small_pool") == MiB
    assert cur(s, "allocated_bytes", "large_pool") == MiB + 512
    assert abs(large - small) >= 1 << 30  # different virtual ranges
    segs = pool.snapshot()["segments"]
    assert {seg["small_heap"] for seg in segs} == {True, False}
    pool.check_invariants()


def test_split_and_merge():
    _, pool = make()
    a = pool.allocate(4 * MiB)
    b = pool.allocate(4 * MiB)
    c = pool.allocate(4 * MiB)
    assert b == a + 4 * MiB and c == b + 4 * MiB  # carved next to each other
    pool.free(a)
    pool.free(c)
    assert cur(pool.stats(), "inactive_split") == 1  # a's hole (c merged into the tail)
    pool.free(b)
    s = pool.stats()
    assert cur(s, "inactive_split") == 0  # everything merged back into the tail
    blocks = [blk for seg in pool.snapshot()["segments"] for blk in seg["blocks"]]
    # one free block in the core; a snapshot shows it in one piece per growth (Note [Map groups])
    assert [blk["state"] for blk in blocks] == ["inactive"] * 3
    assert sum(blk["size"] for blk in blocks) == 12 * MiB
    # The merged space is reused in place: no new granules.
    creates = s["backend"]["create_calls"]
    assert pool.allocate(12 * MiB) == a
    assert pool.stats()["backend"]["create_calls"] == creates
    pool.check_invariants()


def test_best_fit_by_size_then_address():
    _, pool = make()
    hole5 = pool.allocate(5 * MiB)
    pool.allocate(2 * MiB)
    hole3 = pool.allocate(3 * MiB)
    pool.allocate(2 * MiB)
    hole3b = pool.allocate(3 * MiB)
    pool.allocate(2 * MiB)
    for a in (hole5, hole3, hole3b):
        pool.free(a)
    assert pool.allocate(3 * MiB) == hole3       # smallest fit, lowest address
    assert pool.allocate(3 * MiB - 512) == hole3b  # next smallest fit (split)
    assert pool.allocate(4 * MiB) == hole5
    pool.check_invariants()


# ---- granules: reclaim (stitching), fences, budget, reserve -----------------

def test_reclaim_stitches_granules_of_cached_space():
    sim, pool = make(limit=20 * MiB, capacity=64 * MiB)
    a = pool.allocate(8 * MiB)   # granules 0-3
    pool.allocate(8 * MiB)       # granules 4-7: 16 MiB held
    pool.free(a)                 # 4 cached granules, mapped
    c = pool.allocate(10 * MiB)  # does not fit a's hole: 5 granules at the end
    assert c
    s = pool.stats()
    # One granule created within held <= in use (18 MiB), four moved from a's hole.
    assert s["num_reclaims"] == 4
    assert s["backend"]["create_calls"] == 9
    # a's old place stays mapped until a device barrier (Note [Pending unmaps]).
    assert s["backend"]["unmap_calls"] == 0 and s["backend"]["device_sync_calls"] == 0
    assert cur(s, "reserved_bytes") == 18 * MiB
    assert s["reserved_bytes"]["all"]["peak"] == 18 * MiB
    assert sim.device_used() == 18 * MiB
    # The reclaimed hole is no longer mapped: snapshots show only mapped runs.
    seg_starts = [seg["address"] for seg in pool.snapshot()["segments"]]
    assert a not in seg_starts
    pool.check_invariants()


def test_fence_keeps_freed_granules_until_their_event_completes():
    # Events never complete by polling: freed granules must not be moved
    # (alias reclaim off: tests/test_pool_alias.py covers same-stream aliasing).
    sim, pool = make(limit=40 * MiB, capacity=64 * MiB, event_delay=10**9, alias_reclaim=False)
    a = pool.allocate(8 * MiB, stream=1)
    pool.allocate(8 * MiB, stream=1)
    pool.free(a)
    assert pool.allocate(10 * MiB, stream=1)
    s = pool.stats()
    assert s["num_reclaims"] == 0
    assert s["backend"]["unmap_calls"] == 0
    assert s["backend"]["create_calls"] == 13  # created instead of waiting
    # Cached space is still reused in place on its own stream, fence or not.
    pool.set_limit(26 * MiB)
    assert pool.allocate(8 * MiB, stream=1) == a
    assert pool.allocate(MiB + 512, stream=1) == 0  # live == budget: a real OOM
    pool.check_invariants()


def test_device_barrier_on_the_oom_ladder_for_another_streams_memory():
    sim, pool = make(limit=20 * MiB, capacity=64 * MiB, event_delay=10**9)
    a = pool.allocate(8 * MiB, stream=1)
    pool.allocate(8 * MiB, stream=1)
    pool.free(a)
    # Needs a's granules, on another stream: only behind a device barrier
    # (Note [Cross-stream reuse]), taken on the OOM ladder.
    c = pool.allocate(10 * MiB, stream=2)
    assert c
    s = pool.stats()
    assert s["num_reclaims"] == 4
    assert s["num_sync_all_streams"] >= 1
    assert s["backend"]["device_sync_calls"] == 1
    pool.check_invariants()


def test_budget_oom_and_recovery():
    _, pool = make(limit=32 * MiB, capacity=1 << 30)
    live = []
    while True:
        a = pool.allocate(3 * MiB)
        if not a:
            break
        live.append(a)
    s = pool.stats()
    assert s["num_ooms"] == 1
    assert len(live) == 10  # 30 MiB of 32: the 11th would need 33 MiB
    assert cur(s, "reserved_bytes") <= 32 * MiB
    assert pool.allocate(64 * MiB) == 0
    for a in live[:3]:
        pool.free(a)
    assert pool.allocate(9 * MiB)  # fits again once live + request <= budget
    assert pool.stats()["num_ooms"] == 2
    pool.check_invariants()


def test_oom_is_recorded_in_the_trace():
    _, pool = make(limit=4 * MiB, trace_capacity=16)
    assert pool.allocate(8 * MiB, stream=3, context=42) == 0
    oom = [e for e in pool.snapshot()["trace"] if e["action"] == "oom"]
    assert oom and oom[-1]["size"] == 8 * MiB and oom[-1]["context"] == 42


def test_reserve_is_premapped_and_kept():
    sim, pool = make(reserve_bytes=8 * MiB)
    assert cur(pool.stats(), "reserved_bytes") == 8 * MiB
    assert sim.device_used() == 8 * MiB
    a = pool.allocate(6 * MiB)
    assert pool.stats()["backend"]["create_calls"] == 4  # served from the reserve
    b = pool.allocate(6 * MiB)
    pool.free(a)
    pool.free(b)
    pool.release_cached()
    assert cur(pool.stats(), "reserved_bytes") == 8 * MiB
    pool.check_invariants()


def test_release_cached_returns_everything_unused():
    sim, pool = make()
    live = pool.allocate(3 * MiB)
    for size in (5 * MiB, 100 * 1024, 40 * MiB):
        pool.free(pool.allocate(size))
    before = cur(pool.stats(), "reserved_bytes")
    freed = pool.release_cached()
    s = pool.stats()
    assert freed == before - cur(s, "reserved_bytes") > 0
    assert cur(s, "reserved_bytes") == 4 * MiB  # the granules under the live block
    assert s["num_cache_releases"] == 1
    assert sim.device_used() == 4 * MiB
    pool.free(live)
    pool.release_cached()
    assert sim.device_used() == 0
    pool.check_invariants()


def test_release_cached_to_returns_only_the_excess():
    sim, pool = make()
    live = pool.allocate(4 * MiB)
    pool.free(pool.allocate(40 * MiB))
    held = cur(pool.stats(), "reserved_bytes")
    assert pool.release_cached_to(held) == 0  # nothing above the mark: no release at all
    assert pool.stats()["num_cache_releases"] == 0
    freed = pool.release_cached_to(20 * MiB)
    assert freed == held - 20 * MiB and sim.device_used() == 20 * MiB  # the rest of the cache stays
    assert pool.release_cached_to(0) == 16 * MiB  # never below the live block's granules
    assert cur(pool.stats(), "reserved_bytes") == 4 * MiB
    pool.free(live)
    pool.check_invariants()


def test_largest_free_block_counts_mapped_space_only():
    _, pool = make()
    a = pool.allocate(6 * MiB)
    pool.allocate(MiB + 512)
    pool.free(a)
    assert pool.stats()["largest_free_block"] >= 6 * MiB
    pool.release_cached()
    assert pool.stats()["largest_free_block"] < 2 * MiB


# ---- streams -------------------------------------------------------------------

def test_record_stream_defers_reuse_until_events_complete():
    sim, pool = make(event_delay=2)
    a = pool.allocate(4 * MiB, stream=1)
    pool.record_stream(a, 2)
    pool.free(a)
    s = pool.stats()
    assert s["num_deferred_frees"] == 1
    assert cur(s, "allocation") == 0 and cur(s, "active") == 1
    assert sim.counters()["event_record_calls"] == 1
    b = pool.allocate(4 * MiB, stream=1)  # polls once: still pending
    assert b != a
    c = pool.allocate(4 * MiB, stream=1)  # polls twice: still pending
    assert c not in (a, b)
    pool.free(b)
    pool.free(c)
    d = pool.allocate(4 * MiB, stream=1)  # third poll: complete, a is reusable
    assert d == a
    assert cur(pool.stats(), "active") == 1
    pool.check_invariants()


def test_record_stream_on_own_stream_is_a_no_op():
    _, pool = make()
    a = pool.allocate(MiB, stream=5)
    pool.record_stream(a, 5)
    pool.free(a)
    assert pool.stats()["num_deferred_frees"] == 0


@pytest.mark.parametrize("stream_order", [True, False])
def test_cross_stream_reuse_needs_the_fence_or_a_wait(stream_order):
    """Note [Cross-stream reuse]: another stream's cached block, its fence pending, is
    taken behind a device-side wait on that stream rather than new memory (no limit set,
    stream_order); without stream_order the request gets new memory."""
    sim, pool = make(event_delay=10**9, stream_order=stream_order)
    a = pool.allocate(4 * MiB, stream=1)
    pool.allocate(MiB + 512, stream=1)
    pool.free(a)
    assert pool.allocate(4 * MiB, stream=1) == a   # same stream: stream order suffices
    pool.free(a)
    reserved = cur(pool.stats(), "reserved_bytes")
    b = pool.allocate(4 * MiB, stream=2)           # other stream: fence pending
    if stream_order:
        assert b == a and sim.counters()["stream_wait_calls"] == 1
        assert cur(pool.stats(), "reserved_bytes") == reserved
    else:
        assert b != a and sim.counters()["stream_wait_calls"] == 0
    pool.check_invariants()


# ---- private pools -------------------------------------------------------------

def test_private_pool_blocks_serve_only_their_pool():
    _, pool = make()
    pool.create_private_pool(7)
    p = pool.allocate(4 * MiB, pool=7)
    pool.free(p)
    shared = pool.allocate(4 * MiB)
    assert shared != p
    assert pool.allocate(4 * MiB, pool=7) == p  # its cached block comes back
    pool.check_invariants()


def test_private_pool_release():
    sim, pool = make()
    pool.create_private_pool(3)
    kept = pool.allocate(4 * MiB, pool=3)
    pool.free(pool.allocate(8 * MiB, pool=3))
    pool.release_private_pool(3)
    with pytest.raises(ValueError, match="released"):
        pool.allocate(MiB, pool=3)
    with pytest.raises(ValueError, match="already released"):
        pool.release_private_pool(3)
    assert pool.block_size(kept) == 4 * MiB  # live blocks stay valid
    pool.free(kept)
    pool.release_cached()
    assert sim.device_used() == 0
    assert all(seg["pool"] != 3 for seg in pool.snapshot()["segments"])
    pool.create_private_pool(3)  # the id can be used again once it is gone
    pool.check_invariants()


def test_private_pool_errors():
    _, pool = make()
    with pytest.raises(ValueError, match="does not exist"):
        pool.allocate(MiB, pool=9)
    with pytest.raises(ValueError, match="default pool"):
        pool.create_private_pool(0)
    pool.create_private_pool(9)
    with pytest.raises(ValueError, match="already exists"):
        pool.create_private_pool(9)


# ---- cuda_malloc mode -------------------------------------------------------------

def test_cuda_malloc_mode_segments():
    sim, pool = make(vmm=False)
    s1 = pool.allocate(1000)          # small heap: a 2 MiB segment
    s2 = pool.allocate(1000)          # packed into the same segment
    big = pool.allocate(4 * MiB)      # large: a 20 MiB segment
    huge = pool.allocate(29 * MiB)    # large: its own 30 MiB segment
    assert s2 == s1 + 1024
    c = sim.counters()
    assert c["segment_alloc_calls"] == 3 and c["create_calls"] == 0
    assert sim.device_used() == 2 * MiB + 20 * MiB + 30 * MiB
    s = pool.stats()
    assert cur(s, "segment") == 3 and cur(s, "segment", "small_pool") == 1
    assert cur(s, "reserved_bytes") == 52 * MiB
    pool.free(huge)
    pool.free(big)
    assert pool.release_cached() == 50 * MiB  # empty segments go; the small one is in use
    assert sim.counters()["segment_free_calls"] == 2
    pool.check_invariants()


def test_cuda_malloc_mode_ladder_frees_empty_segments():
    sim, pool = make(vmm=False, limit=40 * MiB)
    a = pool.allocate(4 * MiB)   # 20 MiB segment
    pool.free(a)
    b = pool.allocate(30 * MiB)  # 30 MiB more would break the budget: free the empty one, retry
    assert b
    s = pool.stats()
    assert s["num_alloc_retries"] == 1 and s["num_ooms"] == 0
    assert cur(s, "reserved_bytes") == 30 * MiB
    pool.check_invariants()


# ---- caller errors leave the pool unchanged -------------------------------------

def _fingerprint(pool):
    s = pool.stats()
    return (cur(s, "allocated_bytes"), cur(s, "reserved_bytes"), cur(s, "allocation"),
            s["num_allocs"], s["num_frees"], len(pool.snapshot()["segments"]))


def test_caller_errors_raise_and_change_nothing():
    _, pool = make()
    a = pool.allocate(3 * MiB)
    pool.free(pool.allocate(MiB))
    before = _fingerprint(pool)
    with pytest.raises(ValueError, match="size 0"):
        pool.allocate(0)
    with pytest.raises(ValueError, match="not a live block"):
        pool.free(a + 512)
    with pytest.raises(ValueError, match="not a live block"):
        pool.free(12345 * 512)
    with pytest.raises(ValueError, match="not a live block"):
        pool.record_stream(a + 512, 3)
    assert _fingerprint(pool) == before
    pool.free(a)
    after_free = _fingerprint(pool)
    with pytest.raises(ValueError, match="already freed"):
        pool.free(a)  # double free
    assert _fingerprint(pool) == after_free
    assert issubclass(_C.PoolError, ValueError)
    pool.check_invariants()


@pytest.mark.parametrize("config, match", [
    ({"limit_bytes": MiB}, "below one granule"),
    ({"small_page_bytes": 3 * MiB}, "multiple of the backend granularity"),
    ({"small_threshold": 0}, "small_threshold"),
    ({"small_threshold": 4 * MiB}, "small_threshold"),
    ({"reserve_bytes": 8 * MiB, "limit_bytes": 4 * MiB}, "exceeds the limit"),
    ({"reclaim_slack": -0.5}, "reclaim_slack"),
    ({"no_such_key": 1}, "unknown key 'no_such_key'"),
    ({"limit_bytes": "8GiB"}, "limit_bytes"),
    ({"debug_checks": 3}, "debug_checks"),
])
def test_bad_config(config, match):
    sim = _C.SimBackend()
    with pytest.raises(ValueError, match=match):
        _C.Pool(sim, config)
    assert sim.device_used() == 0


def test_set_limit_validates():
    _, pool = make()
    with pytest.raises(ValueError, match="below one granule"):
        pool.set_limit(1000)
    pool.set_limit(64 * MiB)
    assert pool.limit() == 64 * MiB
    assert pool.stats()["limit_bytes"] == 64 * MiB
    pool.set_limit(0)
    assert pool.limit() == 0


# ---- stats, snapshot, trace, debug checks -----------------------------------------

def test_stats_have_every_key():
    _, pool = make()
    s = pool.stats()
    for name in ("allocation", "segment", "active", "inactive_split", "allocated_bytes",
                 "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes"):
        for kind in ("all", "small_pool", "large_pool"):
            assert set(s[name][kind]) == {"current", "peak", "allocated", "freed"}
    for name in ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc",
                 "num_device_free", "num_reclaims", "num_deferred_frees", "num_cache_releases",
                 "num_allocs", "num_frees", "largest_free_block", "limit_bytes", "granularity"):
        assert isinstance(s[name], int)
    assert s["granularity"] == G and s["backend_name"] == "sim"
    assert "map_calls" in s["backend"]


def test_growths_count_the_bursts_of_driver_calls():
    # num_growths (Note [Map groups]): one per mapping of new memory, however many granules it
    # maps; a request the cache serves makes none.
    _, pool = make()
    a = pool.allocate(8 * MiB)                 # one growth of 4 granules
    b = pool.allocate(3 * MiB)                 # another, of 2
    s = pool.stats()
    assert (s["num_growths"], s["num_device_alloc"], s["backend"]["map_calls"]) == (2, 6, 6)
    pool.free(a)
    pool.free(pool.allocate(8 * MiB))          # from the cache
    assert pool.stats()["num_growths"] == 2
    pool.free(b)
    pool.check_invariants()


def test_peak_and_accumulated_resets():
    _, pool = make()
    a = pool.allocate(8 * MiB)
    pool.free(a)
    s = pool.stats()["allocated_bytes"]["all"]
    assert s["peak"] == 8 * MiB and s["allocated"] == 8 * MiB and s["freed"] == 8 * MiB
    pool.reset_peak_stats()
    assert pool.stats()["allocated_bytes"]["all"]["peak"] == 0
    pool.reset_accumulated_stats()
    s = pool.stats()
    assert s["allocated_bytes"]["all"]["allocated"] == 0 and s["num_allocs"] == 0


def test_snapshot_tiles_mapped_memory():
    _, pool = make(trace_capacity=100)
    a = pool.allocate(3 * MiB, stream=4, context=11)
    b = pool.allocate(100, stream=4)
    pool.free(b)
    snap = pool.snapshot()
    for seg in snap["segments"]:
        assert sum(blk["size"] for blk in seg["blocks"]) == seg["total_size"]
        assert seg["blocks"][0]["address"] == seg["address"]
    live = [blk for seg in snap["segments"] for blk in seg["blocks"] if blk["state"] == "active_allocated"]
    assert live == [{"address": a, "size": 3 * MiB, "requested_size": 3 * MiB,
                     "state": "active_allocated", "stream": 4, "context": 11}]
    actions = [e["action"] for e in snap["trace"]]
    assert actions.count("alloc") == 2 and "free_requested" in actions and "free_completed" in actions
    assert "segment_map" in actions
    seqs = [e["sequence"] for e in snap["trace"]]
    assert seqs == sorted(seqs)


def test_trace_ring_keeps_the_last_entries():
    _, pool = make(trace_capacity=5)
    for _ in range(10):
        pool.free(pool.allocate(MiB + 512))
    trace = pool.snapshot()["trace"]
    assert len(trace) == 5
    assert trace[-1]["action"] == "free_completed"


def test_debug_checks_run_after_every_op():
    _, pool = make(debug_checks=True)
    live = [pool.allocate(size) for size in (100, 5 * MiB, 700 * 1024, 33 * MiB)]
    for a in live[::2]:
        pool.free(a)
    pool.release_cached()
    pool.check_invariants()


def test_request_beyond_the_budget_is_an_oom_that_keeps_the_cache():
    sim, pool = make(limit=64 * MiB)
    pool.free(pool.allocate(8 * MiB))
    held = sim.device_used()
    for size in (65 * MiB, 1 << 50, (1 << 64) - 1):
        assert pool.allocate(size) == 0
    s = pool.stats()
    assert s["num_ooms"] == 3 and s["num_alloc_retries"] == 0
    assert sim.device_used() == held  # nothing released for a hopeless request
    pool.check_invariants()


def test_a_request_that_cannot_fit_costs_no_driver_call_and_keeps_the_cache():
    # Note [OOM ladder]: a controller probing a size that does not fit must not pay a
    # barrier, nor give back and create again the whole cache, for each probe.
    sim, pool = make(limit=64 * MiB)
    live = pool.allocate(40 * MiB)
    pool.free(pool.allocate(16 * MiB))  # 16 MiB cached
    before = dict(pool.stats()["backend"])
    reserved = cur(pool.stats(), "reserved_bytes")
    assert pool.allocate(30 * MiB) == 0  # 40 live + 30 > 64: hopeless
    s = pool.stats()
    assert s["backend"] == before  # no create, map, release or device sync
    assert cur(s, "reserved_bytes") == reserved and s["num_ooms"] == 1 and s["num_alloc_retries"] == 0
    fits = pool.allocate(20 * MiB)  # 40 + 20 <= 64: the cache plus new granules serve it
    assert fits
    pool.free(fits)
    pool.free(live)
    pool.check_invariants()


def test_a_short_request_creates_nothing_it_would_give_back():
    # Budget room for 2 granules, nothing reclaimable: creating them would be undone.
    sim, pool = make(limit=8 * MiB)
    a = pool.allocate(4 * MiB)
    b = pool.allocate(MiB)  # small heap: 1 granule
    creates = pool.stats()["backend"]["create_calls"]
    pool.free(b)
    assert pool.allocate(6 * MiB) == 0
    assert pool.stats()["backend"]["create_calls"] == creates
    pool.free(a)
    pool.check_invariants()


def test_an_oom_on_a_full_device_keeps_the_cache():
    # Note [OOM ladder] step 5: a VMM pool already stitches every cached granule, so an
    # OOM because the device is full (another process holds the rest) must not give the
    # whole cache back only to create as much again.
    sim = _C.SimBackend(capacity=64 * MiB, vmm=True, event_delay=0)
    pool = _C.Pool(sim, dict(stitch_above=0.0))
    neighbour = _C.Pool(sim, dict(stitch_above=0.0))
    pool.free(pool.allocate(32 * MiB))          # 32 MiB cached
    other = neighbour.allocate(24 * MiB)       # the device has 8 MiB left
    before = dict(pool.stats()["backend"])
    assert pool.allocate(48 * MiB) == 0         # 32 cached + 8 free < 48
    s = pool.stats()
    # only granules the failed attempts created went back, none of the cache
    delta = {k: s["backend"][k] - before[k] for k in ("create_calls", "release_calls")}
    assert delta["release_calls"] == delta["create_calls"] <= 2 * 4
    assert cur(s, "reserved_bytes") == 32 * MiB and s["num_ooms"] == 1 and s["num_alloc_retries"] == 0
    fits = pool.allocate(40 * MiB)              # the cache plus the free 8 MiB serve it
    assert fits
    pool.free(fits)
    neighbour.free(other)
    pool.check_invariants()
    neighbour.check_invariants()
