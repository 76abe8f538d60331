"""The levers GPU sharing pulls on this process's allocator: set its limit, give cached memory back.

The monitor's sources (monitor/sources.py) only read figures; sharing needs
two actions on top of them, and they live here so that the monitor never
changes a limit. A lever object is a source plus:

- set_limit(index, bytes): the pool's budget on device `index` (the arbiter's grant);
- release_to(index, keep_bytes): give cached memory back down to `keep_bytes`
  (never the whole cache: Note [Release slack] in share/agent.py); returns the
  bytes released.

RuntimeLevers acts on the installed allocator through the gate to the compiled
module (torchmem/_loader.py); PoolLevers on a simulated pool (demos, tests).
Tests of the agent pass fakes with the same four methods (tests/monitor_fakes.py).
"""

from torchmem.monitor.sources import PoolSource, RuntimeSource

__all__ = ["RuntimeLevers", "PoolLevers"]


class RuntimeLevers(RuntimeSource):
    """The installed allocator of this process: its figures and its levers."""

    def set_limit(self, index, limit):
        self._core.runtime_set_limit(index, int(limit))

    def empty_cache(self):
        return int(self._core.runtime_empty_cache())

    def release_to(self, index, keep_bytes):
        return int(self._core.runtime_release_cached_to(index, int(keep_bytes)))


class PoolLevers(PoolSource):
    """One simulated torchmem._C.Pool: its figures and its levers."""

    def set_limit(self, index, limit):
        self.pool.set_limit(int(limit))

    def empty_cache(self):
        return int(self.pool.release_cached())

    def release_to(self, index, keep_bytes):
        return int(self.pool.release_cached_to(int(keep_bytes)))
