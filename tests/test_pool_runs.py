"""Run handles (Note [Run handles], csrc/core/detail/runs.cpp): with no limit set and
far from the device's capacity the pool fills each hole of missing granules with one
driver handle per 256 MiB or 16th of the hole (Note [Run length]); it keeps a handle
per granule above run_below x capacity and under any limit; it never moves a run's
granules, and gives a run back only whole, once every granule of it is free and
behind a device barrier."""

import random

import pytest

from block_cookies import ends_intact, write_ends
from torchmem._loader import _C

MiB = 1 << 20
G = 2 * MiB


def make(limit=0, capacity=1 << 30, host_memory=False, **config):
    sim = _C.SimBackend(capacity=capacity, host_memory=host_memory)
    pool = _C.Pool(sim, dict(dict(debug_checks=True), **config, limit_bytes=limit))
    return sim, pool


def calls(sim):
    return sim.counters()


def test_a_large_block_far_from_the_budget_takes_one_handle():
    sim, pool = make()
    a = pool.allocate(40 * MiB)
    c = calls(sim)
    assert c["create_calls"] == 1 and c["map_calls"] == 1  # 20 granules, one handle
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 40 * MiB
    pool.free(a)
    pool.check_invariants()


def test_small_holes_are_runs_too_and_run_below_zero_takes_a_handle_per_granule():
    sim, pool = make()
    a = pool.allocate(40 * MiB)
    pool.allocate(4 * MiB)   # keeps a's run from growing in place
    pool.free(a)
    pool.allocate(38 * MiB)  # a's run serves it in place
    pool.allocate(22 * MiB)  # the rest of a's 40 MiB (2 MiB) and 10 new granules: one handle
    assert calls(sim)["create_calls"] == 3
    pool.check_invariants()
    sim, pool = make(run_below=0.0)
    pool.allocate(40 * MiB)
    assert calls(sim)["create_calls"] == 20


def test_a_run_maps_20_MiB_ahead_for_the_blocks_after_it():
    # Note [Runs ahead]: test_allocator_fuzz's 2-20 MiB tensors each took a handle of their own
    # after every empty_cache, where PyTorch's 20 MiB segments serve several.
    sim, pool = make()
    a = pool.allocate(6 * MiB)            # 3 granules and 7 ahead: one 20 MiB handle
    assert calls(sim)["create_calls"] == 1
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 20 * MiB
    b = pool.allocate(8 * MiB)            # in the granules ahead: no driver call
    c = pool.allocate(6 * MiB)
    assert calls(sim)["create_calls"] == 1 and calls(sim)["map_calls"] == 1
    assert pool.backing_of(b)["pieces"] == pool.backing_of(a)["pieces"]
    for addr in (a, b, c):
        pool.free(addr)
    assert pool.release_cached() == 20 * MiB   # the run goes back whole
    assert sim.device_used() == 0
    pool.check_invariants()


def test_a_run_maps_ahead_only_where_nothing_is():
    sim, pool = make()
    a = pool.allocate(20 * MiB)
    keep = pool.allocate(2 * MiB)         # a run of its own, mapped 20 MiB ahead
    pool.free(a)
    b = pool.allocate(6 * MiB)            # in a's free run: nothing to create
    assert calls(sim)["create_calls"] == 2
    pool.free(b)
    pool.free(keep)
    pool.check_invariants()
    # Not in the small heap (its requests take one 2 MiB granule, as PyTorch's small segments),
    # not under a limit (no runs there), not above run_below.
    for kwargs, requests, reserved in ((dict(), [512 * 1024], 2 * MiB),
                                       (dict(limit=512 * MiB), [6 * MiB], 6 * MiB),
                                       (dict(capacity=64 * MiB, run_below=0.5), [20 * MiB, 6 * MiB], 26 * MiB)):
        sim, pool = make(**kwargs)
        for request in requests:
            assert pool.allocate(request)
        assert pool.stats()["reserved_bytes"]["all"]["current"] == reserved, (kwargs, requests)
        pool.check_invariants()


