"""Swapping PyTorch's CUDA caching allocator for torchmem's pool: the front door.

It sits above runtime/ (the allocator glue it installs), monitor/ and share/
(what it starts after the swap when the config asks), so every package below
it stays free of the others.

``torchmem.install()`` is the one line a user adds, right after ``import torch``.
The swap itself happens in C++ (csrc/shim/install.cpp) because torch's
CUDA-graph pool hooks take C++ ``std::function`` arguments that a ctypes
function pointer cannot provide. Everything that can go wrong is checked here
first, in the order a user would want to hear about it: a bad option
(``ValueError``), no GPU, a torchmem built without CUDA, and a CUDA allocator
that already initialized (``RuntimeError`` saying where to call install()).

Note [Lazy install]
install() does not initialize CUDA: the allocator swap is plain C++ (no CUDA
call), the GPU check asks NVML (no cuInit) and the device pools are made at
their device's first allocation. So after install(), `import torch` semantics
hold as under the native allocator: CUDA_VISIBLE_DEVICES set later still
counts, and a fork() before the first CUDA use gives a child that can use
CUDA (its torchmem has no pools yet and makes its own). After the parent
initialized CUDA, a forked child cannot use CUDA, exactly as without
torchmem (torch raises "Cannot re-initialize CUDA in forked subprocess").
Only where NVML is missing does the GPU check fall back to
torch.cuda.is_available(), which initializes the CUDA driver.

``mem_pool_allocator()`` is the other way in: a ``CUDAPluggableAllocator`` over
torchmem's pool for a scoped ``torch.cuda.MemPool``, with PyTorch's own
allocator left in charge everywhere else.
"""

import threading
import warnings

import torch

from torchmem.runtime import config as _config
from torchmem.runtime import hooks as _hooks
from torchmem.runtime import patch as _patch
from torchmem.runtime import torch_alloc_conf as _torch_alloc_conf
from torchmem._loader import extension, is_installed

__all__ = ["install", "is_installed", "mem_pool_allocator", "start_from_config"]

# The core loads, and is checked against the installed torch, when this module loads (as
# importing torchmem._C here did): a bad build is reported before anything runs.
_core = extension()

_lock = threading.Lock()
_installed_config = None
_mem_pool_allocator = None

_INIT_ORDER_HELP = (
    "PyTorch's CUDA allocator initializes on the first CUDA tensor or torch.cuda call "
    "(torch.cuda.init(), set_device, memory queries, ...), and an initialized allocator "
    "cannot be swapped. Call torchmem.install() right after `import torch`, before "
    "anything touches CUDA (or set TORCHMEM_CONF and install at the top of your script)."
)


def _runtime_options(cfg, initial_fraction=None):
    """The dict _core.runtime_install takes: the PoolConfig fields but the limit, the limit as
    given (each device's Budget resolves it: csrc/shim/budget.h), oom_hook_retries and the
    fraction every pool starts with (torch's per_process_memory_fraction setting)."""
    options = cfg.pool_options()
    # A sharing process starts at its guarantee until the arbiter's first round (docs/sharing.md).
    options["limit"] = cfg.guarantee if cfg.share else cfg.limit
    options["oom_hook_retries"] = int(cfg.oom_hook_retries)
    options["park_private_frees"] = bool(cfg.park_private_frees)
    options["initial_fraction"] = initial_fraction
    return options


def _torch_fraction(cfg):
    """torch's PYTORCH_ALLOC_CONF per_process_memory_fraction, applied to torchmem's pools
    (torchmem/runtime/torch_alloc_conf.py); None when it names none, or when torchmem's own budget
    (limit, share) is set, which wins (with a warning)."""
    fraction = _torch_alloc_conf.memory_fraction()  # ValueError for a bad value, before any change
    if fraction is None:
        return None
    if cfg.limit is not None or cfg.share:
        warnings.warn(
            f"torchmem: PYTORCH_ALLOC_CONF's per_process_memory_fraction:{fraction} is ignored: torchmem's own "
            "budget (limit / share) is set and wins.", UserWarning, stacklevel=3)
        return None
    return fraction


def _require_cuda_runtime():
    if not _core.build_info()["cuda_backends"]:
        raise RuntimeError(
            "torchmem was built without CUDA (no CUDA toolkit or a CPU-only torch at build time), so it "
            "cannot replace the GPU allocator; rebuild with a CUDA torch and toolkit present "
            "(`pip install --no-build-isolation -e .`). Trace replay works without CUDA."
        )
    if not _gpu_present():
        raise RuntimeError(
            "torchmem needs a CUDA GPU: torch.cuda.is_available() is False on this machine. "
            "Without a GPU, use `python -m torchmem replay` to study a recorded trace."
        )


