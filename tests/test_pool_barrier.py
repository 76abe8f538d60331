"""Note [Device barrier] (csrc/core/pool.h): the pool never unmaps an address
while a kernel on ANY stream may still touch it.

The sim backend models kernels in flight (SimBackend.launch): a kernel on one
stream reading a block that was allocated, and freed, on another stream
without record_stream, as PyTorch's own test_cublas_multiple_threads_same_device
does. The free's own stream is idle, so its fence completes at once; unmapping
the block's granules then would be an illegal-address fault on a GPU, and the
sim raises instead. These scenarios force the pool to stitch exactly those
granules."""

import numpy as np
import pytest

from torchmem._loader import _C

MiB = 1 << 20
DEFAULT, SIDE = 1, 2


def make(limit, event_delay=0, **config):
    sim = _C.SimBackend(capacity=64 * MiB, event_delay=event_delay)
    pool = _C.Pool(sim, dict(dict(stitch_above=0.0, stitch_above_limit=0.0, backed_fit=False, run_below=0.0, debug_checks=True), limit_bytes=limit, **config))
    return sim, pool


def reader_scene(pool, sim, polls=10**6):
    """a (2 granules) allocated on DEFAULT and read by a long kernel on SIDE, then
    freed without record_stream; c stays live after it; b (3 granules) must take
    a's granules: held 6 MiB under an 8 MiB budget leaves room for one new one."""
    a = pool.allocate(4 * MiB, stream=DEFAULT)
    c = pool.allocate(2 * MiB, stream=DEFAULT)
    sim.launch(SIDE, a, 4 * MiB, polls)
    pool.free(a)
    b = pool.allocate(6 * MiB, stream=DEFAULT)
    return a, b, c


@pytest.mark.parametrize("alias_reclaim", [True, False])
def test_stitching_under_a_foreign_kernel_never_unmaps(alias_reclaim):
    sim, pool = make(8 * MiB, alias_reclaim=alias_reclaim)
    a, b, c = reader_scene(pool, sim)
    assert b and pool.stats()["num_reclaims"] == 2
    counters = pool.stats()["backend"]
    assert counters["unmap_calls"] == 0           # a's old place is still mapped
    assert counters["device_sync_calls"] == 0     # and nobody waited for it
    assert sim.kernels_in_flight() == 1
    assert sim.device_used() == 8 * MiB           # the handles are counted once
    pool.check_invariants()


def test_release_cached_retires_pending_places_behind_a_barrier():
    sim, pool = make(8 * MiB)
    a, b, c = reader_scene(pool, sim)
    pool.free(b)
    pool.free(c)
    released = pool.release_cached()
    counters = pool.stats()["backend"]
    assert released == 8 * MiB and sim.device_used() == 0
    assert counters["device_sync_calls"] == 1     # one barrier for everything
    assert counters["unmap_calls"] == 2 + 4       # a's old place, then b and c
    assert sim.kernels_in_flight() == 0
    pool.check_invariants()


def test_mapping_over_a_pending_place_takes_a_barrier_first():
    sim, pool = make(8 * MiB)
    a, b, c = reader_scene(pool, sim)
    pool.free(b)
    # A fresh 4 MiB fits best in a's old place, which is pending: the pool maps
    # there only behind a barrier (the kernel has finished by then).
    d = pool.allocate(4 * MiB, stream=DEFAULT)
    assert d
    counters = pool.stats()["backend"]
    assert counters["device_sync_calls"] <= 1
    if d == a:
        assert counters["device_sync_calls"] == 1 and sim.kernels_in_flight() == 0
    pool.check_invariants()


def test_refused_barrier_keeps_pending_places_and_loses_nothing():
    # During a CUDA graph capture the backend refuses device-wide waits.
    sim, pool = make(8 * MiB)
    a, b, c = reader_scene(pool, sim)
    pool.free(b)
    sim.allow_device_sync(False)
    pool.release_cached()
    assert pool.stats()["backend"]["device_sync_calls"] == 0
    assert sim.kernels_in_flight() == 1           # nothing was unmapped under it
    pool.check_invariants()
    sim.allow_device_sync(True)
    pool.free(c)
    pool.release_cached()
    assert sim.device_used() == 0 and sim.kernels_in_flight() == 0
    pool.check_invariants()


