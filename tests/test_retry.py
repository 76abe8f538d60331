"""is_oom_error and @torchmem.oom_retry on CPU, with OOMs raised above a size."""

import pytest
import torch

import torchmem
from torchmem.batch.retry import OOMRetryError, is_oom_error, requested_bytes_of


@pytest.mark.parametrize("exc", [
    torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 MiB"),
    RuntimeError("CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported"),
    RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"),
    RuntimeError("std::bad_alloc: out_of_memory: CUDA error at: rmm/mr/device/cuda_memory_resource.hpp"),
    RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
    MemoryError(),
])
def test_oom_variants_are_recognised(exc):
    assert is_oom_error(exc)


def test_cudnn_not_supported_counts_with_a_warning_and_other_errors_do_not():
    with pytest.warns(RuntimeWarning, match="CUDNN_STATUS_NOT_SUPPORTED"):
        assert is_oom_error(RuntimeError("cuDNN error: CUDNN_STATUS_NOT_SUPPORTED. This error may appear if"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("out of memory"))
    assert not is_oom_error(KeyError("x"))


def test_requested_bytes_parsed_from_the_message():
    assert requested_bytes_of("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0") == 2 << 30
    assert requested_bytes_of("CUDA out of memory. Tried to allocate 512 bytes") == 512
    assert requested_bytes_of("no figure") == 0


class Limited:
    """A function over a batch that OOMs above `limit` rows."""

    def __init__(self, limit):
        self.limit = limit
        self.sizes = []

    def __call__(self, x):
        self.sizes.append(x.shape[0])
        if x.shape[0] > self.limit:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
        return {"y": x * 2, "rows": [int(v) for v in x[:, 0]]}


def test_split_mode_splits_joins_and_remembers_the_working_size():
    limited = Limited(limit=10)
    calls = []

    @torchmem.oom_retry
    def infer(x, scale=1):
        calls.append(x.shape[0])
        return limited(x)

    x = torch.arange(64.).unsqueeze(1).repeat(1, 2)
    out = infer(x)
    assert torch.equal(out["y"], x * 2)
    assert out["rows"] == list(range(64))
    assert max(s for s in limited.sizes if s <= 10) <= 10
    assert infer.remembered_size() == 8
    limited.sizes.clear()
    again = infer(x)
    assert torch.equal(again["y"], x * 2)
    assert limited.sizes == [8] * 8  # starts at the remembered size: no OOM
    infer.reset_sizes()
    assert infer.remembered_size() is None


def test_split_mode_with_a_named_batch_argument_and_tuple_results():
    @torchmem.oom_retry(batch_arg="tokens", shrink=0.25)
    def embed(model_name, tokens):
        if tokens.shape[0] > 5:
            raise RuntimeError("CUDA error: out of memory")
        return tokens + 1, model_name

    out, name = embed("m", tokens=torch.arange(20))
    assert torch.equal(out, torch.arange(20) + 1) and name == "m"


def test_batch_size_mode_lowers_the_argument():
    seen = []

    @torchmem.oom_retry(mode="batch_size")
    def evaluate(data, batch_size=64):
        seen.append(batch_size)
        if batch_size > 12:
            raise torch.OutOfMemoryError("CUDA out of memory.")
        return sum(len(data[i:i + batch_size]) for i in range(0, len(data), batch_size))

    assert evaluate(list(range(100))) == 100
    assert seen == [64, 32, 16, 8]
    seen.clear()
    assert evaluate(list(range(100)), batch_size=64) == 100
    assert seen == [8]


def test_bounded_and_non_oom_errors_pass_through():
    @torchmem.oom_retry
    def always_oom(x):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(OOMRetryError, match="still out of memory at size 1"):
        always_oom(torch.zeros(16))

    @torchmem.oom_retry(max_retries=1)
    def twice(x):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(OOMRetryError, match="max_retries=1"):
        twice(torch.zeros(16))

    @torchmem.oom_retry
    def broken(x):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        broken(torch.zeros(4))
    with pytest.raises(ValueError, match="mode"):
        torchmem.oom_retry(mode="halve")


def test_oom_hooks_are_called_during_cleanup(monkeypatch):
    from torchmem.runtime import hooks

    calls = []
    monkeypatch.setattr(hooks, "_run_hooks", lambda device, requested: calls.append((device, requested)) or True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr("torchmem.batch.retry.free_memory_bytes", lambda device=None: None)

    @torchmem.oom_retry
    def f(x):
        if x.shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 4.00 MiB")
        return x

    assert torch.equal(f(torch.arange(4)), torch.arange(4))
    assert calls == [(0, 4 << 20)]


@pytest.mark.parametrize("installed, backend, emptied", [
    (False, None, True),           # PyTorch's allocator: free its cached segments
    (True, "cuda_malloc", True),   # torchmem on cudaMalloc segments: the same
    (True, "vmm", False),          # Note [No empty_cache after an OOM]
])
def test_cleanup_empties_the_cache_only_where_that_helps(monkeypatch, installed, backend, emptied):
    from torchmem import _loader
    from torchmem.batch import retry
    from torchmem._loader import _C

    emptied_calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: emptied_calls.append(1))
    monkeypatch.setattr(_loader, "is_installed", lambda: installed)
    monkeypatch.setattr(_C, "runtime_backend_name", lambda device: backend, raising=False)
    retry.cleanup_after_oom("CUDA out of memory. Tried to allocate 2.00 MiB", run_hooks=False)
    assert bool(emptied_calls) == emptied
