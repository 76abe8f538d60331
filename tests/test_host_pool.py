"""The pinned host pool's policy on the simulated backend (CPU, no GPU):
size classes, reuse, stream-safe reuse with simulated events, limits and
out-of-memory errors, fallbacks with warnings, NUMA and THP parsing."""

import warnings

import pytest
import torch

from torchmem import host
from torchmem._loader import _C

MiB = 1 << 20


def fake_sysfs(tmp_path, thp="always [madvise] never", nodes=None, pci=None):
    """A sysfs tree: THP mode, the online node list, and PCI devices' numa_node."""
    thp_dir = tmp_path / "kernel" / "mm" / "transparent_hugepage"
    thp_dir.mkdir(parents=True)
    (thp_dir / "enabled").write_text(thp + "\n")
    if nodes is not None:
        node_dir = tmp_path / "devices" / "system" / "node"
        node_dir.mkdir(parents=True)
        (node_dir / "online").write_text(nodes + "\n")
    for bus_id, node in (pci or {}).items():
        dev = tmp_path / "bus" / "pci" / "devices" / bus_id
        dev.mkdir(parents=True)
        (dev / "numa_node").write_text(f"{node}\n")
    return str(tmp_path)


def sim_pool(tmp_path, **sim):
    kwargs = {k: sim.pop(k) for k in ("chunk_mb", "limit_bytes", "require_pinned", "huge_pages") if k in sim}
    sim.setdefault("auto_complete", False)
    return host.HostPool(backend="sim", sysfs_root=fake_sysfs(tmp_path), sim=sim, chunk_mb=kwargs.pop("chunk_mb", 8),
                         **kwargs)


def test_size_classes_waste_at_most_a_quarter():
    last = 0
    for n in list(range(1, 5000, 37)) + [MiB, MiB + 1, 5 * MiB, 5 * MiB + 1, (1 << 30) + 1]:
        c = _C.host_size_class(n)
        assert c >= n and c % 512 == 0
        assert c <= max(512, n * 1.25 + 512), (n, c)
        assert c >= last
        last = c
    assert _C.host_size_class(5 * MiB) == 5 * MiB
    assert _C.host_size_class(5 * MiB + 1) == 6 * MiB  # not 8 MiB as a power of two


def test_blocks_reused_only_after_their_events(tmp_path):
    pool = sim_pool(tmp_path)
    a = pool.empty((1000,), torch.float32, stream=7)
    ptr = a.data_ptr()
    assert pool.stats()["allocations.current"] == 1
    del a
    s = pool.stats()
    assert s["allocations.current"] == 0 and s["pending_bytes"] == 4096 and s["cached_bytes"] == 0
    b = pool.empty((1000,), torch.float32, stream=7)
    assert b.data_ptr() != ptr  # the copy on stream 7 may still run
    pool._pool.complete_events(7)
    c = pool.empty((1000,), torch.float32, stream=7)
    assert c.data_ptr() == ptr  # its event completed: reused
    assert pool.stats()["cache_hits"] == 1
    pool.check()


def test_once_copies_are_reported_only_reported_streams_hold_a_block(tmp_path):
    # torch's host allocator contract: copies report their stream; an unreported block is free at once
    pool = sim_pool(tmp_path)
    pool._pool.set_copies_reported(True)
    a = pool.empty(4096, torch.uint8, stream=1)
    ptr = a.data_ptr()
    del a
    assert pool._pool.open_events() == 0
    b = pool.empty(4096, torch.uint8, stream=1)
    assert b.data_ptr() == ptr  # no copy was reported: reused with no event
    pool.record_stream(b, 2)  # a non_blocking copy on stream 2
    del b
    assert pool._pool.open_events() == 1
    other = pool.empty(4096, torch.uint8, stream=1)
    assert other.data_ptr() != ptr  # the copy may still run
    pool._pool.complete_events(2)
    assert pool.empty(4096, torch.uint8, stream=1).data_ptr() == ptr
    pool.check()


def test_record_stream_waits_for_every_stream(tmp_path):
    pool = sim_pool(tmp_path)
    a = pool.empty(4096, torch.uint8, stream=1)
    pool.record_stream(a, 2)
    ptr = a.data_ptr()
    del a
    assert pool._pool.open_events() == 2
    pool._pool.complete_events(1)
    assert pool.empty(4096, torch.uint8, stream=1).data_ptr() != ptr  # stream 2 still pending
    pool._pool.complete_events(2)
    assert pool.empty(4096, torch.uint8, stream=1).data_ptr() == ptr
    pool.check()


