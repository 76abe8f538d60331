"""patch_torch(): torch.cuda's memory functions answer from torchmem; unpatch restores torch's."""

import pickle

import pytest
import torch

from torchmem.runtime import patch
from sim_pool import MiB, make_pool


@pytest.fixture
def patched_pool():
    pool = make_pool()
    patch.patch_torch(pool=pool)
    try:
        yield pool
    finally:
        patch.unpatch_torch()


def test_patch_is_idempotent_and_unpatch_restores():
    originals = {name: getattr(torch.cuda.memory, name) for name in patch.PATCHED_NAMES}
    cuda_originals = {name: torch.cuda.__dict__.get(name) for name in patch.PATCHED_NAMES}
    patch.patch_torch()
    first = {name: getattr(torch.cuda.memory, name) for name in patch.PATCHED_NAMES}
    patch.patch_torch()
    try:
        assert patch.is_patched()
        for name in patch.PATCHED_NAMES:
            assert getattr(torch.cuda.memory, name) is first[name], f"{name} wrapped twice"
            assert first[name] is not originals[name]
            assert first[name].__wrapped__ is originals[name]
        assert torch.cuda.memory_stats is torch.cuda.memory.memory_stats
        assert torch.cuda.max_memory_allocated is torch.cuda.memory.max_memory_allocated
    finally:
        patch.unpatch_torch()
    assert not patch.is_patched()
    for name in patch.PATCHED_NAMES:
        assert getattr(torch.cuda.memory, name) is originals[name]
        assert torch.cuda.__dict__.get(name) is cuda_originals[name]


def test_not_installed_falls_back_to_torch():
    patch.patch_torch()
    try:
        # torch's own answer on a process whose CUDA never initialized: empty stats, 0 bytes.
        assert torch.cuda.memory_stats() == patch.original("memory_stats")()
        assert torch.cuda.memory_stats_as_nested_dict() == {}
    finally:
        patch.unpatch_torch()


def test_torch_functions_answer_from_torchmem(patched_pool):
    addr = patched_pool.allocate(3 * MiB)
    assert torch.cuda.memory_allocated() == 3 * MiB
    assert torch.cuda.memory.memory_allocated(0) == 3 * MiB
    assert torch.cuda.max_memory_allocated() == 3 * MiB
    assert torch.cuda.memory_reserved() >= 3 * MiB
    stats = torch.cuda.memory_stats(0)  # what Lightning's DeviceStatsMonitor logs
    assert stats["allocated_bytes.all.current"] == 3 * MiB and "torchmem.fragmentation_ratio" in stats
    patched_pool.free(addr)
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == 0
    torch.cuda.reset_max_memory_allocated()
    torch.cuda.memory.reset_accumulated_memory_stats()
    assert "torchmem memory summary" in torch.cuda.memory_summary()
    # torch's own memory_summary reads memory_stats through its module globals: our keys suffice.
    assert "PyTorch CUDA memory summary" in patch.original("memory_summary")(device=0)
    # torch's deprecated aliases route through the patched functions too.
    with pytest.warns(FutureWarning):
        assert torch.cuda.memory.memory_cached() == torch.cuda.memory_reserved()


def test_snapshot_functions(patched_pool, tmp_path):
    patched_pool.allocate(5 * MiB)
    snap = torch.cuda.memory._snapshot()
    assert snap["segments"] and "device_traces" in snap
    assert torch.cuda.memory_snapshot() == snap["segments"]
    path = tmp_path / "s.pickle"
    torch.cuda.memory._dump_snapshot(str(path))  # torch's own dumper over our _snapshot
    with open(path, "rb") as f:
        assert pickle.load(f)["segments"] == snap["segments"]


def test_memory_snapshot_of_one_pool(patched_pool):
    # torch.cuda.memory_snapshot(mempool_id) and MemPool.snapshot(): that pool's segments only
    patched_pool.allocate(5 * MiB)
    patched_pool.create_private_pool(3)
    mine = patched_pool.allocate(3 * MiB, 0, 3)
    everything = torch.cuda.memory_snapshot()
    assert torch.cuda.memory_snapshot((0, 0)) == everything  # torch's (0, 0): every pool
    only = torch.cuda.memory_snapshot((0, 3))
    assert only and all(s["segment_pool_id"] == (0, 3) for s in only)
    assert any(b["address"] == mine for s in only for b in s["blocks"])
    assert len(only) < len(everything)
    assert torch.cuda.memory_snapshot((7, 7)) == []


def test_snapshot_augments_fx_frames_with_torchs_own_pass(patched_pool, monkeypatch):
    calls = []

    def augment(snapshot):
        calls.append(snapshot)
        return dict(snapshot, augmented=True)

    monkeypatch.setattr(torch.cuda.memory, "_augment_memory_snapshot_stack_traces", augment, raising=False)
    patched_pool.allocate(MiB)
    assert "augmented" not in torch.cuda.memory._snapshot()
    assert torch.cuda.memory._snapshot(augment_with_fx_traces=True)["augmented"] is True
    assert len(calls) == 1