def _gpu_present():
    """Whether a CUDA GPU is visible, without initializing CUDA (Note [Lazy install])."""
    if not torch.backends.cuda.is_built():
        return False
    count_nvml = getattr(torch.cuda, "_device_count_nvml", None)
    count = count_nvml() if count_nvml is not None else -1
    if count >= 0:
        return count > 0
    return torch.cuda.is_available()  # no NVML: ask CUDA itself (this initializes the driver)


def install(**options):
    """Replace PyTorch's CUDA caching allocator with torchmem's pool; returns the Config in force.

    Options are those of ``torchmem.Config`` (see docs/config.md), read from
    ``TORCHMEM_CONF="key=value,..."`` and overridden by keyword arguments. Call it
    right after ``import torch``. Calling it again with the same options is a
    no-op; with different options it raises ``RuntimeError`` (the pools already
    hold memory). Raises ``ValueError`` for a bad option, before anything changes.
    """
    global _installed_config
    cfg = _config.from_env_and_kwargs(**options)
    with _lock:
        if _installed_config is not None:
            if cfg == _installed_config:
                return _installed_config
            raise RuntimeError(
                f"torchmem is already installed with {_installed_config!r}; it cannot be re-installed with "
                f"{cfg!r} in the same process (its pools hold memory). Install once, with the options you want."
            )
        fraction = _torch_fraction(cfg)
        _require_cuda_runtime()
        if _core.runtime_allocator_initialized():
            raise RuntimeError("torchmem.install() came too late. " + _INIT_ORDER_HELP)
        try:
            _core.runtime_install(_runtime_options(cfg, fraction), cfg.backend)
        except ValueError as exc:
            if "already configured" in str(exc):  # mem_pool_allocator() made pools with other options
                raise RuntimeError(f"torchmem.install() failed: {exc}") from None
            raise
        _installed_config = cfg
    _hooks._attach_runtime()
    if cfg.patch_torch:
        _patch.patch_torch()
    if cfg.monitor or cfg.share or cfg.metrics_port:
        start_from_config(cfg)  # records, sharing, metrics (docs/monitoring.md)
    return cfg


def start_from_config(cfg):
    """What install() starts after the swap: the publisher (monitor=true), sharing (share=GROUP)
    and the metrics server (metrics_port=N). Returns the Publisher, or None."""
    # Imported here, not at the top: the monitor and sharing load only in a process that asks
    # for them, and they sit above this module (they read the installed allocator).
    from torchmem import monitor, share

    pub = None
    if cfg.monitor or cfg.share:
        try:
            if cfg.share:
                pub = share.start(group=cfg.share, guarantee=cfg.guarantee, wait_s=cfg.share_wait,
                                  interval=cfg.monitor_interval, job=getattr(cfg, "job", None))
            else:
                pub = monitor.start(interval=cfg.monitor_interval, job=getattr(cfg, "job", None))
        except Exception as exc:  # the allocator is installed already: watching must not stop the job
            warnings.warn(f"torchmem monitor: could not start publishing ({exc!r}); training goes on without "
                          f"`top`, metrics{' or sharing' if cfg.share else ''}", RuntimeWarning, stacklevel=3)
    if cfg.metrics_port:
        monitor.serve_metrics(cfg.metrics_port)
    return pub


def installed_config():
    """The Config passed to install(), or None if torchmem is not installed."""
    return _installed_config


def mem_pool_allocator(**options):
    """A ``torch.cuda.memory.CUDAPluggableAllocator`` over torchmem's pool, for
    ``torch.cuda.MemPool(allocator)``: PyTorch's allocator stays in charge and asks
    torchmem for whole segments inside ``torch.cuda.use_mem_pool(pool)``.

    Its alloc returns nullptr (not an exception) when memory is short, as that
    path requires. Options configure torchmem's pools if nothing configured them
    yet (install() did, or an earlier call here); the same object is returned on
    every call and lives as long as the process, as torch requires.
    """
    global _mem_pool_allocator
    _require_cuda_runtime()
    with _lock:
        if _mem_pool_allocator is not None and not options:
            return _mem_pool_allocator
        if not _core.runtime_is_configured() or options:
            cfg = _config.from_env_and_kwargs(**options)
            _core.runtime_configure(_runtime_options(cfg), cfg.backend)
        if _mem_pool_allocator is None:
            _mem_pool_allocator = torch.cuda.memory.CUDAPluggableAllocator(
                _core.__file__, "torchmem_pool_alloc", "torchmem_pool_free"
            )
        return _mem_pool_allocator
