"""torchmem.memory_stats and friends: torch's key names and shapes, figures from the core's counters."""

import collections

import pytest

import torchmem
from torchmem.runtime import stats
from sim_pool import MiB, make_pool

TORCH_KEYS = (
    {f"{name}.{kind}.{field}" for name in stats.STAT_ARRAYS for kind in stats.STAT_KINDS for field in stats.STAT_FIELDS}
    | {f"{name}.{field}" for name in ("oversize_allocations", "oversize_segments") for field in stats.STAT_FIELDS}
    | set(stats.TORCH_COUNTERS) | {"max_split_size", "num_oom_rejections"}
)


def test_keys_are_torchs_plus_torchmem_namespace():
    pool = make_pool()
    flat = torchmem.memory_stats(pool=pool)
    assert isinstance(flat, collections.OrderedDict)
    assert list(flat) == sorted(flat), "sorted like torch.cuda.memory_stats"
    assert TORCH_KEYS <= set(flat)
    extra = set(flat) - TORCH_KEYS
    assert extra and all(key.startswith("torchmem.") for key in extra)
    for key in ("torchmem.fragmentation_ratio", "torchmem.largest_free_block", "torchmem.num_reclaims",
                "torchmem.backend.map_calls", "torchmem.oom_hook_errors"):
        assert key in flat
    assert all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in flat.values())
    nested = stats.memory_stats_as_nested_dict(pool=pool)
    assert nested["allocated_bytes"]["all"]["current"] == flat["allocated_bytes.all.current"]


def test_figures_follow_allocations():
    pool = make_pool()
    sizes = [1000, 3 * MiB + 7, 512 * 1024, 40 * MiB]
    addrs = [pool.allocate(size) for size in sizes]
    assert all(addrs)
    rounded = sum(-(-size // 512) * 512 for size in sizes)
    assert torchmem.memory_allocated(pool=pool) == rounded
    flat = torchmem.memory_stats(pool=pool)
    assert flat["requested_bytes.all.current"] == sum(sizes)
    assert flat["allocation.all.current"] == 4
    assert flat["allocation.small_pool.current"] == 2 and flat["allocation.large_pool.current"] == 2
    reserved = torchmem.memory_reserved(pool=pool)
    assert reserved >= rounded and reserved % (2 * MiB) == 0
    assert flat["torchmem.fragmentation_ratio"] == pytest.approx(
        flat["reserved_bytes.all.peak"] / flat["requested_bytes.all.peak"])

    pool.free(addrs[3])
    assert torchmem.memory_allocated(pool=pool) == rounded - 40 * MiB
    assert torchmem.max_memory_allocated(pool=pool) == rounded
    torchmem.reset_peak_memory_stats(pool=pool)
    assert torchmem.max_memory_allocated(pool=pool) == rounded - 40 * MiB
    assert torchmem.max_memory_reserved(pool=pool) == torchmem.memory_reserved(pool=pool)

    released = torchmem.empty_cache(pool=pool)
    # The 40 MiB block's own run goes back; its first 16 MiB lie in the 20 MiB run mapped for
    # the 3 MiB block before it (Note [Runs ahead]), which stays with that live block.
    assert released == 24 * MiB
    assert torchmem.memory_reserved(pool=pool) == reserved - released
    assert torchmem.memory_stats(pool=pool)["torchmem.num_cache_releases"] == 1
    stats.reset_accumulated_memory_stats(pool=pool)
    assert torchmem.memory_stats(pool=pool)["allocated_bytes.all.freed"] == 0


def test_ooms_are_counted():
    pool = make_pool(limit=16 * MiB)
    assert pool.allocate(64 * MiB) == 0
    flat = torchmem.memory_stats(pool=pool)
    assert flat["num_ooms"] == 1 and flat["torchmem.limit_bytes"] == 16 * MiB


def test_summary_is_a_readable_table():
    pool = make_pool()
    pool.allocate(5 * MiB)
    text = torchmem.memory_summary(pool=pool)
    lines = text.splitlines()
    assert len({len(line) for line in lines}) == 1, "every row has the same width"
    for words in ("Allocated memory", "GPU reserved memory", "from small pool", "Fragmentation ratio",
                  "Largest free block", "Backend calls"):
        assert words in text
    assert "5.00 MiB" in text
    assert "from small pool" not in torchmem.memory_summary(pool=pool, abbreviated=True)


def test_without_installed_allocator_the_error_says_what_to_do():
    with pytest.raises(stats.NotInstalledError, match="torchmem.install()|pool="):
        torchmem.memory_stats()
    with pytest.raises(RuntimeError, match="pool="):
        torchmem.memory_allocated(0)


@pytest.mark.parametrize("bad", [-1, "cpu", 1.5, True])
def test_bad_device_names_the_problem(bad):
    with pytest.raises(ValueError, match="device"):
        stats.device_index(bad)


def test_format_bytes():
    assert stats.format_bytes(512) == "512 B"
    assert stats.format_bytes(3 << 29) == "1.50 GiB"
