"""CPU-side logic behind torchmem's answers to torch's allocator API
(docs/compatibility.md): install()'s GPU check that does not initialize CUDA, and
memory_stats()'s native key set. The GPU side is tests/gpu/test_gpu_torch_api.py."""

import pytest
import torch

from tests.sim_pool import MiB, make_pool


def _no_cuda_init(*args, **kwargs):
    raise AssertionError("torch.cuda.is_available() initializes CUDA; install() must not call it when NVML answers")


def test_gpu_check_asks_nvml_and_never_cuda(monkeypatch):
    import importlib

    install_module = importlib.import_module("torchmem.installer")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_available", _no_cuda_init)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 2, raising=False)
    assert install_module._gpu_present() is True
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: 0, raising=False)
    assert install_module._gpu_present() is False


def test_gpu_check_falls_back_to_cuda_without_nvml(monkeypatch):
    import importlib

    install_module = importlib.import_module("torchmem.installer")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.cuda, "_device_count_nvml", lambda: -1, raising=False)
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: calls.append(1) or True)
    assert install_module._gpu_present() is True and calls == [1]


def test_gpu_check_is_false_for_a_torch_without_cuda(monkeypatch):
    import importlib

    install_module = importlib.import_module("torchmem.installer")
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_available", _no_cuda_init)
    assert install_module._gpu_present() is False


def test_installed_stats_take_torchs_own_key_set(monkeypatch):
    """Note [Native key set]: with the allocator installed, torch's dict (built from
    torchmem's getDeviceStats) gives the keys, torchmem adds its own under torchmem."""
    import importlib

    stats = importlib.import_module("torchmem.runtime.stats")
    pool = make_pool()
    pool.allocate(3 * MiB)
    native = {"allocated_bytes": {"all": {"current": 7, "peak": 7, "allocated": 7, "freed": 0}},
              "num_oom_rejections": 0, "reserved_bytes_by_private_pools": {}}
    monkeypatch.setattr(stats, "raw_stats", lambda device=None, pool_=None: pool.stats())
    monkeypatch.setattr(stats, "device_index", lambda device=None: 0)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", lambda device: dict(native), raising=False)
    flat = stats.memory_stats()
    assert flat["allocated_bytes.all.current"] == 7 and flat["num_oom_rejections"] == 0
    assert {k for k in flat if not k.startswith("torchmem.")} == {
        "allocated_bytes.all.current", "allocated_bytes.all.peak", "allocated_bytes.all.allocated",
        "allocated_bytes.all.freed", "num_oom_rejections"}
    assert flat["torchmem.largest_free_block"] >= 0


def test_stats_are_built_here_when_torch_cannot_answer(monkeypatch):
    import importlib

    stats = importlib.import_module("torchmem.runtime.stats")
    pool = make_pool()
    pool.allocate(3 * MiB)

    def refuse(device):
        raise RuntimeError("CUDAPluggableAllocator does not yet support getDeviceStats")

    monkeypatch.setattr(stats, "raw_stats", lambda device=None, pool_=None: pool.stats())
    monkeypatch.setattr(stats, "device_index", lambda device=None: 0)
    monkeypatch.setattr(torch._C, "_cuda_memoryStats", refuse, raising=False)
    flat = stats.memory_stats()
    assert flat["allocated_bytes.all.current"] == 3 * MiB and flat["max_split_size"] == -1
    assert flat == stats.memory_stats(pool=pool) | {k: v for k, v in flat.items() if k.startswith("torchmem.")}


@pytest.mark.parametrize("name", ["set_trace_capacity", "clear_trace"])
def test_pool_exposes_trace_controls(name):
    assert callable(getattr(make_pool(), name))
