"""torchmem.host: a pinned host memory pool for fast non_blocking copies.

    buf = torchmem.host.empty((8, 1024, 1024), dtype=torch.bfloat16)   # page-locked
    buf.copy_(cpu_batch); gpu = buf.to("cuda", non_blocking=True)
    del buf          # back to the pool; reused once the copy has finished

Blocks are carved from large chunks (64 MiB by default) that are mapped on the
GPU's NUMA node, backed by huge pages where the kernel allows, first-touched in
parallel and registered with cudaHostRegister: pinning 1 GiB this way is
several times faster than torch's cudaHostAlloc path. Sizes round to four
classes per power of two (at most 25% lost, torch's pinned cache loses up to
100%). The policy is C++ (csrc/host/host_pool.h); docs/host.md is the guide.

Streams: a block freed while a copy from it may still run is reused only after
an event recorded at free time completed, on every stream it was used on: the
stream current when it was allocated, plus every stream passed to
record_stream(tensor, stream). Copy on another stream? Call record_stream.

Fallbacks are never silent: refused pinning (memlock limits) or refused huge
pages (THP off) give a RuntimeWarning naming the cause and the fix, and the
memory is still handed out (pageable or on 4 KiB pages). Running out gives
HostOutOfMemoryError (a MemoryError) naming the request, what is pinned and the
limits; nothing held is lost.
"""

import collections.abc
import queue
import threading
import warnings

import torch

from torchmem._loader import extension

# The core loads, and is checked against the installed torch, when this module loads (as
# importing torchmem._C here did): a bad build is reported before anything runs.
_core = extension()

__all__ = [
    "HostPool", "HostOutOfMemoryError", "default_pool", "empty", "empty_like", "pin", "record_stream",
    "stats", "reset_peak_stats", "empty_cache", "set_limit", "pin_batch", "pinned", "install_torch_host_allocator",
]

HostOutOfMemoryError = _core.HostOutOfMemoryError

_MiB = 1 << 20


