"""OOM detection and the `@torchmem.oom_retry` decorator.

`is_oom_error(exc)` recognises every way an out-of-memory condition reaches
Python, not only `torch.OutOfMemoryError`; `oom_retry` wraps a function over a
batch (inference, evaluation, a training step) so that an OOM cleans up, runs
torchmem's OOM hooks and tries again on smaller pieces instead of killing the
job.

Note [OOM variants]
- torch.OutOfMemoryError: the caching allocator's and torchmem's own
  ("CUDA out of memory. Tried to allocate ...").
- RuntimeError "CUDA error: out of memory": a kernel launch or cudaMalloc outside
  the allocator (cuBLAS workspaces, NCCL, a CUDA extension).
- "CUBLAS_STATUS_ALLOC_FAILED": cuBLAS could not allocate its handle/workspace.
- "std::bad_alloc" / "out_of_memory" from pluggable allocators such as RMM
  (pytorch#133280), and CPU "DefaultCPUAllocator: can't allocate memory".
- "CUDNN_STATUS_NOT_SUPPORTED": cuDNN says this when a workspace cannot be
  allocated, but also for genuinely unsupported configurations, so it counts
  only with a warning (Composer and Accelerate do the same).

Note [Cleaning up outside except]
The exception's traceback holds every frame of the failed call and so every
tensor they reference. Cleanup therefore runs after the `except` block has
ended and the exception object is gone (the PyTorch FAQ's advice), keeping only
its message.

Note [Remembered sizes]
The size that worked is remembered per call site (the decorated function) and
per bucket of free memory, as toma does: when free memory rises into a new
bucket at least two buckets (512 MiB) above the one where a size was learnt
(a model was freed, a budget was raised) the search starts again from the full
size, which is how the decorator grows back; one bucket of jitter is ignored.
"""

import functools
import gc
import inspect
import re
import threading
import warnings

import torch

from torchmem import _loader
from torchmem.batch.probe import default_probe
from torchmem.batch.split import batch_size_of, concat_results, split_batch
from torchmem.runtime import hooks

__all__ = ["is_oom_error", "oom_retry", "cleanup_after_oom", "free_memory_bytes", "OOMRetryError"]

_OOM_PATTERNS = (
    "cuda out of memory",
    "cuda error: out of memory",
    "cublas_status_alloc_failed",
    "std::bad_alloc",
    "out_of_memory",
    "out of memory.",
    "can't allocate memory",
    "hip out of memory",
)
_CUDNN_NOT_SUPPORTED = "cudnn_status_not_supported"
_TRIED_RE = re.compile(r"Tried to allocate ([0-9.]+) ?([KMGT]i?B|bytes)", re.IGNORECASE)
_UNIT = {"bytes": 1, "kib": 1 << 10, "kb": 1 << 10, "mib": 1 << 20, "mb": 1 << 20,
         "gib": 1 << 30, "gb": 1 << 30, "tib": 1 << 40, "tb": 1 << 40}
MEMORY_BUCKET_BYTES = 256 << 20


class OOMRetryError(RuntimeError):
    """An OOM that oom_retry could not get past (size 1 still failed, or the
    retry bound was reached)."""


