"""Helpers the bench scripts share: choosing the allocator in a fresh process,
appending results as JSON lines, and the environment each result records.

The benches are scripts run as `python bench/NAME.py`, so Python puts bench/ on
sys.path and each imports this file as `common`. It holds only what several
scripts did the same way, and uses torchmem's public API only. It imports torch
inside its functions: a script's --help and its argument checks stay fast and
need no GPU.
"""

import json
import os

# PyTorch's own allocator settings behind each --allocator name that is not
# torchmem; "native" is PyTorch's allocator with none of them.
ALLOC_CONF = {"expandable": "expandable_segments:True", "async": "backend:cudaMallocAsync"}


def set_native_conf(allocator):
    """Sets PYTORCH_CUDA_ALLOC_CONF for `allocator` (native, expandable, async; torchmem
    clears it). CUDA reads it once, when it initializes, so this runs before any CUDA call."""
    if allocator in ALLOC_CONF:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ALLOC_CONF[allocator]
    else:
        os.environ.pop("PYTORCH_CUDA_ALLOC_CONF", None)


def install_allocator(allocator, **options):
    """Makes `allocator` this process's CUDA allocator and returns torch: PyTorch's with its
    settings (set_native_conf), or torchmem.install(patch_torch=False,
    warn_unsupported=False, **options). The swap is once per process and before CUDA
    initializes, which is why each run of a bench is a process of its own."""
    set_native_conf(allocator)
    import torch

    if allocator == "torchmem":
        import torchmem

        torchmem.install(patch_torch=False, warn_unsupported=False, **options)
    return torch


def append_jsonl(path, *rows):
    """Appends each row to `path` as one JSON line. Appending, never rewriting: a sweep cut
    short keeps the rows it finished, and several runs may share one file."""
    with open(path, "a") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)


def environment(torch, device=None):
    """{"torch": version, "device": the CUDA device's name}: what every result records so
    that figures from different machines are not compared unknowingly."""
    return {"torch": torch.__version__,
            "device": torch.cuda.get_device_name() if device is None else torch.cuda.get_device_name(device)}