class HostPool:
    """A pool of page-locked host memory.

    Arguments (keywords):
      backend        "auto" (CUDA when a GPU is usable, else "sim" with a
                     warning that the memory is pageable), "cuda", or "sim"
                     (real memory, simulated registration and events: tests).
      device         the GPU whose NUMA node and streams the pool serves
                     (default: the current one).
      chunk_mb       size of the chunks small blocks are carved from (64).
      limit_bytes    most bytes the pool may hold (0: no limit of its own).
      require_pinned raise HostOutOfMemoryError instead of falling back to
                     pageable memory when pinning is refused.
      huge_pages     "thp" (transparent huge pages via madvise), "hugetlb"
                     (reserved hugetlbfs pages, falling back to THP), "off".
      numa           bind chunks to the GPU's NUMA node (no-op with one node).
      touch_threads  threads that first-touch a new chunk (8).
      sysfs_root     where NUMA and THP facts are read ("/sys"; tests fake it).
      sim            backend="sim" only: dict of refuse_pinning, memlock_bytes,
                     capacity_bytes, auto_complete (see sim_host_backend.h).
    """

    def __init__(self, *, backend="auto", device=None, chunk_mb=64, limit_bytes=0, require_pinned=False,
                 huge_pages="thp", numa=True, touch_threads=8, sysfs_root="/sys", sim=None):
        if backend not in ("auto", "cuda", "sim"):
            raise ValueError(f"torchmem.host: backend must be 'auto', 'cuda' or 'sim', got {backend!r}")
        if not isinstance(chunk_mb, int) or chunk_mb < 2 or chunk_mb % 2:
            raise ValueError(f"torchmem.host: chunk_mb must be an even int >= 2 (whole huge pages), got {chunk_mb!r}")
        cuda_ok = hasattr(_core.HostPool, "cuda") and torch.cuda.is_available()
        sim = dict(sim or {})
        self._no_gpu = False
        if backend == "auto":
            backend = "cuda" if cuda_ok else "sim"
            if backend == "sim":
                # No GPU to register with: nothing is pinned, and one warning says so.
                sim.setdefault("refuse_pinning", True)
                self._no_gpu = True
                warnings.warn("torchmem.host: no CUDA GPU is usable here, so the pool hands out ordinary pageable "
                              "memory (nothing is pinned)", RuntimeWarning, stacklevel=2)
        if backend == "cuda" and not cuda_ok:
            raise RuntimeError("torchmem.host: backend='cuda' needs a CUDA build of torchmem and a visible GPU; "
                               "use backend='sim' for tests")
        if sim and backend != "sim":
            raise ValueError("torchmem.host: sim=... options apply only to backend='sim'")
        self.device = None
        self._routed = False  # torch's pinned allocator (install_torch_host_allocator)
        chunk_bytes = chunk_mb * _MiB
        if backend == "cuda":
            self.device = torch.device("cuda", torch.cuda.current_device() if device is None
                                       else torch.device(device).index or 0)
            self._pool = _core.HostPool.cuda(self.device.index, chunk_bytes, limit_bytes, require_pinned, huge_pages,
                                          numa, touch_threads, sysfs_root)
        else:
            self._pool = _core.HostPool.sim(chunk_bytes, limit_bytes, require_pinned, huge_pages, sysfs_root, **sim)
        self.backend = backend

    # ---------------------------------------------------------------- blocks
    def _stream_id(self, stream):
        if stream is not None:
            return stream.cuda_stream if hasattr(stream, "cuda_stream") else int(stream)
        if self.device is not None:
            return torch.cuda.current_stream(self.device).cuda_stream
        return 0

    def empty(self, shape, dtype=torch.float32, *, stream=None):
        """An uninitialized CPU tensor in pool memory (pinned unless pinning
        was refused), first used on `stream` (default: the current stream)."""
        if not isinstance(dtype, torch.dtype):
            raise TypeError(f"torchmem.host: dtype must be a torch.dtype, got {dtype!r}")
        if self._routed and stream is None:
            # The same block through torch's own path, several times faster than the
            # binding (BENCHMARKS.md, Host memory and offload); torch's copies report their streams.
            return torch.empty(shape, dtype=dtype, pin_memory=True)
        if isinstance(shape, int):
            shape = (shape,)
        numel = 1
        for s in shape:
            if s < 0:
                raise ValueError(f"torchmem.host: negative size in shape {tuple(shape)}")
            numel *= s
        if numel == 0:
            return torch.empty(shape, dtype=dtype)
        nbytes = numel * dtype.itemsize
        try:
            raw = self._pool.empty_bytes(nbytes, self._stream_id(stream))
        finally:
            self._warn_notices()
        return raw.view(dtype).view(shape)

    def empty_like(self, tensor, *, stream=None):
        """empty() with the shape and dtype of `tensor` (contiguous)."""
        return self.empty(tensor.shape, tensor.dtype, stream=stream)

    def pin(self, tensor, *, stream=None):
        """A pool copy of a CPU tensor (contiguous), ready for non_blocking copies."""
        if tensor.device.type != "cpu":
            raise ValueError(f"torchmem.host.pin: expected a CPU tensor, got one on {tensor.device}")
        out = self.empty_like(tensor, stream=stream)
        out.copy_(tensor)
        return out

    def record_stream(self, tensor, stream):
        """Marks the pool tensor `tensor` as used on `stream` too: its block is
        reused only after the work queued there when it is freed completed."""
        self._pool.record_stream(tensor.untyped_storage().data_ptr(), self._stream_id(stream))

    def owns(self, tensor):
        """True if `tensor`'s storage is a live block of this pool."""
        return self._pool.block_size(tensor.untyped_storage().data_ptr()) > 0

    def is_pinned(self, tensor):
        return self._pool.is_pinned(tensor.untyped_storage().data_ptr())

    # ----------------------------------------------------------------- state
    def stats(self):
        """Counters as a flat dict: torch.cuda.host_memory_stats() names
        ("allocations.current", "allocated_bytes.peak", "num_host_alloc",
        "host_alloc_time.total" in us, ...) plus torchmem's own (pinned_bytes,
        huge_page_bytes, cached_bytes, pending_bytes, held_bytes, cache_hits,
        numa_node, ...)."""
        raw = self._pool.stats()
        out = {
            "allocations.current": raw["allocations_current"],
            "allocations.peak": raw["allocations_peak"],
            "allocations.allocated": raw["allocations_allocated"],
            "allocations.freed": raw["allocations_freed"],
            "allocated_bytes.current": raw["allocated_bytes_current"],
            "allocated_bytes.peak": raw["allocated_bytes_peak"],
            "active_requests.current": raw["allocations_current"],
            "active_bytes.current": raw["requested_bytes_current"],
            "num_host_alloc": raw["num_host_alloc"],
            "num_host_free": raw["num_host_free"],
            "host_alloc_time.total": raw["host_alloc_time_us_total"],
            "host_alloc_time.max": raw["host_alloc_time_us_max"],
            "host_free_time.total": raw["host_free_time_us_total"],
        }
        out.update(raw)
        out["numa_node"] = self._pool.numa_node
        out["thp_mode"] = self._pool.thp_mode
        out["limit_bytes"] = self._pool.limit()
        out["backend"] = self._pool.backend_name
        return out

    def reset_peak_stats(self):
        self._pool.reset_peak_stats()

    def empty_cache(self):
        """Gives back chunks with no live block (after their copies finished).
        Returns the bytes given back."""
        return self._pool.release_cached()

    def set_limit(self, limit_bytes):
        """Most bytes the pool may hold (0: no limit of its own). Does not free live blocks."""
        if not isinstance(limit_bytes, int) or limit_bytes < 0:
            raise ValueError(f"torchmem.host: limit_bytes must be an int >= 0, got {limit_bytes!r}")
        self._pool.set_limit(limit_bytes)

    def check(self):
        """Raises AssertionError if the pool's bookkeeping is inconsistent (tests)."""
        problem = self._pool.check_invariants()
        if problem:
            raise AssertionError(f"torchmem.host: {problem}")

    def _warn_notices(self):
        for text in self._pool.take_notices():
            if self._no_gpu and text.startswith("torchmem.host: pinning"):
                continue  # said once at construction
            warnings.warn(text, RuntimeWarning, stacklevel=4)

    def __repr__(self):
        s = self._pool.stats()
        return (f"HostPool(backend={self.backend!r}, held={s['held_bytes']}, pinned={s['pinned_bytes']}, "
                f"live={s['allocated_bytes_current']})")