def test_reuse_across_near_classes_and_dedicated_chunks(tmp_path):
    pool = sim_pool(tmp_path, chunk_mb=8, auto_complete=True)
    small = pool.empty(3 * 1024, torch.uint8)
    big = pool.empty(5 * MiB, torch.uint8)  # > chunk / 4: a chunk of its own
    s = pool.stats()
    assert s["chunks"] == 2 and s["held_bytes"] == 8 * MiB + 6 * MiB
    big_ptr = big.data_ptr()
    del big
    again = pool.empty(4 * MiB, torch.uint8)  # class 4 MiB fits the 6 MiB block (< 2x)
    assert again.data_ptr() == big_ptr
    del again
    tiny = pool.empty(1024, torch.uint8)  # 6 MiB is far more than 2x: not taken
    assert tiny.data_ptr() != big_ptr
    del small, tiny
    assert pool.empty_cache() == 14 * MiB
    s = pool.stats()
    assert s["held_bytes"] == 0 and s["chunks"] == 0 and s["num_host_free"] == 2
    pool.check()


def test_stats_follow_torch_names(tmp_path):
    pool = sim_pool(tmp_path, auto_complete=True)
    xs = [pool.empty(1000 + i, torch.uint8) for i in range(5)]
    s = pool.stats()
    assert s["allocations.current"] == 5 and s["allocations.peak"] == 5 and s["allocations.allocated"] == 5
    assert s["active_bytes.current"] == sum(1000 + i for i in range(5))
    assert s["allocated_bytes.current"] == 5 * 1024 and s["num_host_alloc"] == 1
    assert s["pinned_bytes"] == s["held_bytes"] == 8 * MiB
    del xs
    s = pool.stats()
    assert s["allocations.freed"] == 5 and s["allocations.current"] == 0 and s["allocations.peak"] == 5
    pool.reset_peak_stats()
    assert pool.stats()["allocations.peak"] == 0
    pool.check()


def test_tensor_api_shapes_dtypes_and_views(tmp_path):
    pool = sim_pool(tmp_path, auto_complete=True)
    t = pool.empty((3, 4, 5), torch.bfloat16)
    assert t.shape == (3, 4, 5) and t.dtype == torch.bfloat16 and t.is_contiguous()
    t.copy_(torch.arange(60, dtype=torch.bfloat16).view(3, 4, 5))
    view = t[1]
    del t
    assert pool.stats()["allocations.current"] == 1  # the view keeps the block
    assert torch.equal(view, torch.arange(20, 40, dtype=torch.bfloat16).view(4, 5))
    del view
    assert pool.stats()["allocations.current"] == 0
    assert pool.empty((0, 5)).numel() == 0
    src = torch.randn(7, 9)
    pinned = pool.pin(src)
    assert torch.equal(pinned, src) and pool.owns(pinned) and pool.is_pinned(pinned)
    with pytest.raises(ValueError, match="negative"):
        pool.empty((-1,))
    with pytest.raises(ValueError, match="backend"):
        host.HostPool(backend="gpu")
    with pytest.raises(ValueError, match="chunk_mb"):
        host.HostPool(backend="sim", chunk_mb=3)
    pool.check()


def test_limit_exhaustion_is_a_clear_error_and_loses_nothing(tmp_path):
    pool = sim_pool(tmp_path, chunk_mb=4, limit_bytes=8 * MiB, auto_complete=True)
    keep = [pool.pin(torch.full((MiB,), float(i))) for i in range(2)]  # two dedicated 4 MiB chunks
    with pytest.raises(host.HostOutOfMemoryError) as info:
        pool.empty(MiB, torch.float32)
    text = str(info.value)
    assert "cannot allocate 4.00 MiB" in text and "8.00 MiB pinned" in text and "pool limit 8.00 MiB" in text
    assert isinstance(info.value, MemoryError)
    for i, t in enumerate(keep):  # nothing lost
        assert torch.equal(t, torch.full((MiB,), float(i)))
    assert pool.stats()["num_ooms"] == 1
    del keep[0]
    assert pool.empty(MiB, torch.float32).numel() == MiB  # the freed chunk serves it
    pool.set_limit(0)
    assert pool.empty(MiB, torch.float32).numel() == MiB
    pool.check()


