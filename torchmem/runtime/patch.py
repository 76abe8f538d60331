"""patch_torch(): make torch.cuda's memory functions answer from torchmem.

With any pluggable allocator, torch.cuda.memory_stats, memory_allocated,
max_memory_*, reset_peak_memory_stats, memory_summary, _snapshot and
_record_memory_history raise ("CUDAPluggableAllocator does not yet support
..."), which breaks Lightning's DeviceStatsMonitor, Hugging Face Trainer's
memory metrics and every script that prints memory use. patch_torch() replaces
those functions, in both torch.cuda.memory and torch.cuda, with wrappers that
answer from torchmem when its allocator is installed and call torch's original
otherwise, so patching is safe at any time. torchmem.install() calls it unless
the config says patch_torch=False.

Note [Patch both namespaces]
torch.cuda re-exports torch.cuda.memory's functions (`from .memory import *`),
so `torch.cuda.memory_allocated` and `torch.cuda.memory.memory_allocated` are
two names of one function; code reaches both. torch's own functions call each
other through torch.cuda.memory's globals (memory_allocated -> memory_stats,
_dump_snapshot -> _snapshot), so patching the module also fixes callers we do
not wrap. Code that did `from torch.cuda import memory_allocated` before the
patch keeps torch's function: patch early (install() does).

Note [Idempotent]
Originals are stored once; patching again changes nothing, unpatch_torch()
puts the originals back only where our wrapper is still in place (someone who
wrapped ours keeps theirs).
"""

import functools
import threading

import torch
import torch.cuda.memory

from torchmem._loader import is_installed
from torchmem.runtime import snapshots, stats

_lock = threading.Lock()
_originals = {}  # (module name, attribute) -> original function
_patched = {}    # (module name, attribute) -> our wrapper
_source = {"pool": None}


def _use_torchmem():
    """Whether the wrappers answer from torchmem: a pool given to patch_torch, or the installed allocator."""
    if _source["pool"] is not None:
        return True
    return is_installed()


def _device_kwargs(device):
    pool = _source["pool"]
    return {"pool": pool} if pool is not None else {"device": device}


def memory_stats(device=None):
    return stats.memory_stats(**_device_kwargs(device))


def memory_stats_as_nested_dict(device=None):
    return stats.memory_stats_as_nested_dict(**_device_kwargs(device))


def memory_allocated(device=None):
    return stats.memory_allocated(**_device_kwargs(device))


def max_memory_allocated(device=None):
    return stats.max_memory_allocated(**_device_kwargs(device))


def memory_reserved(device=None):
    return stats.memory_reserved(**_device_kwargs(device))


def max_memory_reserved(device=None):
    return stats.max_memory_reserved(**_device_kwargs(device))


def reset_peak_memory_stats(device=None):
    stats.reset_peak_memory_stats(**_device_kwargs(device))


def reset_max_memory_allocated(device=None):
    # torch's version resets every peak too (with a FutureWarning); same effect here.
    stats.reset_peak_memory_stats(**_device_kwargs(device))


def reset_accumulated_memory_stats(device=None):
    stats.reset_accumulated_memory_stats(**_device_kwargs(device))


def memory_summary(device=None, abbreviated=False):
    return stats.memory_summary(abbreviated=abbreviated, **_device_kwargs(device))


def _snapshot(device=None, augment_with_fx_traces=False):
    result = snapshots.snapshot(**_device_kwargs(device))
    if augment_with_fx_traces:
        # torch's own pass: frames in FX-generated files gain fx_node_* fields (the stacks
        # torchmem records are Python frames, as torch's are)
        result = _fx_augmenter()(result)
    return result


def _fx_augmenter():
    augment = getattr(torch.cuda.memory, "_augment_memory_snapshot_stack_traces", None)
    if augment is None:
        augment = getattr(torch._utils, "_augment_memory_snapshot_stack_traces", None)
    if augment is None:
        raise NotImplementedError("_snapshot(augment_with_fx_traces=True): this torch has no FX trace augmentation")
    return augment


def memory_snapshot(mempool_id=None, include_traces=True):
    segments = snapshots.snapshot(include_traces=include_traces, **_device_kwargs(None))["segments"]
    if mempool_id is None or tuple(mempool_id) == (0, 0):  # torch's (0, 0): every pool
        return segments
    wanted = tuple(mempool_id)
    return [s for s in segments if tuple(s["segment_pool_id"]) == wanted]