_default_pools = {}
_default_lock = threading.Lock()


def default_pool(device=None):
    """The process's pool for `device` (a CUDA device; default: the current
    one), created on first use with default settings."""
    if torch.cuda.is_available():
        index = torch.cuda.current_device() if device is None else (torch.device(device).index or 0)
    else:
        index = -1
    with _default_lock:
        pool = _default_pools.get(index)
        if pool is None:
            pool = HostPool(device=None if index < 0 else torch.device("cuda", index))
            _default_pools[index] = pool
        return pool


def empty(shape, dtype=torch.float32, *, pool=None, stream=None):
    """An uninitialized pinned CPU tensor from `pool` (default_pool())."""
    return (pool or default_pool()).empty(shape, dtype, stream=stream)


def empty_like(tensor, *, pool=None, stream=None):
    return (pool or default_pool()).empty_like(tensor, stream=stream)


def pin(tensor, *, pool=None, stream=None):
    """A pinned pool copy of a CPU tensor."""
    return (pool or default_pool()).pin(tensor, stream=stream)


def record_stream(tensor, stream, *, pool=None):
    (pool or default_pool()).record_stream(tensor, stream)


def stats(pool=None):
    """The default pool's counters (see HostPool.stats)."""
    return (pool or default_pool()).stats()


