"""Snapshot segments follow growths (Note [Map groups], csrc/core/detail/inspect.cpp): one
segment per request that mapped memory, as PyTorch shows one per cudaMalloc, unless a live
block spans two growths."""

import torchmem
from sim_pool import MiB, make_pool


def _segments(pool, pool_id=None):
    segments = torchmem.snapshot(pool=pool)["segments"]
    if pool_id is not None:
        segments = [s for s in segments if s["segment_pool_id"] == (0, pool_id)]
    return segments


def test_each_growth_of_a_private_pool_is_its_own_segment_live_or_free():
    pool = make_pool(run_below=0.0)  # a handle per granule: growth, not run handles, draws the lines
    pool.create_private_pool(1)
    blocks = [pool.allocate(20 * MiB, 0, 1) for _ in range(3)]
    assert [s["total_size"] for s in _segments(pool, 1)] == [20 * MiB] * 3
    for addr in blocks:
        pool.free(addr)
    # the three free blocks merged in the core, but each growth is still shown apart
    segments = _segments(pool, 1)
    assert [s["total_size"] for s in segments] == [20 * MiB] * 3
    assert all(len(s["blocks"]) == 1 and s["blocks"][0]["state"] == "inactive" for s in segments)
    # served again from the cache, the same three segments
    again = [pool.allocate(20 * MiB, 0, 1) for _ in range(3)]
    assert sorted(again) == sorted(blocks)
    assert len(_segments(pool, 1)) == 3
    assert pool.check_invariants() is None


def test_a_block_across_two_growths_holds_them_together():
    pool = make_pool(run_below=0.0)
    pool.create_private_pool(1)
    first = pool.allocate(3 * MiB, 0, 1)   # maps 2 granules; 1 MiB of the second is free tail
    second = pool.allocate(3 * MiB, 0, 1)  # starts in that tail, maps more: spans the boundary
    segments = _segments(pool, 1)
    assert len(segments) == 1 and segments[0]["total_size"] == 6 * MiB
    pool.free(second)
    # nothing live crosses the boundary any more: the growths show apart
    assert [s["total_size"] for s in _segments(pool, 1)] == [4 * MiB, 2 * MiB]
    pool.free(first)
    assert pool.check_invariants() is None


def test_segments_tile_reserved_memory_in_the_default_pool():
    pool = make_pool()
    live = [pool.allocate(size) for size in (700, 5 * MiB, 40 * MiB, 3 * MiB + 1, 64 * MiB)]
    pool.free(live.pop(1))
    pool.free(live.pop(2))
    snap = torchmem.snapshot(pool=pool)
    assert sum(s["total_size"] for s in snap["segments"]) == torchmem.memory_reserved(pool=pool)
    for segment in snap["segments"]:
        assert sum(b["size"] for b in segment["blocks"]) == segment["total_size"]


def test_emptying_one_pools_cache_keeps_the_others():
    # torch.cuda.MemPool's destructor empties its own pool's cache (emptyCache(mempool_id))
    pool = make_pool(run_below=0.0)
    kept = pool.allocate(4 * MiB)
    pool.free(kept)  # cached in the default pool
    pool.create_private_pool(5)
    mine = pool.allocate(6 * MiB, 0, 5)
    pool.free(mine)
    assert pool.release_pool_cache(5) == 0  # in use: frozen, as PyTorch keeps a pool in use
    pool.release_private_pool(5)
    assert pool.release_pool_cache(5) == 6 * MiB
    assert torchmem.memory_reserved(pool=pool) == 4 * MiB  # the default pool's cache stays
    assert pool.release_pool_cache(99) == 0  # unknown: nothing
    assert pool.check_invariants() is None