def test_system_out_of_memory_waits_for_parked_frees_then_errors(tmp_path):
    pool = sim_pool(tmp_path, chunk_mb=4, capacity_bytes=4 * MiB)
    a = pool.empty(2 * MiB, torch.uint8)  # > chunk / 4: a dedicated 2 MiB chunk
    b = pool.pin(torch.full((2 * MiB,), 3, dtype=torch.uint8))
    ptr = a.data_ptr()
    del a  # parked: its simulated event completes only when waited for
    c = pool.empty(2 * MiB, torch.uint8)  # no room in the system: waits for the parked free
    assert c.data_ptr() == ptr
    with pytest.raises(host.HostOutOfMemoryError, match="system refused a new chunk of 4.00 MiB") as info:
        pool.empty(2 * MiB + 1, torch.uint8)
    assert "capacity 4.00 MiB" in str(info.value)
    assert torch.equal(b, torch.full((2 * MiB,), 3, dtype=torch.uint8))  # nothing lost
    assert pool.stats()["held_bytes"] == 4 * MiB
    pool.check()


def test_refused_pinning_falls_back_with_a_warning(tmp_path):
    pool = sim_pool(tmp_path, refuse_pinning=True, auto_complete=True)
    with pytest.warns(RuntimeWarning, match="pinning .* was refused"):
        t = pool.empty(100)
    assert not pool.is_pinned(t) and pool.stats()["pinned_bytes"] == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # one warning per kind, not per chunk
        pool.empty(20 * MiB)
    strict = host.HostPool(backend="sim", sysfs_root=fake_sysfs(tmp_path / "s"), require_pinned=True,
                           sim={"refuse_pinning": True})
    with pytest.raises(host.HostOutOfMemoryError, match="require_pinned"):
        with pytest.warns(RuntimeWarning):
            strict.empty(100)


def test_memlock_limit_refuses_the_chunk_past_it(tmp_path):
    pool = sim_pool(tmp_path, chunk_mb=4, memlock_bytes=4 * MiB, auto_complete=True)
    a = pool.empty(3 * MiB, torch.uint8)
    with pytest.warns(RuntimeWarning, match="memlock limit 4.00 MiB"):
        b = pool.empty(3 * MiB, torch.uint8)
    assert pool.is_pinned(a) and not pool.is_pinned(b)
    assert pool.stats()["pinned_bytes"] == 4 * MiB and pool.stats()["held_bytes"] == 8 * MiB
    pool.check()


def test_thp_disabled_falls_back_with_a_warning(tmp_path):
    root = fake_sysfs(tmp_path, thp="always madvise [never]")
    pool = host.HostPool(backend="sim", sysfs_root=root, sim={"auto_complete": True})
    with pytest.warns(RuntimeWarning, match="transparent huge pages are disabled"):
        pool.empty(100)
    s = pool.stats()
    assert s["huge_page_bytes"] == 0 and s["thp_mode"] == "never"


