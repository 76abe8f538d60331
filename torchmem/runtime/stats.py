"""Memory statistics in PyTorch's shape, answered from torchmem's own counters.

With a pluggable allocator torch.cuda.memory_stats() and friends raise, so
torchmem answers them itself: `memory_stats()` returns the flat dotted keys
torch.cuda.memory_stats returns (`allocated_bytes.all.current`,
`reserved_bytes.all.peak`, `num_alloc_retries`, ...) sorted like torch's, plus
torchmem's own figures under `torchmem.` keys (fragmentation ratio, largest free
block, reclaims, backend call counts).

Every function takes an optional source: by default the installed allocator
(device=None = the current device), or an explicit `torchmem._C.Pool` (pool=...),
which is how the CPU tests and trace replays use them. Nothing here keeps state:
every figure comes from the core's counters at call time.

Note [Native key set]
For the installed allocator, the torch keys come from torch's own
torch._C._cuda_memoryStats, which reads them from torchmem's getDeviceStats
(csrc/shim/install.cpp): the key set is exactly the one the native allocator
gives on the running torch version (keys added by newer torch included), and
the numbers are the same ones torch.accelerator.memory_stats shows. For a
simulated pool (pool=...), or if that call fails, the keys are built here.
docs/compatibility.md says what each key means under torchmem.

Note [Numbers only]
Tools iterate over memory_stats() and log every value (Lightning's
DeviceStatsMonitor sends them all to the logger), so every value is an int or a
float; names such as the backend's go to memory_summary() instead.
"""

import collections
import threading

import torch

from torchmem._loader import extension, is_installed

# The nine gauges torch breaks down by pool (csrc/core/stats.h TORCHMEM_STAT_ARRAYS).
STAT_ARRAYS = (
    "allocation", "segment", "active", "inactive_split", "allocated_bytes",
    "reserved_bytes", "active_bytes", "inactive_split_bytes", "requested_bytes",
)
STAT_KINDS = ("all", "small_pool", "large_pool")
STAT_FIELDS = ("current", "peak", "allocated", "freed")
# Scalar counters with torch's names and meaning.
TORCH_COUNTERS = ("num_alloc_retries", "num_ooms", "num_sync_all_streams", "num_device_alloc", "num_device_free")
# Counters only torchmem has (csrc/core/stats.h TORCHMEM_COUNTERS minus torch's).
TORCHMEM_COUNTERS = ("num_reclaims", "num_deferred_frees", "num_cache_releases", "num_allocs", "num_frees",
                     "num_device_barriers", "num_plans", "num_plan_hits", "num_plan_misses", "num_plan_drops",
                     "num_plan_passes", "plan_pass_us", "num_backed_moves", "num_plan_lookups", "num_lazy_pins", "num_growths", "host_alloc_ns", "host_free_ns",
                     "host_plan_ns")


# The OOM hooks' counters (runtime/hooks.py counts, memory_stats reports them as
# torchmem.oom_hook_*). They live here, not in hooks.py, because hooks.py reads
# memory_stats for its hooks: one direction of import, no cycle.
_hook_counters = {"oom_hook_calls": 0, "oom_hook_errors": 0, "oom_hook_successes": 0}
_hook_lock = threading.Lock()


def count_oom_hook(name):
    """Adds one to the OOM-hook counter `name` (a key of oom_hook_counters())."""
    with _hook_lock:
        _hook_counters[name] += 1


def oom_hook_counters():
    """{'oom_hook_calls', 'oom_hook_successes', 'oom_hook_errors'}: totals for this process."""
    with _hook_lock:
        return dict(_hook_counters)


class NotInstalledError(RuntimeError):
    """Raised when a function needs the installed allocator and torchmem is not installed."""


def _runtime():
    """torchmem._C when its allocator is installed in this process, else raises."""
    if not is_installed():
        cuda = extension().build_info()["cuda_backends"]
        raise NotInstalledError(
            ("torchmem's allocator is not installed in this process: call torchmem.install() right after "
             "`import torch`" if cuda else
             "this torchmem build has no CUDA runtime (built without CUDA)")
            + ", or pass pool=<torchmem._C.Pool> to read a simulated pool"
        )
    return extension()