def _record_memory_history(enabled="all", *args, **kwargs):
    snapshots.torch_record_memory_history(enabled, *args, **kwargs)


def _set_memory_metadata(metadata):
    snapshots.set_memory_metadata(metadata)


def _get_memory_metadata():
    return snapshots.get_memory_metadata()


# name -> our replacement; each answers from torchmem when _use_torchmem(), else calls torch's.
_REPLACEMENTS = {
    "memory_stats": memory_stats,
    "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
    "memory_allocated": memory_allocated,
    "max_memory_allocated": max_memory_allocated,
    "memory_reserved": memory_reserved,
    "max_memory_reserved": max_memory_reserved,
    "reset_peak_memory_stats": reset_peak_memory_stats,
    "reset_max_memory_allocated": reset_max_memory_allocated,
    "reset_accumulated_memory_stats": reset_accumulated_memory_stats,
    "memory_summary": memory_summary,
    "memory_snapshot": memory_snapshot,
    "_snapshot": _snapshot,
    "_record_memory_history": _record_memory_history,
    "_set_memory_metadata": _set_memory_metadata,  # where torch has them (2.10 and later)
    "_get_memory_metadata": _get_memory_metadata,
}
PATCHED_NAMES = tuple(_REPLACEMENTS)


def _wrap(original, replacement):
    @functools.wraps(original)
    def wrapper(*args, **kwargs):
        if _use_torchmem():
            return replacement(*args, **kwargs)
        return original(*args, **kwargs)

    wrapper.__torchmem_patch__ = True
    return wrapper


def _modules():
    return (torch.cuda.memory, torch.cuda)


def patch_torch(pool=None):
    """Makes torch.cuda.memory_stats, memory_stats_as_nested_dict, memory_allocated,
    memory_reserved, max_memory_allocated, max_memory_reserved, reset_peak_memory_stats,
    reset_max_memory_allocated, reset_accumulated_memory_stats, memory_summary,
    memory_snapshot, memory._snapshot and memory._record_memory_history answer from torchmem
    when its allocator is installed (torch's originals otherwise). Idempotent. `pool`: answer
    from this torchmem._C.Pool instead (tests, replays)."""
    with _lock:
        _source["pool"] = pool
        for module in _modules():
            for name, replacement in _REPLACEMENTS.items():
                key = (module.__name__, name)
                current = module.__dict__.get(name)
                if current is None or key in _patched and current is _patched[key]:
                    continue
                # torch.cuda's copy is the same function as torch.cuda.memory's: wrap it once.
                original = getattr(current, "__wrapped__", current) if getattr(current, "__torchmem_patch__", False) else current
                _originals[key] = original
                _patched[key] = _wrap(original, replacement)
                setattr(module, name, _patched[key])
        _share_wrappers()


def _share_wrappers():
    """Where torch.cuda and torch.cuda.memory hold the same original, use one wrapper for both,
    so `torch.cuda.X is torch.cuda.memory.X` stays true as in torch."""
    memory_module, cuda_module = _modules()
    for name in _REPLACEMENTS:
        mkey, ckey = (memory_module.__name__, name), (cuda_module.__name__, name)
        if mkey in _originals and ckey in _originals and _originals[mkey] is _originals[ckey]:
            if cuda_module.__dict__.get(name) is _patched[ckey]:
                _patched[ckey] = _patched[mkey]
                setattr(cuda_module, name, _patched[mkey])


def unpatch_torch():
    """Restores torch's own functions where patch_torch() put ours."""
    with _lock:
        for module in _modules():
            for name in _REPLACEMENTS:
                key = (module.__name__, name)
                if key in _patched and module.__dict__.get(name) is _patched[key]:
                    setattr(module, name, _originals[key])
                _patched.pop(key, None)
                _originals.pop(key, None)
        _source["pool"] = None


def is_patched():
    """True when patch_torch() is in effect (torch.cuda.memory_stats is torchmem's wrapper)."""
    memory_module, _ = _modules()
    return getattr(memory_module.__dict__.get("memory_stats"), "__torchmem_patch__", False)


def original(name, module="torch.cuda.memory"):
    """torch's own function that patch_torch() replaced (for comparisons and fallbacks)."""
    return _originals[(module, name)]
