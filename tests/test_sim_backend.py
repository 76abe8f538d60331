"""The simulated backend: addresses, capacity, costs, events, host memory, and
its role as a checker (misuse raises instead of corrupting state)."""

import pytest

from torchmem._loader import _C

MiB = 1 << 20
G = 2 * MiB


def test_defaults_and_name():
    sim = _C.SimBackend()
    assert sim.name == "sim"
    assert sim.granularity == G
    assert sim.supports_vmm
    assert sim.device_used() == 0
    assert sim.modeled_us() == 0.0
    free, total = sim.mem_info()
    assert free == total == 80 << 30
    assert set(sim.counters()) == {
        "reserve_calls", "create_calls", "release_calls", "map_calls", "unmap_calls", "device_sync_calls",
        "segment_alloc_calls", "segment_free_calls", "event_record_calls", "event_sync_calls",
        "stream_wait_calls",
    }


def test_bad_config_is_value_error():
    with pytest.raises(ValueError, match="granularity"):
        _C.SimBackend(granularity=3 * MiB)
    with pytest.raises(ValueError, match="capacity"):
        _C.SimBackend(capacity=0)
    with pytest.raises(ValueError, match="unknown key 'bogus_us'"):
        _C.SimBackend(costs={"bogus_us": 1.0})


def test_vmm_primitives_count_and_cost():
    sim = _C.SimBackend(capacity=8 * G, costs={"create_us": 10, "map_us": 1, "set_access_us": 0,
                                               "unmap_us": 5, "release_us": 2, "reserve_us": 0})
    base = sim.reserve(16 * G)
    assert base % G == 0 and base != 0
    handles = [sim.create_granule() for _ in range(3)]
    assert all(handles) and len(set(handles)) == 3
    assert sim.device_used() == 3 * G
    sim.map(base + G, handles)
    sim.unmap(base + G, 2)
    sim.unmap(base + 3 * G, 1)
    for h in handles:
        sim.release_granule(h)
    sim.unreserve(base, 16 * G)
    c = sim.counters()
    assert (c["create_calls"], c["map_calls"], c["unmap_calls"], c["release_calls"]) == (3, 3, 3, 3)
    assert sim.modeled_us() == pytest.approx(3 * 10 + 3 * 1 + 3 * 5 + 3 * 2)
    assert sim.device_used() == 0


def test_the_default_prices_are_readable_and_are_the_ones_charged():
    prices = _C.sim_costs()
    assert prices["create_us"] > 0 and prices["unmap_us"] > 0 and prices["device_sync_us"] > 0
    default, explicit = _C.SimBackend(capacity=8 * G), _C.SimBackend(capacity=8 * G, costs=prices)
    for sim in (default, explicit):
        base = sim.reserve(4 * G)
        handles = [sim.create_granule() for _ in range(2)]
        sim.map(base, handles)
        sim.unmap(base, 2)
        for h in handles:
            sim.release_granule(h)
    assert default.modeled_us() == explicit.modeled_us() == pytest.approx(
        prices["reserve_us"] + 2 * (prices["create_us"] + prices["map_us"] + prices["set_access_us"]
                                    + prices["unmap_us"] + prices["release_us"]))


def test_capacity_makes_create_return_zero():
    sim = _C.SimBackend(capacity=2 * G)
    assert sim.create_granule() and sim.create_granule()
    assert sim.create_granule() == 0
    assert sim.counters()["create_calls"] == 2


def test_misuse_raises():
    sim = _C.SimBackend(capacity=8 * G)
    base = sim.reserve(4 * G)
    h = sim.create_granule()
    sim.map(base, [h])
    with pytest.raises(RuntimeError, match="already mapped"):
        sim.map(base, [sim.create_granule()])
    with pytest.raises(RuntimeError, match="still mapped"):
        sim.release_granule(h)
    with pytest.raises(RuntimeError, match="not mapped"):
        sim.unmap(base + G, 1)
    with pytest.raises(RuntimeError, match="reserved range"):
        sim.map(base + 4 * G, [sim.create_granule()])
    with pytest.raises(RuntimeError, match="without VMM|vmm=True"):
        sim.allocate_segment(G)
    seg_sim = _C.SimBackend(vmm=False)
    with pytest.raises(RuntimeError, match="unknown segment"):
        seg_sim.free_segment(0x1234000, G)
    with pytest.raises(RuntimeError):
        seg_sim.reserve(G)