def device_index(device=None):
    """The CUDA device ordinal for None (current device), an int, 'cuda:N' or a torch.device."""
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, str):
        device = torch.device(device)
    if isinstance(device, torch.device):
        if device.type != "cuda":
            raise ValueError(f"torchmem: expected a CUDA device, got {device}")
        return torch.cuda.current_device() if device.index is None else device.index
    if isinstance(device, int) and not isinstance(device, bool) and device >= 0:
        return device
    raise ValueError(f"torchmem: expected a device (None, an int >= 0, 'cuda:N' or torch.device), got {device!r}")


def raw_stats(device=None, pool=None):
    """The core's stats dict (the shape of _C.Pool.stats()) from `pool` or the installed allocator."""
    if pool is not None:
        return pool.stats()
    runtime = _runtime()
    return runtime.runtime_stats(device_index(device))


def fragmentation_ratio(raw):
    """Peak reserved bytes over peak requested bytes (0.0 before anything was requested)."""
    requested = raw["requested_bytes"]["all"]["peak"]
    return raw["reserved_bytes"]["all"]["peak"] / requested if requested else 0.0


def _torchmem_figures(raw):
    """torchmem's own figures, as a flat dict of numbers (Note [Numbers only])."""
    figures = {
        "fragmentation_ratio": fragmentation_ratio(raw),
        "largest_free_block": raw.get("largest_free_block", 0),
        "limit_bytes": raw.get("limit_bytes", 0),
        "granularity": raw.get("granularity", 0),
    }
    for name in TORCHMEM_COUNTERS:
        figures[name] = raw.get(name, 0)
    for name in ("device_total", "device_free", "failed_deleter_frees"):
        if name in raw:
            figures[name] = raw[name]
    for name, value in (raw.get("backend") or {}).items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            figures["backend." + name] = value
    figures.update(oom_hook_counters())
    return figures


def _torch_nested_stats(device):
    """torch's own nested stats dict for the installed allocator (Note [Native key set]), or None."""
    try:
        return dict(torch._C._cuda_memoryStats(device_index(device)))
    except (AttributeError, RuntimeError):
        return None


def memory_stats_as_nested_dict(device=None, pool=None):
    """torch.cuda.memory_stats_as_nested_dict()'s shape: {stat: {pool: {field: n}}, counter: n, ...},
    plus torchmem's figures nested under "torchmem"."""
    raw = raw_stats(device, pool)
    if pool is None:
        native = _torch_nested_stats(device)
        if native is not None:
            native["torchmem"] = _torchmem_figures(raw)
            return native
    nested = {}
    for name in STAT_ARRAYS:
        nested[name] = {kind: {field: int(raw[name][kind][field]) for field in STAT_FIELDS} for kind in STAT_KINDS}
    for name in TORCH_COUNTERS:
        nested[name] = int(raw.get(name, 0))
    # torchmem never refuses to split a block: torch reports -1 (no max_split_size) then.
    nested["max_split_size"] = -1
    nested["num_oom_rejections"] = 0
    for name in ("oversize_allocations", "oversize_segments"):
        nested[name] = {field: 0 for field in STAT_FIELDS}
    nested["torchmem"] = _torchmem_figures(raw)
    return nested


def _flatten(prefix, value, out):
    if isinstance(value, dict):
        for key, item in value.items():
            _flatten(f"{prefix}.{key}" if prefix else str(key), item, out)
    else:
        out.append((prefix, value))


def memory_stats(device=None, pool=None):
    """torch.cuda.memory_stats() from torchmem: an OrderedDict of flat dotted keys sorted like
    torch's (`allocated_bytes.all.current`, `reserved_bytes.all.peak`, `num_ooms`, ...), plus
    `torchmem.fragmentation_ratio`, `torchmem.largest_free_block`, `torchmem.num_reclaims`,
    `torchmem.backend.<call>` and friends."""
    items = []
    _flatten("", memory_stats_as_nested_dict(device, pool), items)
    items.sort()
    return collections.OrderedDict(items)


def _stat(device, pool, name, field):
    return int(raw_stats(device, pool)[name]["all"][field])


def memory_allocated(device=None, pool=None):
    """Bytes held by live tensors (rounded to 512 B), as torch.cuda.memory_allocated."""
    return _stat(device, pool, "allocated_bytes", "current")


