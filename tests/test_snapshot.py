"""Snapshots in PyTorch's format: structure, tiling, stacks, pickle protocol, torch's memory_viz tools."""

import os
import pickle
import subprocess
import sys

import pytest

import torchmem
from torchmem.runtime import snapshot_format
from torchmem.runtime.snapshots import capture_stack, stack_frames
from memory_viz_check import undo_like_memory_viz
from sim_pool import MiB, make_pool
from support import REPO

BLOCK_KEYS = {"address", "size", "requested_size", "state", "frames"}
SEGMENT_KEYS = {"device", "address", "total_size", "allocated_size", "active_size", "requested_size", "stream",
                "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}


def _allocate_here(pool, size):
    return pool.allocate(size, 0, 0, capture_stack())


def _busy_pool():
    pool = make_pool()
    keep = [_allocate_here(pool, size) for size in (700, 3000, 5 * MiB, 12 * MiB + 5, 300 * 1024)]
    for size in (9 * MiB, 2000, 33 * MiB):
        pool.free(_allocate_here(pool, size))
    pool.free(keep.pop(2))
    return pool, keep


def test_structure_and_tiling():
    pool, keep = _busy_pool()
    snap = torchmem.snapshot(pool=pool)
    assert set(snap) >= {"segments", "device_traces", "allocator_settings"}
    assert snap["segments"]
    live = 0
    for seg in snap["segments"]:
        assert set(seg) == SEGMENT_KEYS
        assert seg["segment_type"] in ("small", "large")
        cursor = seg["address"]
        for block in seg["blocks"]:
            assert set(block) == BLOCK_KEYS
            assert block["address"] == cursor, "blocks tile their segment"
            assert block["state"] in ("active_allocated", "active_pending_free", "inactive")
            cursor += block["size"]
            if block["state"] == "active_allocated":
                live += 1
                assert block["requested_size"] <= block["size"]
        assert cursor == seg["address"] + seg["total_size"]
        assert seg["allocated_size"] == sum(b["size"] for b in seg["blocks"] if b["state"] == "active_allocated")
    assert live == len(keep)
    reserved = sum(seg["total_size"] for seg in snap["segments"])
    assert reserved == torchmem.memory_reserved(pool=pool)
    trace = snap["device_traces"][0]
    actions = {entry["action"] for entry in trace}
    assert {"alloc", "free_requested", "segment_map"} <= actions
    assert all({"action", "addr", "size", "stream", "time_us", "frames"} <= set(e) for e in trace)


def test_live_blocks_carry_python_stacks():
    pool, _ = _busy_pool()
    snap = torchmem.snapshot(pool=pool)
    frames = [b["frames"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    # innermost frame first (a list comprehension adds its own frame before Python 3.12)
    assert frames and all(f[0]["name"] == "_allocate_here" and "_busy_pool" in [x["name"] for x in f[1:3]]
                          for f in frames)
    # capture_stack skips torchmem's own frames: the innermost one is this file, wherever the checkout lives
    assert all(os.path.samefile(f[0]["filename"], __file__) for f in frames)
    assert {"filename", "line", "name"} == set(frames[0][0])


def test_stack_table_deduplicates():
    ids = set()
    for _ in range(3):
        ids.add(capture_stack())
    assert len(ids) == 1 and stack_frames(ids.pop())[0]["name"] == "test_stack_table_deduplicates"
    assert stack_frames(0) == []


def test_dump_is_protocol_4_and_torch_memory_viz_reads_it(tmp_path):
    pool, _ = _busy_pool()
    path = str(tmp_path / "snap.pickle")
    torchmem.dump_snapshot(path, pool=pool)
    with open(path, "rb") as f:
        assert f.read(2) == b"\x80\x04"
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", path], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "total_reserved" in proc.stdout, proc.stderr
    # The other tools, in process (what `_memory_viz trace | trace_plot | segment_plot` call).
    from torch.cuda import _memory_viz

    with open(path, "rb") as f:
        data = pickle.load(f)
    assert "TOTAL MEM" in _memory_viz.trace(data)
    assert "Active Memory Timeline" in _memory_viz.trace_plot(data)
    assert "Allocator State History" in _memory_viz.segment_plot(data)


def test_converter_rejects_blocks_that_do_not_tile():
    core = {"segments": [{"address": 4096, "total_size": 2048, "small_heap": True, "pool": 0, "stream": 0,
                          "blocks": [{"address": 4096, "size": 512, "requested_size": 100, "state": "active_allocated"},
                                     {"address": 5120, "size": 1024, "requested_size": 0, "state": "inactive"}]}]}
    with pytest.raises(ValueError, match="do not tile"):
        snapshot_format.to_torch_snapshot(core)
    core["segments"][0]["blocks"][1]["address"] = 4608
    core["segments"][0]["blocks"][1]["size"] = 1536
    snap = snapshot_format.to_torch_snapshot(core, device=1)
    assert snap["device_traces"] == [[], []] and snap["segments"][0]["device"] == 1
    assert snap["segments"][0]["requested_size"] == 100


def test_a_parked_block_reads_as_part_of_its_free_neighbours():
    # A private pool's parked block (free to torch, live to the core) next to free space: torch
    # sees one free block, as its own allocator would show it after a checkpoint restore.
    blocks = [{"address": 4096, "size": 512, "requested_size": 512, "state": "active_allocated"},
              {"address": 4608, "size": 512, "requested_size": 0, "state": "inactive", "parked": True},
              {"address": 5120, "size": 1024, "requested_size": 0, "state": "inactive"}]
    core = {"segments": [{"address": 4096, "total_size": 2048, "small_heap": True, "pool": 3, "stream": 0,
                          "blocks": blocks}]}
    segment = snapshot_format.to_torch_snapshot(core)["segments"][0]
    assert [(b["address"], b["size"], b["state"]) for b in segment["blocks"]] == [
        (4096, 512, "active_allocated"), (4608, 1536, "inactive")]
    assert segment["allocated_size"] == segment["active_size"] == 512 and segment["total_size"] == 2048


def test_oom_entries_have_device_free():
    core = {"segments": [], "trace": [{"action": "oom", "addr": 0, "size": 5, "stream": 0, "pool": 0,
                                       "context": 0, "sequence": 9}]}
    entry = snapshot_format.to_torch_snapshot(core)["device_traces"][0][0]
    assert entry["action"] == "oom" and "device_free" in entry and entry["time_us"] == 9


def test_record_history_needs_the_installed_allocator():
    with pytest.raises(RuntimeError, match="pool="):
        torchmem.record_history()
    with pytest.raises(ValueError, match="stacks"):
        torchmem.record_history(stacks="cpp")


def test_package_attribute_stays_callable_after_module_import():
    import importlib

    importlib.import_module("torchmem.runtime.snapshots")
    pool, _ = _busy_pool()
    assert torchmem.snapshot(pool=pool)["segments"]


def test_trace_and_segments_agree_for_the_memory_viz_page():
    pool = make_pool(limit=64 * MiB)
    live = [pool.allocate(5 * MiB + 4096 * i, 0, 0, capture_stack()) for i in range(10)]
    for addr in live[::2]:
        pool.free(addr)
    stitched = pool.allocate(20 * MiB)  # needs granules from the freed holes: stitching
    small = [pool.allocate(3000) for _ in range(50)]
    for addr in small[::3]:
        pool.free(addr)
    assert stitched and torchmem.memory_stats(pool=pool)["torchmem.num_reclaims"] > 0
    snap = torchmem.snapshot(pool=pool)
    assert {"segment_map", "segment_unmap"} <= {e["action"] for e in snap["device_traces"][0]}
    assert undo_like_memory_viz(snap) >= 80


def test_capture_stack_without_python_caller_returns_0(monkeypatch):
    # The allocator calls the provider straight from C++; on autograd's threads there is no
    # Python frame below it, so sys._getframe(1) raises. The provider must answer 0 then.
    import sys

    def no_caller(depth=0):
        raise ValueError("call stack is not deep enough")

    monkeypatch.setattr(sys, "_getframe", no_caller)
    assert capture_stack() == 0


def test_private_pool_segments_carry_torchs_pool_key():
    """Runtime snapshots name a private pool in use by torch's key (Note [Parked blocks in
    snapshots], csrc/bindings/runtime_bindings_cuda.cpp); core snapshots by the core's id."""
    pool = make_pool()
    pool.create_private_pool(3)
    pool.allocate(4096, 0, 3)
    core = pool.snapshot()
    ids = {seg["segment_pool_id"] for seg in snapshot_format.to_torch_snapshot(core)["segments"]}
    assert ids == {(0, 3)}
    for seg in core["segments"]:
        seg["pool_key"] = (7, 0)
        for block in seg["blocks"]:
            block["state"], block["parked"] = "inactive", True  # torch freed it; the pool keeps it
    converted = snapshot_format.to_torch_snapshot(core)["segments"]
    assert {seg["segment_pool_id"] for seg in converted} == {(7, 0)}
    assert all(seg["allocated_size"] == 0 for seg in converted)