def test_segments():
    sim = _C.SimBackend(capacity=64 * MiB, vmm=False)
    a = sim.allocate_segment(20 * MiB)
    b = sim.allocate_segment(40 * MiB)
    assert a and b and abs(b - a) >= 20 * MiB
    assert sim.allocate_segment(8 * MiB) == 0  # over capacity
    assert sim.device_used() == 60 * MiB
    with pytest.raises(RuntimeError, match="has 20971520 bytes"):
        sim.free_segment(a, 10 * MiB)
    sim.free_segment(a, 20 * MiB)
    sim.free_segment(b, 40 * MiB)
    assert sim.device_used() == 0
    c = sim.counters()
    assert c["segment_alloc_calls"] == 2 and c["segment_free_calls"] == 2


def test_event_delay():
    sim = _C.SimBackend(event_delay=2)
    e = sim.record_event(7)
    assert not sim.event_completed(e)
    assert not sim.event_completed(e)
    assert sim.event_completed(e)
    e2 = sim.record_event(7)
    sim.synchronize_event(e2)
    assert sim.event_completed(e2)
    sim.destroy_event(e)
    sim.destroy_event(e2)
    with pytest.raises(RuntimeError, match="unknown event"):
        sim.event_completed(e)
    assert sim.counters()["event_record_calls"] == 2
    assert sim.counters()["event_sync_calls"] == 1


def test_host_memory_patterns_follow_the_granule():
    sim = _C.SimBackend(capacity=8 * G, host_memory=True)
    base = sim.reserve(8 * G)
    h1, h2 = sim.create_granule(), sim.create_granule()
    sim.map(base, [h1, h2])
    sim.write_pattern(base + G - 1000, 3000, seed=5)  # straddles two granules
    assert sim.check_pattern(base + G - 1000, 3000, seed=5)
    assert not sim.check_pattern(base + G - 1000, 3000, seed=6)
    # Contents live with the physical granule: swapped, the pattern breaks;
    # mapped back in order, it is intact.
    sim.unmap(base, 2)
    sim.map(base, [h2, h1])
    assert not sim.check_pattern(base + G - 1000, 3000, seed=5)
    sim.unmap(base, 2)
    with pytest.raises(RuntimeError, match="not mapped"):
        sim.check_pattern(base, 16, seed=5)
    sim.map(base, [h1, h2])
    assert sim.check_pattern(base + G - 1000, 3000, seed=5)
    with pytest.raises(RuntimeError, match="host_memory"):
        _C.SimBackend().write_pattern(base, 16, 1)


def test_one_handle_mapped_at_two_places_like_cuda():
    # The pool's alias reclaim maps a live handle at a second address before
    # unmapping the first; both places see the same bytes.
    sim = _C.SimBackend(capacity=4 * G, host_memory=True)
    base = sim.reserve(8 * G)
    h = sim.create_granule()
    sim.map(base, [h])
    sim.map(base + 4 * G, [h])
    sim.write_pattern(base, G, 1)
    assert sim.check_pattern(base, G, 1)
    sim.write_pattern(base + 4 * G, G, 2)   # writes through the alias...
    assert not sim.check_pattern(base, G, 1)  # ...change the bytes behind the first place
    assert sim.check_pattern(base + 4 * G, G, 2)
    assert sim.device_used() == G           # one granule, however often mapped
    # Real misuse is still caught.
    with pytest.raises(RuntimeError, match="already mapped"):
        sim.map(base, [sim.create_granule()])
    sim.unmap(base, 1)
    with pytest.raises(RuntimeError, match="not mapped"):
        sim.unmap(base, 1)
    with pytest.raises(RuntimeError, match="still mapped"):
        sim.release_granule(h)              # still mapped at its second place
    sim.unmap(base + 4 * G, 1)
    sim.release_granule(h)
