"""torchmem.host: host (CPU) memory: the pinned pool and activation offload.

pool.py is the pinned host memory pool (docs/host.md); its public names are
this package's, so ``torchmem.host.empty(...)`` and ``torchmem.host.pin(...)``
work as written in the guide. offload.py moves saved activations to that pool
(``torchmem.offload_activations``).

The pool's names load on first use: pool.py loads the compiled module
torchmem._C, which offload.py and the batch controller's offload rung do not
need until they copy.
"""

import importlib

_POOL_NAMES = (
    "HostPool", "HostOutOfMemoryError", "default_pool", "empty", "empty_like", "pin", "record_stream",
    "stats", "reset_peak_stats", "empty_cache", "set_limit", "pin_batch", "pinned", "install_torch_host_allocator",
)

__all__ = list(_POOL_NAMES)


def __getattr__(name):
    if name not in _POOL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("torchmem.host.pool"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(__all__) | {"pool", "offload"})
