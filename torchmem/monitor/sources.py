"""Where a publishing process reads its own figures: the installed allocator, or a
simulated pool.

A source has four methods: `rows()` (a list of DeviceFigures, one per device
with a pool), `host()` (pinned host bytes: reserved, active), `set_limit(index,
bytes)`, `empty_cache()` and `release_to(index, keep_bytes)`; the last three are
the sharing agent's levers.
`RuntimeSource` reads torchmem._C's runtime stats, the same counters
torchmem.memory_stats() reports, never the allocation path: one stats call per
device per tick takes the pool's mutex for a copy of its counters. Tests give
the publisher a `PoolSource` over a simulated _C.Pool, or a fake of their own.
"""

import os
import sys
import uuid as _uuid

from torchmem.monitor.record import DeviceFigures

__all__ = ["figures_from_raw", "RuntimeSource", "PoolSource", "process_command"]


def _driver_calls(raw):
    backend = raw.get("backend") or {}
    return sum(int(v) for k, v in backend.items() if k.endswith("_calls") and isinstance(v, int))


def figures_from_raw(raw, index, uuid=b""):
    """DeviceFigures from a core stats dict (the shape of _C.Pool.stats() / _C.runtime_stats)."""
    live = int(raw["allocated_bytes"]["all"]["current"])
    reserved = int(raw["reserved_bytes"]["all"]["current"])
    cached = max(0, reserved - int(raw["active_bytes"]["all"]["current"]))
    largest = int(raw.get("largest_free_block", 0))
    return DeviceFigures(
        index=index, uuid=bytes(uuid)[:16].ljust(16, b"\0"),
        live_bytes=live, reserved_bytes=reserved, cached_bytes=cached, largest_free_bytes=largest,
        limit_bytes=int(raw.get("limit_bytes", 0)),
        peak_live_bytes=int(raw["allocated_bytes"]["all"]["peak"]),
        peak_reserved_bytes=int(raw["reserved_bytes"]["all"]["peak"]),
        ooms=int(raw.get("num_ooms", 0)), reclaims=int(raw.get("num_reclaims", 0)),
        driver_calls=_driver_calls(raw), alloc_retries=int(raw.get("num_alloc_retries", 0)),
        device_total_bytes=int(raw.get("device_total", 0)), device_free_bytes=int(raw.get("device_free", 0)),
        fragmentation=(1.0 - largest / cached) if cached else 0.0,
    )


def process_command():
    """A short name for `top`: the script or module the process runs."""
    argv = [a for a in sys.argv if a]
    if not argv or argv[0] == "-":
        return os.path.basename(sys.executable)
    if argv[0] == "-c":
        return os.path.basename(sys.executable) + " -c"
    return os.path.basename(argv[0])


class RuntimeSource:
    """The installed allocator of this process (torchmem.install())."""

    def __init__(self):
        from torchmem._loader import _C

        self._C = _C
        self._uuids = {}

    def _uuid(self, index):
        if index not in self._uuids:
            import torch

            text = str(getattr(torch.cuda.get_device_properties(index), "uuid", "") or "")
            try:
                self._uuids[index] = _uuid.UUID(text.replace("GPU-", "")).bytes
            except ValueError:
                self._uuids[index] = index.to_bytes(16, "little")  # no uuid: the ordinal names the device
        return self._uuids[index]

    def rows(self):
        return [figures_from_raw(self._C.runtime_stats(d), d, self._uuid(d)) for d in self._C.runtime_devices()]

    def host(self):
        import torch

        # host_memory_stats reads torch's host allocator counters: no CUDA call.
        if not (torch.cuda.is_initialized() and hasattr(torch.cuda, "host_memory_stats")):
            return 0, 0
        stats = torch.cuda.host_memory_stats()
        return int(stats.get("allocated_bytes.current", 0)), int(stats.get("active_bytes.current", 0))

    def device_free(self, index):
        # Through the runtime, whose CUDA calls run in relaxed capture mode: from
        # this background thread, torch.cuda.mem_get_info would invalidate a CUDA
        # graph another thread is capturing in global mode.
        return int(self._C.runtime_stats(index)["device_free"])

    def set_limit(self, index, limit):
        self._C.runtime_set_limit(index, int(limit))

    def empty_cache(self):
        return int(self._C.runtime_empty_cache())

    def release_to(self, index, keep_bytes):
        return int(self._C.runtime_release_cached_to(index, int(keep_bytes)))


class PoolSource:
    """One simulated torchmem._C.Pool as device `index` (tests, demos without a GPU).
    Its device is the pool's backend capacity, `capacity` bytes."""

    def __init__(self, pool, capacity, index=0, uuid=b"sim-device"):
        self.pool, self.capacity, self.index, self.uuid = pool, capacity, index, uuid

    def rows(self):
        raw = dict(self.pool.stats())
        reserved = raw["reserved_bytes"]["all"]["current"]
        raw.setdefault("device_total", self.capacity)
        raw.setdefault("device_free", self.capacity - reserved)
        return [figures_from_raw(raw, self.index, self.uuid)]

    def host(self):
        return 0, 0

    def device_free(self, index):
        return self.rows()[0].device_free_bytes

    def set_limit(self, index, limit):
        self.pool.set_limit(int(limit))

    def empty_cache(self):
        return int(self.pool.release_cached())

    def release_to(self, index, keep_bytes):
        return int(self.pool.release_cached_to(int(keep_bytes)))