def test_above_run_below_the_pool_grows_granule_by_granule():
    sim, pool = make(capacity=128 * MiB, run_below=0.5)
    pool.allocate(40 * MiB)   # held 40 of 128: under half, one handle
    assert calls(sim)["create_calls"] == 1
    pool.allocate(40 * MiB)   # would hold 80 > 64: 20 single granules
    assert calls(sim)["create_calls"] == 21
    pool.check_invariants()


def test_under_a_limit_the_pool_grows_granule_by_granule():
    # Under a budget packing is the point: no runs, so every cached granule can move.
    sim, pool = make(limit=512 * MiB)
    pool.allocate(40 * MiB)
    assert calls(sim)["create_calls"] == 20
    pool.set_limit(0)          # the limit lifted: runs again
    pool.allocate(40 * MiB)
    assert calls(sim)["create_calls"] == 21


def test_run_below_limit_takes_runs_in_the_bottom_of_a_limit():
    # Note [Runs under a limit]: opt-in; granule by granule above the line, no runs ahead.
    sim, pool = make(limit=512 * MiB, run_below_limit=0.5)
    a = pool.allocate(40 * MiB)       # held 40 of 512: one handle
    assert calls(sim)["create_calls"] == 1
    b = pool.allocate(6 * MiB)        # a run of 3, nothing mapped past it under a limit
    assert calls(sim)["create_calls"] == 2
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 46 * MiB
    c = pool.allocate(220 * MiB)      # would hold 266 > 256: 110 single granules
    assert calls(sim)["create_calls"] == 112
    for addr in (a, b, c):
        pool.free(addr)
    pool.check_invariants()
    assert pool.release_cached() == 266 * MiB and sim.device_used() == 0


def test_bad_run_below_limit_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="run_below_limit"):
        make(run_below_limit=-0.1)


def test_a_run_goes_back_whole_and_only_when_wholly_free():
    sim, pool = make()
    a = pool.allocate(40 * MiB)
    pool.free(a)
    b = pool.allocate(4 * MiB)  # reuses the run's first granules in place
    assert calls(sim)["create_calls"] == 1
    assert pool.release_cached() == 0  # the run is partly live: nothing can go
    assert calls(sim)["release_calls"] == 0
    pool.free(b)
    assert pool.release_cached() == 40 * MiB
    c = calls(sim)
    assert c["unmap_calls"] == 1 and c["release_calls"] == 1 and sim.device_used() == 0
    pool.check_invariants()


def test_release_cached_to_gives_back_free_runs():
    sim, pool = make()
    blocks = [pool.allocate(32 * MiB) for _ in range(4)]  # each its own run (tail growth)
    assert calls(sim)["create_calls"] == 4
    for b in blocks[:3]:
        pool.free(b)
    assert pool.release_cached_to(64 * MiB) >= 64 * MiB
    assert sim.device_used() <= 64 * MiB
    pool.check_invariants()


def test_near_capacity_a_free_run_is_released_and_its_room_refilled_granule_by_granule():
    sim, pool = make(capacity=64 * MiB, run_below=0.5, stitch_above=0.0)
    a = pool.allocate(20 * MiB)        # a run of 10 granules (held 20 <= 32)
    c = pool.allocate(40 * MiB)        # above half the budget: 20 single granules
    pool.free(a)
    d = pool.allocate(24 * MiB)        # A's 20 MiB hole is too small: the tail needs 12 granules
    assert d, "the free run should have gone back to make room"
    s = pool.stats()
    assert s["num_ooms"] == 0
    assert s["reserved_bytes"]["all"]["peak"] <= 64 * MiB
    assert calls(sim)["release_calls"] == 1  # the run, whole
    pool.free(c)
    pool.free(d)
    pool.check_invariants()


def full_device_with_a_free_run(run):
    """A 128 MiB device: the pool's free run of `run` bytes, a 20 MiB block after it (the run
    cannot grow in place; 20 MiB, so that it maps nothing ahead), and a neighbour pool
    holding all but 4 MiB of the rest."""
    sim, pool = make(capacity=128 * MiB)
    neighbour = _C.Pool(sim, dict(debug_checks=True))
    a = pool.allocate(run)
    keep = pool.allocate(20 * MiB)
    pool.free(a)
    other = neighbour.allocate(128 * MiB - run - 24 * MiB)
    return sim, pool, neighbour, keep, other