def test_huge_pages_asked_and_obtained_or_warned(tmp_path):
    pool = host.HostPool(backend="sim", sysfs_root=fake_sysfs(tmp_path), sim={"auto_complete": True})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t = pool.empty(100)
    s = pool.stats()
    refused = [w for w in caught if "huge" in str(w.message).lower()]
    # madvise(MADV_HUGEPAGE) works where the kernel has THP; else it must say so.
    assert (s["huge_page_bytes"] == s["held_bytes"] and not refused) or (s["huge_page_bytes"] == 0 and refused)
    assert t.data_ptr() % (2 * MiB) == 0  # chunks are 2 MiB-aligned for THP
    off = host.HostPool(backend="sim", huge_pages="off", sysfs_root=fake_sysfs(tmp_path / "o"),
                        sim={"auto_complete": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        off.empty(100)
    assert off.stats()["huge_page_bytes"] == 0
    with pytest.raises(ValueError, match="huge_pages"):
        host.HostPool(backend="sim", huge_pages="yes")


def test_numa_and_thp_parsing(tmp_path):
    root = fake_sysfs(tmp_path, nodes="0-1", pci={"0000:1a:00.0": 1, "0000:2b:00.0": -1})
    assert _C.host_numa_node_of_pci(root, "0000:1A:00.0") == 1
    assert _C.host_numa_node_of_pci(root, "00000000:1A:00.0") == 1  # 8-digit domain from the driver
    assert _C.host_numa_node_of_pci(root, "0000:2B:00.0") == -1     # unknown
    assert _C.host_numa_node_of_pci(root, "0000:3c:00.0") == -1     # missing
    assert _C.host_numa_node_count(root) == 2
    assert _C.host_thp_mode(root) == "madvise"
    for text, count in (("0", 1), ("0,2-3", 3), ("0-7", 8), ("garbage", 1)):
        d = tmp_path / f"n{count}{len(text)}"
        assert _C.host_numa_node_count(fake_sysfs(d, nodes=text)) == count
    assert _C.host_numa_node_count(str(tmp_path / "none")) == 1
    assert _C.host_thp_mode(str(tmp_path / "none")) == ""


def test_pin_batch_and_pinned_loader(tmp_path):
    pool = sim_pool(tmp_path, auto_complete=True)
    batch = {"x": torch.randn(4, 3), "y": [torch.arange(4), 7], "name": "b"}
    out = host.pin_batch(batch, pool)
    assert pool.owns(out["x"]) and pool.owns(out["y"][0]) and out["y"][1] == 7 and out["name"] == "b"
    assert torch.equal(out["x"], batch["x"]) and torch.equal(out["y"][0], batch["y"][0])
    loader = [(torch.full((2, 2), float(i)), torch.tensor(i)) for i in range(5)]
    got = list(host.pinned(loader, pool=pool))
    assert [int(b[1]) for b in got] == list(range(5))
    assert all(pool.owns(b[0]) and torch.equal(b[0], torch.full((2, 2), float(i))) for i, b in enumerate(got))

    def broken():
        yield torch.zeros(1)
        raise KeyError("bad sample")

    with pytest.raises(KeyError, match="bad sample"):
        list(host.pinned(broken(), pool=pool))
    with pytest.raises(ValueError, match="prefetch"):
        list(host.pinned(loader, pool=pool, prefetch=0))
    pool.check()


def test_auto_backend_without_gpu_warns_that_memory_is_pageable(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto picks the CUDA backend")
    with pytest.warns(RuntimeWarning, match="no CUDA GPU .* pageable"):
        pool = host.HostPool(sysfs_root=fake_sysfs(tmp_path))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not again at the first chunk
        t = pool.empty(10)
    assert not pool.is_pinned(t) and pool.stats()["pinned_bytes"] == 0


def test_random_operations_keep_the_bookkeeping_exact(tmp_path):
    """Seeded random allocate / free / record_stream / event completion, with a
    cookie written into every live block and checked before its free (catches
    two live blocks sharing memory) and the invariants checked after each step."""
    import random
    rng = random.Random(1234)
    pool = sim_pool(tmp_path, chunk_mb=4, limit_bytes=64 * MiB)
    live = {}
    for step in range(500):
        op = rng.random()
        if op < 0.5 or not live:
            n = rng.choice([rng.randint(1, 4096), rng.randint(4096, 512 * 1024), rng.randint(MiB, 3 * MiB)])
            try:
                t = pool.empty(n, torch.uint8, stream=rng.randint(1, 3))
            except host.HostOutOfMemoryError:
                pool._pool.complete_events(0)
                continue
            t.fill_(step % 251)
            live[step] = t
        elif op < 0.8:
            key = rng.choice(list(live))
            t = live.pop(key)
            assert bool((t == key % 251).all()), f"block of step {key} was overwritten"
        elif op < 0.9:
            pool.record_stream(live[rng.choice(list(live))], rng.randint(1, 3))
        else:
            pool._pool.complete_events(rng.randint(0, 3))
        pool.check()
    del t  # the loop's last tensor
    live.clear()
    pool._pool.complete_events(0)
    pool.empty_cache()
    s = pool.stats()
    assert s["held_bytes"] == 0 and s["allocations.current"] == 0 and s["pending_bytes"] == 0


def test_public_names_and_torch_hook_refuses_a_simulated_pool(tmp_path):
    import torchmem
    assert torchmem.host is host
    assert torchmem.offload_activations.__module__ == "torchmem.host.offload"
    pool = sim_pool(tmp_path)
    if hasattr(_C, "host_install_torch_allocator"):
        with pytest.raises(ValueError, match="backend='cuda'"):
            host.install_torch_host_allocator(pool)
        assert not _C.host_torch_allocator_installed()
    else:
        with pytest.raises(RuntimeError, match="no CUDA"):
            host.install_torch_host_allocator(pool)
