"""The model of PyTorch's native caching allocator (csrc/replay/native_model.h).

Each rule of Note [Native policy] / Note [Native OOM steps] is checked on a small
scenario, and the model is held to the recorded native peak of both shared traces.
"""

import pytest

from torchmem.analysis import trace as trace_io
from torchmem._loader import _C

KiB, MiB = 1 << 10, 1 << 20


def model(**kwargs):
    return _C.NativeModel(**kwargs)


def checked(m):
    m.check_invariants()
    return m.stats()


def test_round_size_is_512_bytes():
    assert _C.NativeModel.round_size(1) == 512
    assert _C.NativeModel.round_size(512) == 512
    assert _C.NativeModel.round_size(513) == 1024
    assert _C.NativeModel.round_size(3 * MiB + 1) == 3 * MiB + 512


def test_segment_sizes():
    seg = _C.NativeModel.segment_size
    assert seg(512) == 2 * MiB            # small pool
    assert seg(1 * MiB) == 2 * MiB
    assert seg(1 * MiB + 512) == 20 * MiB  # 1-10 MiB share 20 MiB segments
    assert seg(10 * MiB - 512) == 20 * MiB
    assert seg(10 * MiB) == 10 * MiB       # from 10 MiB: rounded to 2 MiB
    assert seg(11 * MiB) == 12 * MiB
    assert seg(155_000_000) == 148 * MiB


def test_small_requests_pack_into_one_2mib_segment():
    m = model()
    a = m.allocate(1000)
    b = m.allocate(700 * KiB)
    s = checked(m)
    assert s["segments"] == 1 and s["reserved_bytes"] == 2 * MiB
    assert b == a + 1024                     # split right after the rounded first block
    assert s["allocated_bytes"] == 1024 + 700 * KiB
    assert s["requested_bytes"] == 1000 + 700 * KiB


def test_large_pool_splits_only_with_more_than_1mib_left():
    m = model()
    a = m.allocate(19 * MiB)                 # 20 MiB segment, 1 MiB left: not split
    checked(m)
    m.allocate(5 * MiB)                      # needs a new segment: the 1 MiB tail was not free space
    assert m.stats()["segments"] == 2
    m.free(a)
    m2 = model()
    first = m2.allocate(9 * MiB)             # 20 MiB segment, 11 MiB left (> 1 MiB): split
    assert m2.allocate(11 * MiB) == first + 9 * MiB  # the remainder serves the next request
    assert checked(m2)["segments"] == 1


def test_unsplit_large_block_keeps_its_slack_for_the_request():
    m = model()
    m.allocate(19 * MiB + 512)               # 20 MiB segment, remainder < 1 MiB: whole block handed out
    s = checked(m)
    assert s["allocated_bytes"] == 20 * MiB
    assert s["requested_bytes"] == 19 * MiB + 512


def test_best_fit_takes_the_smallest_block_then_lowest_address():
    m = model()
    big = m.allocate(30 * MiB)
    m.allocate(2 * MiB)                      # 20 MiB segment: keeps the 30 MiB segment apart
    small = m.allocate(12 * MiB)
    m.free(big)
    m.free(small)
    # 11 MiB fits both freed blocks; best fit is the 12 MiB one.
    assert m.allocate(11 * MiB) == small
    checked(m)


def test_equal_free_blocks_tie_break_on_address():
    m = model()
    first = m.allocate(12 * MiB)
    second = m.allocate(12 * MiB)
    m.free(first)
    m.free(second)
    assert m.allocate(12 * MiB) == min(first, second)


def test_free_merges_with_free_neighbours():
    m = model()
    a = m.allocate(4 * MiB)
    b = m.allocate(4 * MiB)
    c = m.allocate(4 * MiB)                  # all three in one 20 MiB segment
    assert (b - a, c - b) == (4 * MiB, 4 * MiB)
    m.free(a)
    m.free(c)
    m.free(b)                                # joins a, c and the tail
    checked(m)
    (segment,) = m.snapshot()["segments"]
    assert [blk["state"] for blk in segment["blocks"]] == ["inactive"]
    assert segment["blocks"][0]["size"] == 20 * MiB
    assert m.allocate(20 * MiB) == a         # the whole segment is one block again