def is_oom_error(exc):
    """True when `exc` is an out-of-memory error in any of its forms
    (Note [OOM variants]). cuDNN's NOT_SUPPORTED counts, with a warning."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    if not isinstance(exc, (RuntimeError, MemoryError)):
        return False
    if isinstance(exc, MemoryError):
        return True
    message = str(exc).lower()
    if any(pattern in message for pattern in _OOM_PATTERNS):
        return True
    if _CUDNN_NOT_SUPPORTED in message:
        warnings.warn(
            "torchmem: treating cuDNN's CUDNN_STATUS_NOT_SUPPORTED as out of memory (it usually means a "
            "workspace could not be allocated); if it persists at small sizes it is a real cuDNN limitation",
            RuntimeWarning, stacklevel=2,
        )
        return True
    return False


def requested_bytes_of(message):
    """The "Tried to allocate X" figure of an OOM message, in bytes (0 if absent)."""
    match = _TRIED_RE.search(message or "")
    if not match:
        return 0
    return int(float(match.group(1)) * _UNIT.get(match.group(2).lower(), 1))


def _run_torchmem_hooks(device, requested):
    try:
        return bool(hooks._run_hooks(device, requested))
    except Exception as hook_error:  # a hook's failure must not hide the OOM being handled
        warnings.warn(f"torchmem: OOM hooks raised during cleanup: {hook_error!r}", RuntimeWarning)
        return False


def cleanup_after_oom(message="", run_hooks=True, device=None):
    """Frees what an OOM left behind: garbage cycles, torch's cached blocks (not
    under torchmem's VMM pool: Note [No empty_cache after an OOM]), and
    whatever the registered OOM hooks free.
    Call it OUTSIDE the except block (Note [Cleaning up outside except])."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        if device is None:
            device = torch.cuda.current_device()
        if run_hooks:
            _run_torchmem_hooks(device, requested_bytes_of(message))
        if _cache_release_helps(device):
            torch.cuda.empty_cache()


def _cache_release_helps(device):
    """Note [No empty_cache after an OOM]
    Under PyTorch's allocator (or torchmem's cuda_malloc backend) cached
    segments are whole cudaMalloc blocks, and freeing them is what lets a
    request of another shape fit. torchmem's VMM pool already stitches every
    cached granule into whatever block needs it, so emptying its cache frees
    nothing it could not use, and the next step maps it all again: on the H200
    sharing scenario each OOM a batch-size controller recovered from released
    and re-created tens of thousands of granules (bench/share_scenario.py)."""
    if not _loader.is_installed():
        return True
    try:
        return _loader.extension().runtime_backend_name(device) != "vmm"
    except Exception:  # no torchmem state for this device: nothing to judge, do what torch would
        return True