def test_on_a_device_full_of_other_processes_a_free_run_makes_room():
    # No limit: the device itself says no (a neighbour holds the rest). A's free run is given
    # back (behind a device barrier) so that its memory can be created again where it is needed.
    sim, pool, neighbour, keep, other = full_device_with_a_free_run(run=40 * MiB)
    b = pool.allocate(42 * MiB)            # a's 40 MiB hole is too small; the device is full
    assert b, "the free run should have gone back to the device to make room"
    assert pool.stats()["num_ooms"] == 0 and sim.device_used() <= 128 * MiB
    for addr in (b, keep):
        pool.free(addr)
    neighbour.free(other)
    pool.check_invariants()


def test_an_oom_that_free_runs_cannot_serve_keeps_them():
    # Note [OOM ladder]: giving the cache back only to fail anyway would make the next
    # request create it all again.
    sim, pool, neighbour, keep, other = full_device_with_a_free_run(run=32 * MiB)
    before = dict(sim.counters())
    assert pool.allocate(80 * MiB) == 0    # 32 cached + 4 free < 80
    after = sim.counters()
    assert after["unmap_calls"] == before["unmap_calls"]  # the run stayed
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 52 * MiB
    assert pool.allocate(30 * MiB)         # and serves what fits in it
    pool.free(keep)
    neighbour.free(other)
    pool.check_invariants()


def test_a_run_is_never_unmapped_under_a_kernel_of_another_stream():
    # Note [Device barrier]: a tensor freed without record_stream may still be read on a
    # stream the pool never heard of. The run goes back only behind a device barrier.
    sim, pool = make(capacity=64 * MiB, run_below=0.5, stitch_above=0.0)
    a = pool.allocate(20 * MiB, 1)
    sim.launch(2, a, 20 * MiB, 10**9)   # a reader on stream 2 that never finishes by itself
    c = pool.allocate(40 * MiB, 1)
    pool.free(a)
    d = pool.allocate(24 * MiB, 1)       # releasing a's run must wait for the whole device
    assert d and sim.kernels_in_flight() == 0
    assert pool.stats()["num_sync_all_streams"] >= 1
    pool.free(c)
    pool.free(d)


def test_data_in_a_run_stays_put_while_other_runs_come_and_go():
    sim, pool = make(host_memory=True, capacity=256 * MiB)
    keep = pool.allocate(30 * MiB)
    sim.write_pattern(keep, 30 * MiB, 7)
    for _ in range(3):
        x = pool.allocate(50 * MiB)
        sim.write_pattern(x, 50 * MiB, 9)
        pool.free(x)
        pool.release_cached()
    assert sim.check_pattern(keep, 30 * MiB, 7)
    pool.check_invariants()


def test_sim_refuses_what_the_driver_refuses_of_a_run():
    sim = _C.SimBackend(capacity=1 << 30)
    base = sim.reserve(64 * MiB)
    h = sim.create_run(4)
    with pytest.raises(RuntimeError, match="map_run"):
        sim.map_run(base, h, 2)               # a run maps whole
    with pytest.raises(RuntimeError, match="use map_run"):
        sim.map(base, [h])
    sim.map_run(base, h, 4)
    with pytest.raises(RuntimeError, match="unmap_run unmaps it whole"):
        sim.unmap(base + G, 1)                # no slices
    with pytest.raises(RuntimeError, match="still mapped"):
        sim.release_granule(h)
    with pytest.raises(RuntimeError, match="no run of 4 granules"):
        sim.unmap_run(base + G, 4)            # only from its first granule
    sim.unmap_run(base, 4)
    sim.release_granule(h)
    assert sim.device_used() == 0
    with pytest.raises(RuntimeError, match="at least 2 granules"):
        sim.create_run(1)


def test_bad_run_below_is_refused_with_the_field_named():
    with pytest.raises(ValueError, match="run_below"):
        make(run_below=1.5)


