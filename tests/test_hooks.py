"""OOM hooks: order, retry, bounded retries, errors reported not swallowed, re-entrancy."""

import logging

import pytest

import torchmem
from torchmem.runtime import hooks
from sim_pool import MiB, make_pool


@pytest.fixture(autouse=True)
def no_hooks_left():
    yield
    for fn_id in list(hooks._hooks):
        hooks._hooks.pop(fn_id)


def test_register_and_remove():
    handle = torchmem.on_oom(lambda device, requested, stats: False)
    assert hooks.registered_hooks() == [handle.fn]
    torchmem.remove_oom_hook(handle)
    assert hooks.registered_hooks() == []
    with pytest.raises(ValueError, match="not registered"):
        handle.remove()
    with pytest.raises(TypeError, match="callable"):
        torchmem.on_oom("not a function")
    with pytest.raises(TypeError, match="handle"):
        torchmem.remove_oom_hook(42)


def test_hooks_run_in_order_until_one_frees():
    calls = []
    torchmem.on_oom(lambda d, r, s: calls.append(("a", d, r)) or False)
    torchmem.on_oom(lambda d, r, s: calls.append(("b", d, r)) or True)
    torchmem.on_oom(lambda d, r, s: calls.append(("c", d, r)) or True)
    pool = make_pool()
    assert hooks._run_hooks(1, 4096, pool=pool) is True
    assert calls == [("a", 1, 4096), ("b", 1, 4096)]


def test_hook_that_frees_a_cache_turns_oom_into_success():
    pool = make_pool(limit=64 * MiB)
    cache = [pool.allocate(40 * MiB)]
    seen = {}

    def drop_cache(device, requested, stats):
        seen.update(requested=requested, allocated=stats["allocated_bytes.all.current"])
        if not cache:
            return False
        pool.free(cache.pop())
        return True

    torchmem.on_oom(drop_cache)
    assert pool.allocate(40 * MiB) == 0, "the request does not fit next to the cache"
    addr = hooks.allocate_with_oom_hooks(pool, 40 * MiB)
    assert addr != 0 and not cache
    assert seen == {"requested": 40 * MiB, "allocated": 40 * MiB}
    assert torchmem.memory_allocated(pool=pool) == 40 * MiB


def test_retries_are_bounded():
    pool = make_pool(limit=8 * MiB)
    calls = []
    torchmem.on_oom(lambda d, r, s: calls.append(r) or True)  # claims success, frees nothing
    assert hooks.allocate_with_oom_hooks(pool, 64 * MiB, retries=3) == 0
    assert len(calls) == 3


def test_hook_errors_are_reported_counted_and_the_next_hook_runs(caplog):
    def broken(device, requested, stats):
        raise KeyError("boom in hook")

    torchmem.on_oom(broken)
    torchmem.on_oom(lambda d, r, s: True)
    before = hooks.hook_counters()
    pool = make_pool()
    with caplog.at_level(logging.ERROR, logger="torchmem"), pytest.warns(RuntimeWarning, match="boom in hook"):
        assert hooks._run_hooks(0, 1024, pool=pool) is True
    after = hooks.hook_counters()
    assert after["oom_hook_errors"] == before["oom_hook_errors"] + 1
    assert after["oom_hook_successes"] == before["oom_hook_successes"] + 1
    assert "Traceback" in caplog.text and "KeyError" in caplog.text
    assert torchmem.memory_stats(pool=pool)["torchmem.oom_hook_errors"] == after["oom_hook_errors"]


def test_nested_oom_inside_a_hook_does_not_recurse():
    pool = make_pool()
    depth = []

    def hook(device, requested, stats):
        depth.append(1)
        return hooks._run_hooks(device, requested, pool=pool)  # as if the hook's own allocation failed

    torchmem.on_oom(hook)
    assert hooks._run_hooks(0, 1, pool=pool) is False
    assert len(depth) == 1


def test_attach_runtime_is_a_noop_without_the_allocator():
    assert hooks._attach_runtime() is False
