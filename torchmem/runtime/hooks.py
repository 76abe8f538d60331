"""OOM-recovery hooks: user callables that free memory before an allocation fails.

`on_oom(fn)` registers `fn(device, requested_bytes, stats) -> bool`. When the
pool's OOM ladder (release every cache, retry) still finds no memory, the
allocator shim calls `_run_hooks` OUTSIDE its lock with the GIL held; the hooks
run in registration order until one returns True ("I freed something, retry").
The shim retries the allocation at most `oom_hook_retries` times (config), so a
hook that claims success without freeing cannot loop forever. While a budget
mover is plugged (GPU sharing, runtime/budget.py), its OOM waiter runs first,
counted as a hook: an owner waits for borrowers to yield before the user's
hooks drop anything.

Note [Hook errors]
A hook that raises must not turn an OOM into a silent retry or hide a bug: the
exception is reported (warnings.warn with the traceback text, and logged on the
"torchmem" logger), counted (`torchmem.oom_hook_errors` in memory_stats), and
the hook counts as having freed nothing; the next hook still runs.

Note [Re-entrant OOM]
A hook may allocate (e.g. build a smaller cache). If that allocation fails too,
the shim calls back while we are still inside the hooks; running them again
could recurse without end, so a nested call returns False at once and the
nested allocation fails with the normal OOM error.
"""

import itertools
import logging
import threading
import traceback
import warnings

from torchmem._loader import extension, is_installed
from torchmem.runtime import budget
from torchmem.runtime.stats import count_oom_hook, memory_stats, oom_hook_counters

_log = logging.getLogger("torchmem")

_hooks = {}  # handle id -> fn, in registration order (dicts keep insertion order)
_ids = itertools.count(1)
_lock = threading.Lock()
_state = threading.local()


class OomHookHandle:
    """Returned by on_oom(); `handle.remove()` (or remove_oom_hook(handle)) unregisters the hook."""

    __slots__ = ("id", "fn")

    def __init__(self, hook_id, fn):
        self.id = hook_id
        self.fn = fn

    def remove(self):
        remove_oom_hook(self)

    def __repr__(self):
        return f"OomHookHandle(id={self.id}, fn={self.fn!r})"


def on_oom(fn):
    """Registers `fn(device, requested_bytes, stats) -> bool`, called when an allocation is about
    to fail with out-of-memory. Return True after freeing memory (e.g. dropping a cache) to make
    the allocator retry; False to let the next hook try. `stats` is torchmem.memory_stats() of
    that device. Returns a handle for remove_oom_hook()."""
    if not callable(fn):
        raise TypeError(f"torchmem.on_oom: expected a callable fn(device, requested_bytes, stats) -> bool, got {fn!r}")
    with _lock:
        handle = OomHookHandle(next(_ids), fn)
        _hooks[handle.id] = fn
    _attach_runtime()
    return handle


def remove_oom_hook(handle):
    """Unregisters a hook registered by on_oom(). Removing one twice raises ValueError."""
    if not isinstance(handle, OomHookHandle):
        raise TypeError(f"torchmem.remove_oom_hook: expected the handle on_oom() returned, got {handle!r}")
    with _lock:
        if _hooks.pop(handle.id, None) is None:
            raise ValueError(f"torchmem.remove_oom_hook: {handle!r} is not registered (removed already?)")


def registered_hooks():
    """The registered hook callables, in the order they run."""
    with _lock:
        return list(_hooks.values())


def hook_counters():
    """{'oom_hook_calls', 'oom_hook_successes', 'oom_hook_errors'}: totals for this process."""
    return oom_hook_counters()


def _attach_runtime():
    """Makes the installed allocator call _run_hooks on OOM. Called by on_oom() and by
    torchmem.install(); a no-op when torchmem's allocator is not installed."""
    if is_installed():
        extension().runtime_set_oom_callback(_run_hooks)
        return True
    return False


def _report_error(fn, device, requested):
    text = traceback.format_exc()
    count_oom_hook("oom_hook_errors")
    message = (
        f"torchmem: OOM hook {fn!r} raised while device {device} needed {requested} bytes; "
        f"treated as 'freed nothing'.\n{text}"
    )
    _log.error(message)
    warnings.warn(message, RuntimeWarning, stacklevel=2)


def _run_hooks(device, requested, pool=None):
    """Runs the hooks in order until one returns True; returns whether one did.
    The runtime's OOM callback (and allocate_with_oom_hooks for simulated pools)."""
    if getattr(_state, "running", False):
        return False  # Note [Re-entrant OOM]
    hooks = registered_hooks()
    waiter = budget.oom_waiter()
    if waiter is not None:  # a sharing owner waits for borrowers before the user's hooks drop anything
        hooks.insert(0, waiter)
    if not hooks:
        return False
    _state.running = True
    try:
        try:
            stats = memory_stats(device, pool=pool)
        except Exception:  # stats are a courtesy to the hook; never let them block recovery
            _log.exception("torchmem: could not read stats for the OOM hooks")
            stats = {}
        for fn in hooks:
            count_oom_hook("oom_hook_calls")
            try:
                freed = bool(fn(device, requested, stats))
            except Exception:
                _report_error(fn, device, requested)  # Note [Hook errors]
                continue
            if freed:
                count_oom_hook("oom_hook_successes")
                return True
        return False
    finally:
        _state.running = False


def allocate_with_oom_hooks(pool, size, stream=0, retries=3, device=0, **allocate_kwargs):
    """Allocates from a torchmem._C.Pool (e.g. a simulated one) the way the installed allocator
    does: on OOM run the hooks and retry, at most `retries` times. Returns the address, or 0."""
    addr = pool.allocate(size, stream, **allocate_kwargs)
    attempts = 0
    while addr == 0 and attempts < retries and _run_hooks(device, size, pool=pool):
        attempts += 1
        addr = pool.allocate(size, stream, **allocate_kwargs)
    return addr
