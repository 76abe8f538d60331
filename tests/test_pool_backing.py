"""What backs a live block (Note [Block backing], csrc/core/pool.h): the pieces another
process maps to see the block through CUDA IPC (csrc/shim/ipc.cpp). On the simulator:
a block inside a run handle names the whole run; a block over single granules names
each granule, ascending and contiguous; cuda_malloc mode names the block's segment;
an address that is not a live block's start is a PoolError."""

import pytest

from torchmem._loader import _C

MiB = 1 << 20
G = 2 * MiB


def make(vmm=True, limit=0, **config):
    sim = _C.SimBackend(capacity=1 << 30, vmm=vmm)
    pool = _C.Pool(sim, dict(dict(debug_checks=True), **config, limit_bytes=limit))
    return sim, pool


def contiguous_cover(backing):
    pieces = backing["pieces"]
    for a, b in zip(pieces, pieces[1:]):
        assert a["at"] + a["bytes"] == b["at"]
    assert pieces[0]["at"] <= backing["block"]
    assert backing["block"] + backing["size"] <= pieces[-1]["at"] + pieces[-1]["bytes"]


def test_blocks_in_one_run_name_the_whole_run():
    sim, pool = make()
    a = pool.allocate(5 * MiB)  # 3 granules and 7 ahead (Note [Runs ahead]): one run handle
    pool.free(a)
    b = pool.allocate(2 * MiB)  # large blocks (the small heap has runs of its own)
    c = pool.allocate(3 * MiB)
    for addr in (b, c):
        backing = pool.backing_of(addr)
        assert len(backing["pieces"]) == 1
        assert backing["pieces"][0]["bytes"] == 10 * G and backing["pieces"][0]["handle"] != 0
        contiguous_cover(backing)
    assert pool.backing_of(b)["pieces"] == pool.backing_of(c)["pieces"]
    pool.check_invariants()


def test_a_block_over_single_granules_names_each_one():
    sim, pool = make(run_below=0.0)  # a handle per granule
    a = pool.allocate(7 * MiB)  # 4 granules
    backing = pool.backing_of(a)
    assert backing["block"] == a and backing["size"] >= 7 * MiB
    assert [p["bytes"] for p in backing["pieces"]] == [G] * 4
    assert len({p["handle"] for p in backing["pieces"]}) == 4
    contiguous_cover(backing)


def test_a_stitched_block_names_the_granules_it_was_given():
    sim, pool = make(limit=16 * MiB)  # under a limit: granule handles, stitched when the budget is tight
    held = [pool.allocate(2 * MiB) for _ in range(8)]
    for addr in held[::2]:
        pool.free(addr)
    big = pool.allocate(8 * MiB)  # only fits by moving the four freed granules under it
    backing = pool.backing_of(big)
    assert sum(p["bytes"] for p in backing["pieces"]) == 8 * MiB
    assert len(backing["pieces"]) == 4
    contiguous_cover(backing)
    pool.check_invariants()


def test_cuda_malloc_mode_names_the_segment():
    sim, pool = make(vmm=False)
    a = pool.allocate(1 * MiB)
    b = pool.allocate(1 * MiB)
    pa, pb = pool.backing_of(a), pool.backing_of(b)
    assert len(pa["pieces"]) == 1 and pa["pieces"][0]["handle"] == 0
    contiguous_cover(pa)
    assert pa["pieces"] == pb["pieces"]  # one small segment holds both


def test_unknown_freed_and_interior_addresses_are_pool_errors():
    sim, pool = make()
    a = pool.allocate(4 * MiB)
    with pytest.raises(_C.PoolError, match="not the start of a live block"):
        pool.backing_of(a + 512)
    with pytest.raises(_C.PoolError, match="not the start of a live block"):
        pool.backing_of(12345 * MiB)
    pool.free(a)
    with pytest.raises(_C.PoolError, match="not the start of a live block"):
        pool.backing_of(a)