def reset_peak_stats(pool=None):
    (pool or default_pool()).reset_peak_stats()


def empty_cache(pool=None):
    return (pool or default_pool()).empty_cache()


def set_limit(limit_bytes, pool=None):
    (pool or default_pool()).set_limit(limit_bytes)


def install_torch_host_allocator(pool=None):
    """Makes `pool` (default_pool()) torch's pinned allocator for CUDA, through
    the hook torch has had since 2.8 (at::setHostAllocator): then
    torch.empty(..., pin_memory=True), tensor.pin_memory() and
    DataLoader(pin_memory=True) all take pool memory, and torch's copy kernels
    record their streams on the pool's blocks (no record_stream needed).

    Call it before anything is pinned (right after import torch): torch's copy
    kernels report to one allocator, so blocks pinned before the swap would
    lose stream safety (csrc/bindings/host_torch_bindings_cuda.cpp, Note [Host
    allocator swap]). It lasts for the life of the process."""
    if not hasattr(_core, "host_install_torch_allocator"):
        raise RuntimeError("torchmem.host: this torchmem build has no CUDA; there is no pinned allocator to replace")
    pool = pool or default_pool()
    if pool.backend != "cuda":
        raise ValueError("torchmem.host: only a pool with backend='cuda' can be torch's pinned allocator")
    if not _core.host_torch_allocator_installed():
        pinned_before = torch.cuda.host_memory_stats().get("num_host_alloc", 0)
        if pinned_before:
            raise RuntimeError(
                f"torchmem.host: torch already pinned memory {pinned_before} time(s) with its own allocator; "
                "call install_torch_host_allocator() before anything is pinned (right after import torch), "
                "or pin through torchmem.host.pin()/empty() instead")
    _core.host_install_torch_allocator(pool._pool)
    pool._routed = True


# ------------------------------------------------------------------ loaders
def pin_batch(batch, pool=None):
    """`batch` with every CPU tensor replaced by a pinned pool copy (dicts,
    lists, tuples and namedtuples are walked; other values are kept)."""
    pool = pool or default_pool()
    return _pin_batch_on(batch, pool, None)


_DONE = object()


def pinned(loader, *, pool=None, prefetch=2):
    """Iterates `loader` (a DataLoader built with pin_memory=False, or any
    iterable of batches) and yields each batch pinned in the pool.

    Pinning runs on a background thread `prefetch` batches ahead, as torch's
    pin_memory thread does, but copies into cached pool blocks instead of
    pinning fresh memory for every batch. DataLoader workers are separate
    processes, so pinning cannot happen in a collate_fn; it happens here, in
    the training process. A batch's blocks return to the pool when the batch is
    dropped, and are reused only after copies queued on the stream current at
    pinning time finished: copy with .to(device, non_blocking=True) on the
    current stream, or call record_stream() for another stream.
    """
    pool = pool or default_pool()
    if prefetch < 1:
        raise ValueError(f"torchmem.host.pinned: prefetch must be >= 1, got {prefetch!r}")
    slots = queue.Queue(maxsize=prefetch)
    stop = threading.Event()
    stream = pool._stream_id(None)  # the consumer's current stream, not the thread's

    def work():
        try:
            for batch in loader:
                if stop.is_set():
                    return
                item = _pin_batch_on(batch, pool, stream)
                while not stop.is_set():
                    try:
                        slots.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            slots.put(exc)
            return
        slots.put(_DONE)

    thread = threading.Thread(target=work, name="torchmem-host-pin", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        stop.set()


def _pin_batch_on(batch, pool, stream):
    if isinstance(batch, torch.Tensor):
        return pool.pin(batch, stream=stream) if batch.device.type == "cpu" else batch
    if isinstance(batch, collections.abc.Mapping):
        return {k: _pin_batch_on(v, pool, stream) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_pin_batch_on(v, pool, stream) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_pin_batch_on(v, pool, stream) for v in batch)
    return batch