def max_memory_allocated(device=None, pool=None):
    """Peak of memory_allocated() since start or the last reset_peak_memory_stats()."""
    return _stat(device, pool, "allocated_bytes", "peak")


def memory_reserved(device=None, pool=None):
    """Bytes the allocator holds from the device (mapped granules or segments)."""
    return _stat(device, pool, "reserved_bytes", "current")


def max_memory_reserved(device=None, pool=None):
    """Peak of memory_reserved() since start or the last reset_peak_memory_stats()."""
    return _stat(device, pool, "reserved_bytes", "peak")


def reset_peak_memory_stats(device=None, pool=None):
    """Sets every peak to its current value (torch.cuda.reset_peak_memory_stats)."""
    if pool is not None:
        pool.reset_peak_stats()
    else:
        _runtime().runtime_reset_peak_stats(device_index(device))


def reset_accumulated_memory_stats(device=None, pool=None):
    """Resets the allocated/freed totals and event counters (torch.cuda.reset_accumulated_memory_stats)."""
    if pool is not None:
        pool.reset_accumulated_stats()
    else:
        _runtime().runtime_reset_accumulated_stats(device_index(device))


def empty_cache(pool=None):
    """Returns cached free memory to the device (every device for the installed allocator);
    returns the bytes released. Live tensors are untouched."""
    if pool is not None:
        return int(pool.release_cached())
    return int(_runtime().runtime_empty_cache())


def format_bytes(n):
    """Bytes in binary units, e.g. '1.50 GiB' (the units PyTorch's OOM messages use)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.2f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


_SUMMARY_ROWS = (
    ("allocated_bytes", "Allocated memory", True),
    ("active_bytes", "Active memory", True),
    ("requested_bytes", "Requested memory", True),
    ("reserved_bytes", "GPU reserved memory", True),
    ("inactive_split_bytes", "Cached free memory", True),
    ("allocation", "Allocations", False),
    ("active", "Active allocs", False),
    ("segment", "Reserved granules/segs", False),
    ("inactive_split", "Cached free blocks", False),
)


def memory_summary(device=None, abbreviated=False, pool=None):
    """A readable table of the allocator's state, laid out like torch.cuda.memory_summary(),
    with torchmem's figures (fragmentation ratio, largest free block, reclaims, backend calls)."""
    raw = raw_stats(device, pool)
    where = "simulated pool" if pool is not None else f"device {device_index(device)}"
    width = 79
    lines = ["=" * width, f" torchmem memory summary, {where} (backend: {raw.get('backend_name', '?')})".ljust(width)]
    lines.append("-" * width)
    lines.append(
        f"  OOMs: {raw.get('num_ooms', 0):<8d} alloc retries: {raw.get('num_alloc_retries', 0):<8d}"
        f" reclaims: {raw.get('num_reclaims', 0):<10d}".ljust(width)
    )
    lines.append("=" * width)
    lines.append("        Metric          |  Cur Usage  | Peak Usage  |  Tot Alloc  |  Tot Freed ")
    kinds = (("all", None),) if abbreviated else (("all", None), ("large_pool", "  from large pool"), ("small_pool", "  from small pool"))
    for name, title, is_bytes in _SUMMARY_ROWS:
        lines.append("-" * width)
        for kind, label in kinds:
            stat = raw[name][kind]
            cells = [format_bytes(stat[f]) if is_bytes else str(stat[f]) for f in STAT_FIELDS]
            lines.append(f" {(label or title):<23}| " + " | ".join(f"{c:>11}" for c in cells))
    lines.append("=" * width)
    lines.append(f" Fragmentation ratio (peak reserved / peak requested): {fragmentation_ratio(raw):.4f}")
    lines.append(f" Largest free block: {format_bytes(raw.get('largest_free_block', 0))}")
    limit = raw.get("limit_bytes", 0)
    lines.append(f" Budget: {format_bytes(limit) if limit else 'the whole device'}")
    backend = raw.get("backend") or {}
    calls = ", ".join(f"{k}={v}" for k, v in backend.items() if isinstance(v, int) and not isinstance(v, bool) and v)
    lines.append(f" Backend calls: {calls or 'none'}")
    lines.append("=" * width)
    return "\n".join("|" + line.ljust(width) + "|" for line in lines) + "\n"