def test_a_huge_hole_takes_runs_above_run_below():
    # Note [Huge holes]: 8 GiB or more missing at once is taken in runs whatever the pool holds
    # (Note [Run length]: with no limit, 16 runs for a hole this long); smaller growth above
    # run_below still goes granule by granule
    sim, pool = make(capacity=64 << 30, run_below=0.5)
    a = pool.allocate(30 << 30)   # 30 of 64 GiB: under half, 16 runs
    assert calls(sim)["create_calls"] == 16
    b = pool.allocate(10 << 30)   # would hold 40 > 32 GiB, but 5,120 granules at once: 16 runs
    assert calls(sim)["create_calls"] == 16 + 16
    c = pool.allocate(1 << 30)    # 512 granules above run_below: one each
    assert calls(sim)["create_calls"] == 32 + 512
    for addr in (a, b, c):
        pool.free(addr)
    pool.check_invariants()
    pool.release_cached()
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0


def test_without_a_limit_a_run_is_256_MiB_or_a_16th_of_its_hole():
    # Note [Run length]: 2 GiB and one byte is 1,025 granules: nine runs of 113-114 (none short
    # enough to map ahead: nothing past the tensor is mapped); 8 GiB is 4,096 granules: 16 runs of 256
    sim, pool = make(capacity=64 << 30)
    a = pool.allocate((2 << 30) + 1)
    c = calls(sim)
    assert c["create_calls"] == 9 and c["map_calls"] == 9
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 1025 * G
    b = pool.allocate(8 << 30)
    assert calls(sim)["create_calls"] == 9 + 16
    pool.free(a)
    pool.free(b)
    pool.release_cached()
    assert calls(sim)["release_calls"] == 25
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0


def test_a_small_block_of_another_stream_keeps_at_most_its_run_of_a_freed_tensor():
    # Note [Run length]: PyTorch's test_device_memory_used after test_randint_generation_for_large_numel
    # and a cuBLAS workspace. Stream 1 frees a 2 GiB and a 16 GiB tensor; a 32 MiB block of stream 2
    # is handed memory there (Note [Cross-stream reuse]) and outlives empty_cache, which still returns
    # all but the one 256 MiB run the block lies in, where one run for the tensor kept 2 GiB
    sim, pool = make(capacity=80 << 30)
    kept = [pool.allocate(32 * MiB, 1) for _ in range(2)] + [pool.allocate(6 * MiB, 1)]
    pool.release_cached()
    before = pool.stats()["reserved_bytes"]["all"]["current"]
    big = [pool.allocate((2 << 30) + 1, 1), pool.allocate(16 << 30, 1)]
    for addr in reversed(big):
        pool.free(addr)
    workspace = pool.allocate(32 * MiB, 2)
    assert big[0] <= workspace < big[0] + (2 << 30)  # it lies in the freed tensor's memory
    pool.release_cached()
    pool.check_invariants()
    assert pool.stats()["reserved_bytes"]["all"]["current"] <= before + 256 * MiB
    for addr in kept + [workspace]:
        pool.free(addr)
    pool.release_cached()
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0


