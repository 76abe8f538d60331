"""Fake tenants of one simulated GPU for the monitor and sharing tests (no GPU, no torch CUDA).

A FakeDevice is a capacity and a shared array of each tenant's reserved bytes
(multiprocessing shared memory, so tenants in different processes see one
device). A FakeTenant is the part of a process's allocator the sharing agent
touches: live/reserved/limit figures, set_limit, empty_cache, and an allocate
that, when the device is full, runs an OOM hook and retries, as torchmem's
installed allocator does (torchmem/runtime/hooks.py).
"""

import threading

from torchmem.monitor.record import DeviceFigures

MiB = 1 << 20
UUID = b"fake-gpu-0000000"


class FakeOOM(RuntimeError):
    def __init__(self, kind, message):
        super().__init__(message)
        self.kind = kind  # "limit": the process's own budget; "device": the card is full


class FakeDevice:
    def __init__(self, ctx, capacity, slots):
        self.capacity = capacity
        self.reserved = ctx.Array("q", slots)  # its lock orders growth between processes

    def used(self):
        return sum(self.reserved[:])


class FakeTenant:
    """Source for the publisher (rows/host/device_free/set_limit/empty_cache/release_to) plus allocate/free."""

    def __init__(self, device, slot):
        self.device, self.slot = device, slot
        self.live = self.reserved = self.limit = self.peak = 0
        self.ooms = 0
        self.hook = None
        self._lock = threading.Lock()

    def rows(self):
        with self._lock:
            cached = self.reserved - self.live
            return [DeviceFigures(index=0, uuid=UUID, live_bytes=self.live, reserved_bytes=self.reserved,
                                  cached_bytes=cached, largest_free_bytes=cached, limit_bytes=self.limit,
                                  peak_live_bytes=self.peak, ooms=self.ooms,
                                  device_total_bytes=self.device.capacity,
                                  device_free_bytes=self.device.capacity - self.device.used())]

    def host(self):
        return 0, 0

    def device_free(self, index):
        return self.device.capacity - self.device.used()

    def set_limit(self, index, limit):
        with self._lock:
            self.limit = limit

    def empty_cache(self):
        with self._lock, self.device.reserved.get_lock():
            released = self.reserved - self.live
            self.reserved = self.live
            self.device.reserved[self.slot] = self.reserved
            return released

    def release_to(self, index, keep_bytes):
        with self._lock, self.device.reserved.get_lock():
            target = max(self.live, min(self.reserved, keep_bytes))
            released = self.reserved - target
            self.reserved = target
            self.device.reserved[self.slot] = self.reserved
            return released

    def _try(self, size):
        with self._lock:
            if self.live + size <= self.reserved:
                self.live += size
            else:
                grow = self.live + size - self.reserved
                if self.limit and self.reserved + grow > self.limit:
                    self.ooms += 1
                    raise FakeOOM("limit", f"over the limit {self.limit}")
                with self.device.reserved.get_lock():
                    if self.device.used() + grow > self.device.capacity:
                        return False
                    self.reserved += grow
                    self.device.reserved[self.slot] = self.reserved
                self.live += size
            self.peak = max(self.peak, self.live)
            return True

    def allocate(self, size, retries=3):
        """Allocates `size` bytes; on a full device runs the OOM hook (at most `retries` times)."""
        for _ in range(retries + 1):
            if self._try(size):
                return
            if self.hook is None or not self.hook(0, size, {"allocated_bytes.all.current": self.live}):
                break
        with self._lock:
            self.ooms += 1
        raise FakeOOM("device", f"device full: {size} bytes")

    def free(self, size):
        with self._lock:
            self.live -= size

    def reset_peak(self):
        with self._lock:
            self.peak = self.live