def test_the_sim_catches_an_unmap_under_a_kernel():
    # The guard itself: unmapping under a kernel in flight is refused, and the
    # kernel retires once an event recorded after it on its stream completes.
    sim = _C.SimBackend(capacity=64 * MiB)
    base = sim.reserve(8 * MiB)
    h = sim.create_granule()
    sim.map(base, [h])
    sim.launch(SIDE, base, 4096, 10**6)
    with pytest.raises(RuntimeError, match="illegal-address"):
        sim.unmap(base, 1)
    other = sim.record_event(DEFAULT)
    assert sim.event_completed(other)             # another stream's work does not wait for it
    mine = sim.record_event(SIDE)
    assert not sim.event_completed(mine)
    sim.synchronize_event(mine)
    assert sim.kernels_in_flight() == 0
    sim.unmap(base, 1)
    for e in (other, mine):
        sim.destroy_event(e)
    sim.release_granule(h)
    sim.unreserve(base, 8 * MiB)


def test_with_room_to_spare_the_pool_creates_instead_of_stitching():
    # Note [When to stitch]: under the line (stitch_above_limit x the limit) nothing is moved.
    sim, pool = make(64 * MiB, stitch_above_limit=0.8)
    a, b, c = reader_scene(pool, sim)
    s = pool.stats()
    assert s["num_reclaims"] == 0 and s["backend"]["unmap_calls"] == 0
    assert sim.device_used() == 12 * MiB
    pool.check_invariants()


def test_a_granule_freed_by_two_streams_goes_to_either_only_behind_a_barrier():
    # Note [Cross-stream reuse]: a (DEFAULT) and b (SIDE) share granule 0; b's
    # free puts it on SIDE's list, but DEFAULT may still be working on a, which
    # SIDE's fence does not cover: a request on SIDE takes the granule only
    # behind a barrier (the OOM ladder's step 4).
    sim, pool = make(8 * MiB)
    a = pool.allocate(1536 << 10, stream=DEFAULT)   # granule 0
    b = pool.allocate(1536 << 10, stream=SIDE)      # granules 0-1
    keep = pool.allocate(2 * MiB, stream=SIDE)      # granules 1-2: 6 MiB held
    pool.free(a)
    pool.free(b)
    # 4 MiB fits only past keep: one new granule under the budget, one from granule 0.
    assert pool.allocate(4 * MiB, stream=SIDE)
    s = pool.stats()
    assert s["num_reclaims"] == 1 and s["backend"]["device_sync_calls"] == 1
    assert keep
    pool.check_invariants()


@pytest.mark.parametrize("stream_order", [True, False, "refused"])
def test_memory_another_stream_freed_is_reused_only_behind_a_wait_or_a_barrier(stream_order):
    """Note [Cross-stream reuse]: with more than a few best-fit candidates freed on another
    stream (their events still pending), a request never gets one of them as it is: only
    behind a device-side wait on the freeing stream (stream_order, the default) or a device
    barrier ("refused": the backend cannot add a wait, as during a capture). The best fit
    used to hand out the 17th such block as it was."""
    sim = _C.SimBackend(capacity=1024 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True, stream_order=stream_order is not False))
    if stream_order == "refused":
        sim.allow_stream_order(False)
        stream_order = False
    blocks = [pool.allocate(4 * MiB + 512 * k, stream=DEFAULT) for k in range(40)]
    freed = blocks[0::2]  # every other one: they stay apart, none merges
    for addr in freed:
        pool.free(addr)
    barriers, waits = pool.stats()["num_device_barriers"], sim.counters()["stream_wait_calls"]
    addr = pool.allocate(4 * MiB, stream=SIDE)
    assert addr in freed  # the best fit, once ordered
    ordered = (pool.stats()["num_device_barriers"] - barriers, sim.counters()["stream_wait_calls"] - waits)
    assert ordered == ((0, 1) if stream_order else (1, 0))
    # one wait covers every earlier free of that stream
    assert pool.allocate(4 * MiB + 512 * 2, stream=SIDE) in freed
    assert sim.counters()["stream_wait_calls"] - waits == ordered[1]
    pool.check_invariants()


THIRD, LEGACY = 3, 0  # 0: the legacy default stream, a stream like any other