@pytest.mark.parametrize("backed_fit", [True, False])
def test_a_limit_set_after_empty_cache_lets_requests_use_the_free_memory_a_live_run_keeps(backed_fit):
    # PyTorch's test_max_split_expandable sets a memory fraction of memory_reserved() + 120 MiB after
    # empty_cache and expects a fourth 40 MiB tensor to fail. The limit bounds what the pool holds, as
    # a memory fraction bounds PyTorch's reserved segments, and memory already held serves requests
    # (PyTorch's allocator serves them from the free blocks of its segments the same way). Here a
    # 32 MiB block of another stream keeps its 256 MiB run through empty_cache (Note [Run length]),
    # so all four fit in that run and the pool holds no more than it did: docs/compatibility.md.
    sim, pool = make(capacity=80 << 30, backed_fit=backed_fit)
    tensor = pool.allocate(256 * MiB, 1)
    pool.free(tensor)
    workspace = pool.allocate(32 * MiB, 2)
    assert tensor <= workspace < tensor + 256 * MiB
    pool.release_cached()
    held = pool.stats()["reserved_bytes"]["all"]["current"]
    assert held == 256 * MiB
    pool.set_limit(held + 120 * MiB)
    blocks = [pool.allocate(40 * MiB, 0) for _ in range(4)]
    assert all(blocks)
    assert all(tensor <= b < tensor + 256 * MiB for b in blocks)
    assert pool.stats()["reserved_bytes"]["all"]["current"] == held
    # with nothing free in what it holds, the limit refuses the fourth, as the test expects
    for b in blocks:
        pool.free(b)
    pool.free(workspace)
    pool.release_cached()
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0
    pool.set_limit(120 * MiB)
    blocks = [pool.allocate(40 * MiB, 0) for _ in range(3)]
    assert all(blocks)
    assert pool.allocate(40 * MiB, 0) == 0
    pool.check_invariants()


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("delay", [0, 20])
def test_cut_runs_survive_churn_across_streams_empty_cache_and_limits(seed, delay):
    # Note [Run length] under churn: blocks from bytes to 2.3 GiB on three streams, frees,
    # empty_cache and a limit set and lifted at random, fences late (delay) or not. Every block
    # keeps the bytes written at its ends, the invariants hold after every call (debug_checks),
    # the only OOMs come while a limit is set, and at the end every handle goes back
    rng = random.Random(seed)
    sim = _C.SimBackend(capacity=24 << 30, vmm=True, host_memory=True, event_delay=delay)
    pool = _C.Pool(sim, {"debug_checks": True})
    live, limited, ooms_unlimited, huge = {}, False, 0, 0

    def free(addr):
        size, cookie = live.pop(addr)
        assert ends_intact(sim, addr, size, cookie), (seed, delay, addr, size)
        pool.free(addr)

    for _ in range(1500):
        r = rng.random()
        if r < 0.55 or not live:
            u = rng.random()
            size = (rng.randint(1, MiB) if u < 0.6 else rng.randint(2 * MiB, 64 * MiB) if u < 0.9
                    else rng.randint(256 * MiB, 2300 * MiB))
            try:
                addr = pool.allocate(size, rng.choice([0, 1, 2]))
            except RuntimeError:
                addr = 0
            if not addr:
                ooms_unlimited += not limited
                continue
            huge += size >= 256 * MiB
            cookie = rng.getrandbits(32)
            write_ends(sim, addr, size, cookie)
            live[addr] = (size, cookie)
        elif r < 0.95:
            free(rng.choice(list(live)))
        elif r < 0.98:
            pool.release_cached()
        else:
            limit = rng.choice([0, 0, 12 << 30, 20 << 30])
            pool.set_limit(limit)
            limited = limit != 0
        if len(live) > 60:
            for addr in rng.sample(list(live), 30):
                free(addr)
    assert huge > 50 and ooms_unlimited == 0
    for addr in list(live):
        free(addr)
    pool.release_cached()
    assert sim.device_used() == 0


def test_a_huge_hole_takes_one_handle_under_a_limit_too():
    # Note [Huge holes]: a memory fraction of half the card and a request for just under it
    # (PyTorch's test_set_per_process_memory_fraction) is one handle, not 4,000+; smaller
    # growth under the limit still goes granule by granule, and the run goes back whole
    sim, pool = make(limit=40 << 30, capacity=64 << 30)
    a = pool.allocate(9 << 30)
    assert calls(sim)["create_calls"] == 1
    b = pool.allocate(64 * MiB)
    assert calls(sim)["create_calls"] == 1 + 32
    pool.free(a)
    pool.free(b)
    pool.check_invariants()
    pool.release_cached()
    assert pool.stats()["reserved_bytes"]["all"]["current"] == 0
    assert calls(sim)["release_calls"] == 1 + 32


