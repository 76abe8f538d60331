"""Checkpoints of a private pool and restoring them (Note [Pool checkpoints] in
csrc/core/pool.h, csrc/core/detail/checkpoint.cpp), over the simulated backend.

CUDA graph trees (torch.compile mode="reduce-overhead") need this: the pool's
live set goes back to a recorded one at the very same addresses. Every test runs
on both backends (VMM and cuda_malloc segments) and checks the pool's invariants
after each step."""

import random

import pytest

from torchmem._loader import _C

MiB = 1 << 20
POOL = 5


def make(vmm, limit=0, event_delay=0, host_memory=False):
    sim = _C.SimBackend(capacity=1 << 30, vmm=vmm, event_delay=event_delay, host_memory=host_memory)
    pool = _C.Pool(sim, {"limit_bytes": limit})
    pool.create_private_pool(POOL)
    return sim, pool


def live_of(pool, pool_id=POOL):
    """{addr: (size, requested)} of the allocated blocks of one pool, from the snapshot."""
    out = {}
    for seg in pool.snapshot()["segments"]:
        if seg["pool"] != pool_id:
            continue
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[b["address"]] = (b["size"], b["requested_size"])
    return out


def ckpt_set(ckpt):
    return {b["addr"]: (b["size"], b["requested"]) for b in ckpt["blocks"]}


def allocated_bytes(pool):
    return pool.stats()["allocated_bytes"]["all"]["current"]


both = pytest.mark.parametrize("vmm", [True, False], ids=["vmm", "cuda_malloc"])


@both
def test_checkpoint_lists_the_pools_live_blocks(vmm):
    _, pool = make(vmm)
    pool.allocate(4096)  # default pool: not part of the checkpoint
    a = pool.allocate(1000, stream=3, pool=POOL, context=77)
    b = pool.allocate(3 * MiB, pool=POOL)
    c = pool.allocate(512, pool=POOL)
    pool.free(c)
    ckpt = pool.checkpoint_private_pool(POOL)
    assert ckpt["pool"] == POOL
    assert [x["addr"] for x in ckpt["blocks"]] == sorted([a, b])
    first = next(x for x in ckpt["blocks"] if x["addr"] == a)
    assert (first["size"], first["requested"], first["stream"], first["context"]) == (1024, 1000, 3, 77)
    assert ckpt_set(ckpt) == live_of(pool)
    pool.check_invariants()


@both
def test_restore_frees_new_blocks_and_reallocates_freed_ones_in_place(vmm):
    _, pool = make(vmm)
    blocks = [pool.allocate(size, pool=POOL) for size in (512, 2048, 700, 5 * MiB, 1536, 3 * MiB)]
    ckpt = pool.checkpoint_private_pool(POOL)
    before_bytes = allocated_bytes(pool)
    # Free some; new requests then reuse their space at other boundaries.
    for addr in (blocks[1], blocks[2], blocks[4], blocks[5]):
        pool.free(addr)
    pool.check_invariants()
    fresh = [pool.allocate(size, pool=POOL) for size in (1024, 1024, 4 * MiB)]
    pool.check_invariants()
    # A fresh block stays only if it sits exactly where a checkpoint block was.
    live_before = live_of(pool)
    want = ckpt_set(ckpt)
    stays = {a for a, (size, _) in live_before.items() if a in want and want[a][0] == size}
    delta = pool.restore_private_pool(ckpt)
    pool.check_invariants()
    assert delta["freed"] == sorted(set(live_before) - stays)
    assert delta["allocated"] == sorted(set(want) - stays)
    assert set(fresh) - stays <= set(delta["freed"])
    assert live_of(pool) == ckpt_set(ckpt)
    assert allocated_bytes(pool) == before_bytes
    # New requests stay clear of every restored block.
    later = [pool.allocate(size, pool=POOL) for size in (512, 2048, 6 * MiB)]
    for addr in later:
        for b in ckpt["blocks"]:
            assert addr + pool.block_size(addr) <= b["addr"] or b["addr"] + b["size"] <= addr
    pool.check_invariants()