# (current stream at the free, stream that asks next) -> device-side waits that hand the block over
@pytest.mark.parametrize("freed_under, asked_on, waits", [
    (None, THIRD, 1),     # current stream unknown: the freeing stream's wait alone
    (DEFAULT, THIRD, 1),  # freed where it was made: no reader
    (SIDE, THIRD, 2),     # read on SIDE: a third stream waits for SIDE too
    (LEGACY, THIRD, 2),   # the same with the legacy default stream as the reader
    (SIDE, SIDE, 1),      # the reader itself: stream order covers its read
    (SIDE, DEFAULT, 0),   # the allocation stream reuses it at once, as natively
])
def test_a_block_freed_under_another_stream_goes_to_a_third_only_behind_both(freed_under, asked_on, waits):
    """Note [Freed under another stream]: a worker thread reads a tensor of the default
    stream on its own stream and drops it there (PyTorch's
    test_cusparse_multiple_threads_same_device). With no limit, another stream's request
    takes that cached block when the device is full (and rather than new memory, when the
    block backs the whole request); it must wait for the reader's work as well as the
    freeing stream's, or its kernels write under the read."""
    sim = _C.SimBackend(capacity=8 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    a = pool.allocate(4 * MiB, stream=DEFAULT)
    keep = pool.allocate(4 * MiB, stream=DEFAULT)  # a stays a block of its own
    pool.free(a, **({} if freed_under is None else dict(current_stream=freed_under)))
    before = pool.stats()["num_device_barriers"], sim.counters()["stream_wait_calls"]
    assert pool.allocate(4 * MiB, stream=asked_on) == a
    after = pool.stats()["num_device_barriers"], sim.counters()["stream_wait_calls"]
    assert (after[0] - before[0], after[1] - before[1]) == (0, waits)
    assert keep
    pool.check_invariants()


def test_a_reader_survives_a_merge_and_a_capture_refuses_the_waits():
    """Two neighbours freed on DEFAULT, one under SIDE: the merged block goes to a third
    stream behind waits on both (the mixed tag walks every stream); with waits refused
    (a capture) only a barrier hands it over."""
    sim = _C.SimBackend(capacity=12 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    a = pool.allocate(4 * MiB, stream=DEFAULT)
    b = pool.allocate(4 * MiB, stream=DEFAULT)
    keep = pool.allocate(4 * MiB, stream=DEFAULT)
    pool.free(a, current_stream=SIDE)
    pool.free(b)
    waits = sim.counters()["stream_wait_calls"]
    assert pool.allocate(8 * MiB, stream=THIRD) == a
    assert sim.counters()["stream_wait_calls"] - waits == 2
    pool.free(a, current_stream=SIDE)  # freed on THIRD, read on SIDE
    sim.allow_stream_order(False)
    barriers = pool.stats()["num_device_barriers"]
    assert pool.allocate(8 * MiB, stream=DEFAULT) == a
    assert pool.stats()["num_device_barriers"] - barriers == 1
    assert keep
    pool.check_invariants()


def test_a_deferred_free_also_waits_for_the_stream_current_at_the_free():
    """Note [Record stream] with Note [Freed under another stream]: a block recorded on
    THIRD and freed under SIDE waits for an event on each before it is free."""
    sim = _C.SimBackend(capacity=1024 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    a = pool.allocate(4 * MiB, stream=DEFAULT)
    pool.record_stream(a, THIRD)
    events = sim.counters()["event_record_calls"]
    pool.free(a, current_stream=SIDE)
    assert sim.counters()["event_record_calls"] - events == 2
    assert pool.stats()["num_deferred_frees"] == 1
    pool.check_invariants()


@pytest.mark.parametrize("seed", range(6))
def test_two_streams_share_one_cache_with_no_limit(seed):
    """Note [Cross-stream reuse]: FSDP-like steps, each layer's weights gathered on a
    stream of their own. With no limit, a request that would need new memory takes a
    block the other stream cached, behind a device-side wait, so the two streams do not
    grow a cache each: peak reserved within 1% of the native model's (a cache per
    stream), where it was up to twice it."""
    from torchmem.analysis import patterns, replay

    events = np.asarray(patterns.training_steps(10, layers=8, seed=seed, side_stream=7), dtype=np.int64)
    shared = replay.replay(events, event_delay=10)
    native = replay.replay(events, "native", event_delay=10)
    apart = replay.replay(events, event_delay=10, config="stream_order=false")
    assert shared.ooms == 0 and shared.device_barriers == 0
    assert shared.ratio <= native.ratio * 1.01
    assert shared.peak_reserved <= apart.peak_reserved


def scope(sim):
    """A MemPool scope or a capture (torch.compile's cudagraph trees warm up in one):
    the backend refuses device barriers and stream waits."""
    sim.allow_device_sync(False)
    sim.allow_stream_order(False)


def test_a_reader_joins_a_merge_of_the_same_stream_and_its_stream_reuses_it_in_a_scope():
    """Note [Freed under another stream]: cudagraph trees free a warm-up's outputs under the
    default stream, its other blocks on the tree's own stream. Merged, the two neighbours
    are one stream's frees with one reader: the tree's stream takes them at once, with no
    wait and no barrier, which a scope refuses (the merged block was tagged as freed by
    several streams, and the warm-up ran out of memory with the device empty)."""
    sim = _C.SimBackend(capacity=64 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    pool.create_private_pool(1)
    tree = SIDE
    a = pool.allocate(4 * MiB, stream=tree, pool=1)
    b = pool.allocate(4 * MiB, stream=tree, pool=1)
    pool.free(a, current_stream=DEFAULT)  # read under the default stream
    pool.free(b)
    scope(sim)
    assert pool.allocate(8 * MiB, stream=tree, pool=1) == a
    assert pool.stats()["num_ooms"] == 0
    pool.free(a, current_stream=DEFAULT)
    # a third stream would wait for the tree's stream and the reader; the scope refuses
    # waits, so it takes the unmapped memory past a
    assert pool.allocate(8 * MiB, stream=THIRD, pool=1) >= a + 8 * MiB
    assert pool.stats()["num_ooms"] == 0 and sim.counters()["stream_wait_calls"] == 0
    pool.check_invariants()


@pytest.mark.parametrize("private", [False, True])
def test_in_a_scope_a_request_fenced_off_every_cached_block_takes_the_unmapped_tail(private):
    """Note [Unmapped tail]: with waits and barriers refused, memory another stream freed
    cannot be handed over; the request takes unmapped memory past it (PyTorch's allocator
    makes a new segment), not an out-of-memory error with the device empty."""
    sim = _C.SimBackend(capacity=64 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    pid = 1 if private else 0
    if private:
        pool.create_private_pool(pid)
    a = pool.allocate(4 * MiB, stream=DEFAULT, pool=pid)
    b = pool.allocate(1 * MiB, stream=DEFAULT, pool=pid)  # its granule also holds what follows it
    pool.free(a)
    pool.free(b)
    scope(sim)
    c = pool.allocate(4 * MiB, stream=SIDE, pool=pid)
    assert c and c >= b + 2 * MiB  # past b's granule
    assert pool.stats()["num_ooms"] == 0
    pool.free(c)
    sim.allow_device_sync(True)
    sim.allow_stream_order(True)
    assert pool.allocate(8 * MiB, stream=SIDE, pool=pid)
    pool.check_invariants()


def test_in_a_scope_many_streams_each_take_the_tail_without_running_out_of_range():
    """Each stream's first request in a scope takes the unmapped tail past what the
    others cached: the range is used granule by granule, so forty of them fit in a range
    of twice the device (the pool's default)."""
    sim = _C.SimBackend(capacity=256 * MiB, event_delay=1000)
    pool = _C.Pool(sim, dict(debug_checks=True))
    scope(sim)
    taken = []
    for s in range(10, 50):
        taken.append(pool.allocate(4 * MiB, stream=s))
        pool.free(taken[-1])
    assert all(taken) and len(set(taken)) == 40
    stats = pool.stats()
    assert stats["num_ooms"] == 0 and stats["num_device_barriers"] == 0
    pool.check_invariants()


@pytest.mark.parametrize("limit", [None, 176 * MiB])  # 172 MiB held with no limit
def test_cudagraph_tree_warm_ups_reuse_their_own_memory_in_a_scope(limit):
    """torch.compile's cudagraph trees, step by step: each warm-up (and the recording) runs
    in a MemPool scope on the tree's own stream, which refuses waits and barriers; its
    intermediates die there, its outputs are read and dropped on the default stream after
    the scope. The next scope's requests must find the tree's memory again, merged, with
    no out-of-memory error and no more memory held from the second warm-up on; an unmap
    under the default stream's reads would raise in the sim."""
    sim = _C.SimBackend(capacity=512 * MiB, event_delay=3)
    config = dict(debug_checks=True)
    if limit:
        config["limit_bytes"] = limit
    pool = _C.Pool(sim, config)
    tree, graph_pool = SIDE, 1
    params = pool.allocate(48 * MiB, stream=DEFAULT)  # the model, eager
    pool.create_private_pool(graph_pool)
    workspace = None
    held = []
    for _ in range(4):
        scope(sim)
        if workspace is None:  # cuBLAS's workspace, made on the tree's stream at its first matmul
            workspace = pool.allocate(32 * MiB, stream=tree, pool=graph_pool)
        acts = [pool.allocate(s * MiB + 4096, stream=tree, pool=graph_pool) for s in (12, 4, 20, 8, 16, 6)]
        for a in acts[1:5]:
            pool.free(a)  # intermediates die on the tree's stream, inside the scope
        outputs = [acts[0], acts[5]]
        sim.allow_device_sync(True)
        sim.allow_stream_order(True)
        for out in outputs:  # the caller reads the outputs on the default stream, then drops them
            sim.launch(DEFAULT, out, MiB, 10**6)
            pool.free(out, current_stream=DEFAULT)
        grad = pool.allocate(24 * MiB, stream=DEFAULT)  # eager work between the steps
        pool.free(grad)
        assert pool.stats()["num_ooms"] == 0
        held.append(sim.device_used())
        pool.check_invariants()
    assert held[1] == held[2] == held[3], held
    pool.free(workspace)
    pool.free(params)
