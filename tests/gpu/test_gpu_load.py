"""On a GPU: the module loads beside a CUDA torch and torch's
CUDAPluggableAllocator accepts its exported alloc/free symbols."""

import pytest

from support import run_python

pytestmark = pytest.mark.gpu


def test_pluggable_allocator_accepts_exported_symbols():
    proc = run_python(
        """
        import torch, torchmem
        from torchmem import _C
        assert torchmem.build_info()["cuda_backends"], torchmem.build_info()
        alloc = torch.cuda.memory.CUDAPluggableAllocator(_C.__file__, "torchmem_alloc", "torchmem_free")
        torch.cuda.memory.change_current_allocator(alloc)
        x = torch.ones(1000, device="cuda")
        print(float(x.sum()))
        """
    )
    assert proc.stdout.strip().endswith("1000.0")