def test_free_blocks_serve_only_their_own_stream():
    m = model()
    a = m.allocate(12 * MiB, stream=1)
    m.free(a)
    b = m.allocate(12 * MiB, stream=2)
    assert b != a
    assert m.stats()["segments"] == 2
    assert m.allocate(12 * MiB, stream=1) == a
    checked(m)


def test_limit_fails_then_release_and_retry_frees_unsplit_cached_segments():
    m = model(limit=40 * MiB)
    a = m.allocate(30 * MiB)
    m.free(a)                                # cached, unsplit 30 MiB segment
    b = m.allocate(34 * MiB)                 # 30 + 34 > 40: free the cached segment, retry
    assert b != 0
    s = checked(m)
    assert s["num_alloc_retries"] == 1 and s["num_device_free"] == 1 and s["num_ooms"] == 0
    assert s["reserved_bytes"] == 34 * MiB


def test_oom_returns_zero_and_counts():
    m = model(limit=24 * MiB)
    m.allocate(4 * MiB)                      # a 20 MiB segment, split
    assert m.allocate(6 * MiB) != 0          # fits in the same segment
    assert m.allocate(12 * MiB) == 0         # 20 + 12 > 24 and nothing unsplit to free
    s = checked(m)
    assert s["num_ooms"] == 1 and s["num_alloc_retries"] == 1
    assert s["reserved_bytes"] == 20 * MiB   # nothing changed


def test_max_split_size_rules():
    m = model(max_split_size=40 * MiB)
    big = m.allocate(100 * MiB)
    m.free(big)
    # Below max_split_size: never takes an oversize block.
    small = m.allocate(30 * MiB)
    assert small != big and m.stats()["segments"] == 2
    # At or above it: takes one only within 20 MiB of its size, unsplit.
    assert m.allocate(90 * MiB) == big
    assert m.stats()["allocated_bytes"] == 130 * MiB
    checked(m)


def test_max_split_size_releases_oversize_blocks_first():
    m = model(limit=150 * MiB, max_split_size=40 * MiB)
    big = m.allocate(100 * MiB)
    m.free(big)
    assert m.allocate(60 * MiB) != 0         # 100 + 60 > 150: the oversize block goes first
    s = checked(m)
    assert s["num_device_free"] == 1 and s["num_alloc_retries"] == 0


def test_release_cached_frees_only_unsplit_segments():
    m = model()
    keep = m.allocate(4 * MiB)
    m.free(m.allocate(30 * MiB))
    assert m.release_cached() == 30 * MiB
    s = checked(m)
    assert s["segments"] == 1 and s["reserved_bytes"] == 20 * MiB
    m.free(keep)
    assert m.release_cached() == 20 * MiB
    assert checked(m)["reserved_bytes"] == 0


def test_bad_input_raises_and_changes_nothing():
    m = model()
    a = m.allocate(1 * MiB)
    before = m.stats()
    with pytest.raises(ValueError, match="at least 1 byte"):
        m.allocate(0)
    with pytest.raises(ValueError, match="not a live allocation"):
        m.free(a + 512)
    m.free(a)
    with pytest.raises(ValueError, match="not a live allocation"):
        m.free(a)
    with pytest.raises(ValueError, match="max_split_size"):
        model(max_split_size=1 * MiB)
    assert m.stats()["num_allocs"] == before["num_allocs"]
    checked(m)


@pytest.mark.parametrize("name", ["gpt2", "llama_ckpt", "kv_generate", "vision"])
def test_reproduces_recorded_native_peak_within_1_percent(name):
    trace = trace_io.load(trace_io.bundled_trace(name))
    recorded = trace.recorded_peak_reserved()
    result = _C.replay(trace.events, "native")
    assert result["ooms"] == 0
    assert abs(result["peak_reserved"] / recorded - 1) <= 0.01, (result["peak_reserved"], recorded)
    # The model makes exactly the recorded number of segment calls too.
    assert result["backend_calls"]["segment_alloc_calls"] == trace.counts()["segment_alloc"]
