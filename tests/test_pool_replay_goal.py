"""The memory goals on the bundled real traces (H200, torch 2.11), through _C.Pool.

Unconstrained (an 80 GiB simulated device, far from full) the pool grows like
expandable segments and moves nothing (Note [When to stitch]); under a budget
of 1.02 x peak requested it packs the same program with no OOM, stitching
granules (native: 1.63 and 2.15 reserved/requested; expandable_segments: 1.08
and 1.15). The replay driver and CLI (torchmem.analysis.replay) report the same
figures; this test guards the pool itself."""

import gzip
import json
import os

import pytest

from torchmem._loader import _C

TRACES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "torchmem", "data", "traces")


def replay(path, limit_ratio=None):
    with gzip.open(path, "rt") as f:
        events = json.load(f)["events"]
    sim = _C.SimBackend()
    limit = 0
    if limit_ratio is not None:
        live = peak = 0
        sizes = {}
        for action, addr, size, _ in events:
            if action == 0:
                sizes[addr] = size
                live += size
                peak = max(peak, live)
            elif action == 1 and addr in sizes:
                live -= sizes.pop(addr)
        limit = int(limit_ratio * peak) // (2 << 20) * (2 << 20)
    pool = _C.Pool(sim, {"limit_bytes": limit})
    ours = {}
    live = peak = 0
    for action, addr, size, stream in events:
        if action == 0:
            p = pool.allocate(size, stream)
            assert p, f"unexpected OOM (limit {limit})"
            ours[addr] = p
            live += size
            peak = max(peak, live)
        elif action == 1 and addr in ours:
            pool.free(ours.pop(addr))
            live -= size
    pool.check_invariants()
    return pool.stats(), peak


NAMES = ["trace_gpt2_train.json.gz", "trace_llama_ckpt_train.json.gz", "trace_kv_generate.json.gz",
         "trace_vision.json.gz"]


@pytest.mark.parametrize("name", NAMES)
def test_unconstrained_pool_moves_nothing(name):
    stats, peak_requested = replay(os.path.join(TRACES, name))
    ratio = stats["reserved_bytes"]["all"]["peak"] / peak_requested
    assert ratio <= 1.16, f"{name}: peak reserved / peak requested = {ratio:.4f}"
    assert stats["num_reclaims"] == 0 and stats["backend"]["unmap_calls"] == 0
    assert stats["backend"]["map_calls"] == stats["backend"]["create_calls"]


@pytest.mark.parametrize("name", NAMES)
def test_ratio_goal_under_a_tight_budget(name):
    stats, peak_requested = replay(os.path.join(TRACES, name), limit_ratio=1.02)
    ratio = stats["reserved_bytes"]["all"]["peak"] / peak_requested
    assert ratio <= 1.02, f"{name}: peak reserved / peak requested = {ratio:.4f}"
    assert stats["num_ooms"] == 0
    # Stitching must stay rare: well under one map+unmap per allocation.
    moves = stats["backend"]["map_calls"] + stats["backend"]["unmap_calls"]
    assert moves < 0.6 * stats["num_allocs"]


# A GPU lags behind the host: model it with events that answer "not done" to
# their first LAG polls. Under a tight budget (stitch_above=0 here: stitch at
# every missing granule) without same-stream alias reclaim, freed granules are
# almost never reclaimable in time and held memory grows to the virtual high-
# water mark (the H200 measured 1.070 / 1.147 live); with it the goal holds.
LAG = 100
STEPS = {"trace_gpt2_train.json.gz": 50, "trace_llama_ckpt_train.json.gz": 40}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_ratio_goal_when_the_gpu_lags(name):
    import numpy as np

    with gzip.open(os.path.join(TRACES, name), "rt") as f:
        events = np.asarray(json.load(f)["events"], dtype=np.int64)
    old = _C.replay(events, "torchmem", pool_config={"alias_reclaim": False, "stitch_above": 0.0}, event_delay=LAG)
    new = _C.replay(events, "torchmem", pool_config={"alias_reclaim": True, "stitch_above": 0.0}, event_delay=LAG)
    assert old["ooms"] == new["ooms"] == 0
    assert old["ratio"] > 1.05, f"{name}: the lag model no longer shows the problem ({old['ratio']:.4f})"
    assert new["ratio"] <= 1.02, f"{name}: alias reclaim under lag gives {new['ratio']:.4f}"
    assert new["reclaims"] > 0
    # Forced waits (a pending-unmap address mapped before a barrier) stay rare.
    assert new["backend_calls"]["device_sync_calls"] < 0.05 * new["reclaims"]
    print(f"{name}: lag {LAG}: ratio {old['ratio']:.4f} -> {new['ratio']:.4f}, modeled backend "
          f"{old['modeled_backend_us'] / STEPS[name] / 1000:.2f} -> "
          f"{new['modeled_backend_us'] / STEPS[name] / 1000:.2f} ms/step")
