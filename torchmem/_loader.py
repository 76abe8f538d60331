"""Loads the compiled module torchmem._C and says clearly when it cannot.

A module built against one torch and imported with another fails with an
undefined-symbol ImportError, or worse, loads and misbehaves. We check the torch
version the module was built against (build_info) and turn both cases into an
error that says what happened and how to rebuild.
"""

import torch

REBUILD_HINT = (
    "Rebuild it against the torch in this environment: "
    "`pip install --no-build-isolation -e .` from the torchmem checkout (or `make build`)."
)


def _base_version(version):
    return version.split("+")[0]


def load_extension():
    try:
        from torchmem import _C
    except ImportError as exc:
        raise ImportError(
            f"torchmem's compiled module torchmem._C could not be loaded ({exc}). It is "
            f"missing, or it was built for another torch than the one installed "
            f"(torch {torch.__version__}). {REBUILD_HINT}"
        ) from exc
    built = _C.build_info()["torch_version"]
    if _base_version(built) != _base_version(torch.__version__):
        raise ImportError(
            f"torchmem._C was built against torch {built}, but torch "
            f"{torch.__version__} is installed. {REBUILD_HINT}"
        )
    return _C


_C = load_extension()


def build_info():
    """What the compiled module was built against: torch and CUDA versions,
    whether the CUDA backends (vmm, cuda_malloc) and the allocator shim were
    compiled, and compiler flags of note. Safe without a GPU."""
    info = dict(_C.build_info())
    info["torch_runtime_version"] = torch.__version__
    return info