@both
def test_restore_twice_changes_nothing_the_second_time(vmm):
    _, pool = make(vmm)
    a = pool.allocate(4096, pool=POOL)
    pool.allocate(8192, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    assert pool.restore_private_pool(ckpt) == {"freed": [], "allocated": [a]}
    assert pool.restore_private_pool(ckpt) == {"freed": [], "allocated": []}
    pool.check_invariants()


@both
def test_a_live_block_of_another_size_at_the_address_is_replaced(vmm):
    _, pool = make(vmm)
    a = pool.allocate(4096, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    b = pool.allocate(8192, pool=POOL)
    assert b == a  # best fit puts it where a was
    delta = pool.restore_private_pool(ckpt)
    assert delta == {"freed": [a], "allocated": [a]}
    assert pool.block_size(a) == 4096
    assert live_of(pool) == ckpt_set(ckpt)
    pool.check_invariants()


@both
def test_a_kept_block_takes_the_checkpoints_requested_size(vmm):
    _, pool = make(vmm)
    a = pool.allocate(4000, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    assert pool.allocate(3900, pool=POOL) == a  # same rounded size, other request
    assert pool.restore_private_pool(ckpt) == {"freed": [], "allocated": []}
    assert live_of(pool) == {a: (4096, 4000)}
    assert pool.stats()["requested_bytes"]["all"]["current"] == 4000
    pool.check_invariants()


@both
def test_restored_blocks_keep_their_bytes_when_memory_stayed(vmm):
    sim, pool = make(vmm, host_memory=True)
    a = pool.allocate(MiB, pool=POOL)
    b = pool.allocate(64 * 1024, pool=POOL)
    sim.write_pattern(a, MiB, 11)
    sim.write_pattern(b, 64 * 1024, 12)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    pool.free(b)
    pool.restore_private_pool(ckpt)
    assert sim.check_pattern(a, MiB, 11)
    assert sim.check_pattern(b, 64 * 1024, 12)
    pool.check_invariants()


@both
def test_other_pools_are_untouched(vmm):
    _, pool = make(vmm)
    pool.create_private_pool(9)
    other = [pool.allocate(4096, pool=9), pool.allocate(4096)]
    a = pool.allocate(4096, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    pool.allocate(4096, pool=9)
    pool.restore_private_pool(ckpt)
    for addr in other:
        assert pool.block_size(addr) == 4096
    assert len(live_of(pool, 9)) == 2
    pool.check_invariants()


def test_restore_waits_for_a_deferred_free_where_a_block_goes():
    _, pool = make(True, event_delay=5)
    a = pool.allocate(4096, stream=1, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    b = pool.allocate(8192, stream=1, pool=POOL)
    assert b == a
    pool.record_stream(b, 2)  # its free is deferred until stream 2's event completes
    delta = pool.restore_private_pool(ckpt)
    assert delta == {"freed": [a], "allocated": [a]}
    assert live_of(pool) == ckpt_set(ckpt)
    pool.check_invariants()


def test_vmm_an_in_use_pool_keeps_its_granules_for_a_restore():
    # Note [Private pools]: an in-use pool's free memory is frozen, so a restore
    # finds the checkpoint's memory where it was, with no driver call.
    sim, pool = make(True)
    a = pool.allocate(6 * MiB, pool=POOL)
    keep = pool.allocate(MiB, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    assert pool.release_cached() == 0  # a's granules stay with the pool
    maps = sim.counters()["map_calls"]
    held = pool.stats()["reserved_bytes"]["all"]["current"]
    delta = pool.restore_private_pool(ckpt)
    assert delta == {"freed": [], "allocated": [a]}
    assert pool.stats()["reserved_bytes"]["all"]["current"] == held and sim.counters()["map_calls"] == maps
    assert pool.block_size(keep) == MiB
    pool.check_invariants()


def test_vmm_an_in_use_pools_memory_is_not_lent_under_a_budget():
    _, pool = make(True, limit=8 * MiB)
    a = pool.allocate(6 * MiB, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    pool.release_cached()
    assert pool.allocate(6 * MiB) == 0  # the budget is the pool's 6 MiB plus 2: not enough
    assert pool.restore_private_pool(ckpt)["allocated"] == [a]
    pool.check_invariants()
    pool.release_private_pool(POOL)
    pool.free(a)
    hog = pool.allocate(6 * MiB)  # released and empty: its memory serves others
    assert hog
    pool.check_invariants()


def test_cuda_malloc_an_in_use_pool_keeps_its_segments_for_a_restore():
    _, pool = make(False)
    a = pool.allocate(4096, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    pool.free(a)
    assert pool.release_cached() == 0  # frozen while in use (Note [Private pools])
    b = pool.allocate(512, pool=POOL)
    pool.free(b)
    assert pool.restore_private_pool(ckpt)["allocated"] == [a]
    pool.check_invariants()
    pool.release_private_pool(POOL)
    pool.free(a)  # released and now empty: its segment goes back
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0
    pool.check_invariants()


@both
def test_bad_pools_and_bad_checkpoints_raise_and_change_nothing(vmm):
    _, pool = make(vmm)
    a = pool.allocate(4096, pool=POOL)
    b = pool.allocate(4096, pool=POOL)
    ckpt = pool.checkpoint_private_pool(POOL)
    with pytest.raises(_C.PoolError, match="default pool"):
        pool.checkpoint_private_pool(0)
    with pytest.raises(_C.PoolError, match="no private pool 42"):
        pool.checkpoint_private_pool(42)
    with pytest.raises(_C.PoolError, match="no private pool 42"):
        pool.restore_private_pool(dict(ckpt, pool=42))
    pool.free(b)
    before = pool.snapshot()["segments"]
    unsorted = dict(ckpt, blocks=list(reversed(ckpt["blocks"])))
    with pytest.raises(_C.PoolError, match="out of address order"):
        pool.restore_private_pool(unsorted)
    zero = dict(ckpt, blocks=[dict(ckpt["blocks"][0], size=0)])
    with pytest.raises(_C.PoolError, match="has size 0"):
        pool.restore_private_pool(zero)
    foreign = dict(ckpt, blocks=[dict(ckpt["blocks"][0], addr=pool.allocate(4096))])
    with pytest.raises(_C.PoolError, match="outside the pool's memory"):
        pool.restore_private_pool(foreign)
    with pytest.raises(ValueError, match="expected the dict"):
        pool.restore_private_pool({"blocks": []})
    segs = [s for s in pool.snapshot()["segments"] if s["pool"] == POOL]
    assert segs == [s for s in before if s["pool"] == POOL]
    assert pool.block_size(a) == 4096
    pool.release_private_pool(POOL)  # a still live: released, not yet gone
    with pytest.raises(_C.PoolError, match="was released"):
        pool.restore_private_pool(ckpt)
    pool.free(a)
    pool.check_invariants()


@both
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_random_checkpoints_and_restores(vmm, seed):
    """Random allocs and frees in the private pool (and the default one), with
    checkpoints taken at random and restored out of order: after each restore
    the pool's live set is the checkpoint's, and the invariants hold."""
    rng = random.Random(seed)
    _, pool = make(vmm)
    live = {}  # addr -> pool id
    ckpts = []
    sizes = [512, 1000, 4096, 70_000, MiB, 3 * MiB]
    for step in range(400):
        r = rng.random()
        if r < 0.45 or not live:
            pid = POOL if rng.random() < 0.8 else 0
            addr = pool.allocate(rng.choice(sizes) + rng.randrange(512), pool=pid)
            assert addr
            live[addr] = pid
        elif r < 0.85:
            addr = rng.choice(sorted(live))
            pool.free(addr)
            del live[addr]
        elif r < 0.93:
            ckpts.append(pool.checkpoint_private_pool(POOL))
        elif ckpts:
            ckpt = rng.choice(ckpts)
            delta = pool.restore_private_pool(ckpt)
            for addr in delta["freed"]:
                del live[addr]
            for addr in delta["allocated"]:
                live[addr] = POOL
            assert live_of(pool) == ckpt_set(ckpt), f"seed {seed} step {step}"
        if step % 10 == 0:
            pool.check_invariants()
    pool.check_invariants()