def test_capped_runs_under_a_limit_leave_a_huge_hole_whole():
    # limit_run_granules caps growth near the limit, not Note [Huge holes]: the 9 GiB request is
    # still one handle, and ordinary growth under the limit comes in runs of at most 10 granules
    sim, pool = make(limit=40 << 30, capacity=64 << 30, run_below_limit=0.95, limit_run_granules=10)
    a = pool.allocate(9 << 30)
    assert calls(sim)["create_calls"] == 1
    b = pool.allocate(64 * MiB)  # 32 granules: runs of 10, 10, 10 and 2
    assert calls(sim)["create_calls"] == 1 + 4
    pool.free(a)
    pool.free(b)
    pool.check_invariants()


def test_a_wholly_free_huge_run_makes_room_under_a_limit():
    # The run cannot be stitched, but once wholly free it goes back whole when a request
    # needs its room under the budget
    sim, pool = make(limit=12 << 30, capacity=64 << 30)
    a = pool.allocate(9 << 30)
    pool.free(a)
    b = pool.allocate(10 << 30 | 2 * MiB)   # more than the run: its room is needed
    pool.check_invariants()
    assert pool.stats()["reserved_bytes"]["all"]["current"] <= 12 << 30
    pool.free(b)


def test_a_huge_hole_next_to_the_budget_and_beside_cached_granules_is_one_handle():
    # 0.998 of the budget at once (test_set_per_process_memory_fraction's 0.499 under 0.5):
    # above stitch_above, and with cached granules it could stitch, still one handle
    sim, pool = make(limit=20 << 30, capacity=64 << 30)
    small = pool.allocate(1 << 30)                # 512 granules, cached once freed
    pool.free(small)
    created = calls(sim)["create_calls"]
    big = pool.allocate((20 << 30) - (1 << 30) - 8 * MiB)
    assert calls(sim)["create_calls"] == created + 1
    assert pool.stats()["reserved_bytes"]["all"]["current"] <= 20 << 30
    pool.free(big)
    pool.check_invariants()


def _training_like_steps(seed, steps):
    """Ops of steps that each hold tens of 50-400 MiB activations and one 9-10 GiB tensor
    (GPT-2's logits at a large micro-batch), free half the activations in "backward",
    then allocate gradients and free everything."""
    import random

    rng, ops, key = random.Random(seed), [], 0
    for _ in range(steps):
        acts = []
        for _ in range(rng.randrange(20, 40)):
            ops.append(("alloc", key, rng.randrange(50, 400) * MiB))
            acts.append(key)
            key += 1
        big = key
        ops.append(("alloc", big, rng.randrange(9 * 1024, 10 * 1024) * MiB))
        key += 1
        rng.shuffle(acts)
        ops += [("free", k, 0) for k in acts[: len(acts) // 2]] + [("free", big, 0)]
        grads = []
        for _ in range(rng.randrange(10, 30)):
            ops.append(("alloc", key, rng.randrange(20, 300) * MiB))
            grads.append(key)
            key += 1
        ops += [("free", k, 0) for k in acts[len(acts) // 2:] + grads]
    return ops


def test_huge_runs_under_a_limit_pack_steps_with_a_huge_tensor_as_tightly():
    # Note [Huge holes] under a budget: a 9-10 GiB tensor a step as one run leaves the
    # smallest budget the steps fit in where a handle per granule had it (1.0003x peak on
    # the simulator), with fewer handles created
    ops = _training_like_steps(seed=0, steps=12)
    sizes, live, peak = {}, 0, 0
    for op, key, size in ops:
        if op == "alloc":
            sizes[key] = size
            live += size
            peak = max(peak, live)
        else:
            live -= sizes.pop(key)

    def replay(**config):
        sim, pool = make(limit=int(peak * 1.002), capacity=200 << 30, **config)
        addrs, ooms = {}, 0
        for op, key, size in ops:
            if op == "alloc":
                addr = pool.allocate(size)
                ooms += addr == 0
                if addr:
                    addrs[key] = addr
            elif key in addrs:
                pool.free(addrs.pop(key))
        pool.check_invariants()
        return ooms, calls(sim)["create_calls"]

    ooms, creates = replay()
    ooms_per_granule, creates_per_granule = replay(run_below=0.0)
    assert ooms == 0 and ooms_per_granule == 0
    assert creates < creates_per_granule