def free_memory_bytes(device=None):
    """Bytes this process could still allocate on `device`: the budget left under
    torchmem, device free + cached-but-unused under torch; None on CPU."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None
    probe = default_probe(device)
    try:
        budget, current = probe.budget_bytes(), probe.current_bytes()
    except RuntimeError:
        return None
    if budget is None or current is None:
        return None
    return max(0, budget - current)


class _SizeCache:
    """Working sizes per (call site, free-memory bucket) (Note [Remembered sizes])."""

    def __init__(self):
        self._sizes = {}
        self._lock = threading.Lock()

    @staticmethod
    def bucket():
        free = free_memory_bytes()
        return -1 if free is None else free // MEMORY_BUCKET_BYTES

    def get(self, site):
        """The size for the current bucket; a size from one bucket lower also
        counts (free memory jitters across a bucket edge between calls); from
        two or more buckets lower it does not: memory rose, search again."""
        bucket = self.bucket()
        with self._lock:
            size = self._sizes.get((site, bucket))
            return size if size is not None else self._sizes.get((site, bucket - 1))

    def put(self, site, size):
        with self._lock:
            self._sizes[(site, self.bucket())] = size

    def clear(self):
        with self._lock:
            self._sizes.clear()


def _shrink(size, factor):
    return max(1, min(size - 1, int(size * factor)))


def oom_retry(function=None, *, mode="split", batch_arg=0, batch_size_arg="batch_size",
              min_size=1, max_retries=16, shrink=0.5, remember=True, run_hooks=True, split_lists=False):
    """Retries a function over a batch on OOM, on smaller pieces.

    mode="split": the batch argument (`batch_arg`: a position or a parameter
    name; the first argument by default) is cut into chunks of the remembered
    working size, the function runs on each chunk and the results are joined
    (tensors along dim 0; tuples, dicts, dataclasses per element; lists end to
    end). On OOM the failing chunk is retried at `shrink` x its size; chunks
    already done are kept.

    mode="batch_size": the function takes a batch-size argument
    (`batch_size_arg`) and loops itself; on OOM it is called again with a
    smaller value.

    Either way: cleanup runs outside the except block and calls torchmem's OOM
    hooks; at most `max_retries` OOMs per call; below `min_size` it raises
    OOMRetryError. The working size is remembered per call site and per
    bucket of free memory, so later calls start there and grow back when memory
    frees up. `wrapper.reset_sizes()` forgets them.

    Usable bare (`@oom_retry`) or with arguments (`@oom_retry(mode=...)`)."""
    if mode not in ("split", "batch_size"):
        raise ValueError(f"oom_retry: mode must be 'split' or 'batch_size', got {mode!r}")
    if not 0.0 < shrink < 1.0:
        raise ValueError(f"oom_retry: shrink must be in (0, 1), got {shrink}")
    if min_size < 1 or max_retries < 0:
        raise ValueError(f"oom_retry: need min_size >= 1 and max_retries >= 0, got {min_size}, {max_retries}")

    def decorate(fn):
        # imported here: torchmem.batch imports this module for is_oom_error
        site = f"{fn.__module__}.{fn.__qualname__}"
        cache = _SizeCache()
        signature = inspect.signature(fn)

        def argument_name(spec):
            if isinstance(spec, int):
                names = list(signature.parameters)
                if spec >= len(names):
                    raise ValueError(f"oom_retry({site}): batch_arg={spec} but the function has {len(names)} parameters")
                return names[spec]
            if spec not in signature.parameters:
                raise ValueError(f"oom_retry({site}): the function has no parameter {spec!r}")
            return spec

        def give_up(size, message):
            raise OOMRetryError(
                f"oom_retry({site}): still out of memory at size {size} (min_size={min_size}, "
                f"max_retries={max_retries}); last error: {message}"
            )

        def run_split(args, kwargs):
            bound = signature.bind(*args, **kwargs)
            name = argument_name(batch_arg)
            batch = bound.arguments[name]
            total = batch_size_of(batch)
            size = min(total, cache.get(site) or total) if remember else total
            results, done, retries = [], 0, 0
            while done < total:
                chunk = min(size, total - done)
                sizes = [s for s in (done, chunk, total - done - chunk) if s > 0]
                pieces = split_batch(batch, sizes, batch_size=total, split_lists=split_lists)
                piece = pieces[1] if done > 0 else pieces[0]
                bound.arguments[name] = piece
                failure = None
                try:
                    results.append(fn(*bound.args, **bound.kwargs))
                except Exception as exc:  # noqa: BLE001 - filtered right here
                    if not is_oom_error(exc):
                        raise
                    failure = str(exc)
                del pieces, piece
                if failure is None:
                    done += chunk
                    continue
                cleanup_after_oom(failure, run_hooks=run_hooks)
                retries += 1
                if chunk <= min_size or retries > max_retries:
                    give_up(chunk, failure)
                size = max(min_size, _shrink(chunk, shrink))
                if remember:
                    cache.put(site, size)
            if remember and retries == 0 and cache.get(site) is None:
                cache.put(site, size)
            return concat_results(results)

        def run_batch_size(args, kwargs):
            bound = signature.bind(*args, **kwargs)
            name = argument_name(batch_size_arg)
            requested = bound.arguments.get(name, signature.parameters[name].default)
            if not isinstance(requested, int) or requested < 1:
                raise ValueError(f"oom_retry({site}): argument {name!r} must be a positive int, got {requested!r}")
            size = min(requested, cache.get(site) or requested) if remember else requested
            retries = 0
            while True:
                bound.arguments[name] = size
                failure = None
                try:
                    result = fn(*bound.args, **bound.kwargs)
                except Exception as exc:  # noqa: BLE001 - filtered right here
                    if not is_oom_error(exc):
                        raise
                    failure = str(exc)
                if failure is None:
                    if remember:
                        cache.put(site, size)
                    return result
                cleanup_after_oom(failure, run_hooks=run_hooks)
                retries += 1
                if size <= min_size or retries > max_retries:
                    give_up(size, failure)
                size = max(min_size, _shrink(size, shrink))

        runner = run_split if mode == "split" else run_batch_size

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            return runner(args, kwargs)

        wrapper.reset_sizes = cache.clear
        wrapper.remembered_size = lambda: cache.get(site)
        return wrapper

    if function is not None:
        return decorate(function)
    return decorate
