"""What the driver and torchmem's allocation path cost on this GPU, measured in place.

torchmem's choices between handles per granule and handles per run, and the
replay's simulated costs (csrc/backend/sim_backend.h), rest on what a CUDA
virtual-memory call costs on the machine at hand. These two functions measure
it on fresh memory of one device, in C++ (the timing loop must not include
Python), and hand back plain numbers: for checking a new machine or driver, and
for bench/gpu_probe.py and bench/empty_cache_fuzz.py.

Both need a CUDA build of torchmem and a GPU, and neither needs torchmem
installed as the allocator. driver_costs works on fresh backends outside every
pool. allocation_pair_ns churns blocks through the device's torchmem pool: the
installed allocator's when torchmem is installed (its counters then include
the pairs; every block is freed before it returns).
"""

from torchmem._loader import extension
from torchmem.runtime.stats import device_index


def driver_costs(device=None, repeats=20, granules=1, live_granules=0, evict_bytes=0):
    """Mean microseconds of each virtual-memory primitive (reserve, create, map, set access, unmap,
    release, ...) on `device`, `repeats` times over, mapping `granules` 2 MiB granules per call.
    Keys ending in `_per_call` are per call; divide by `granules` for a granule's share.

    The conditions of a call inside a training process (Note [Probe conditions],
    csrc/shim/diagnostics.cpp): `live_granules` granules, a handle each, stay mapped while it
    times, and `evict_bytes` of host memory are walked before each timed call (outside its time),
    as framework work between two calls evicts the driver's code and data from the host's caches."""
    if repeats < 1 or granules < 1:
        raise ValueError(f"driver_costs: repeats ({repeats}) and granules ({granules}) must be at least 1")
    if live_granules < 0 or evict_bytes < 0:
        raise ValueError(f"driver_costs: live_granules ({live_granules}) and evict_bytes ({evict_bytes}) "
                         "must be 0 or more")
    return dict(extension().runtime_probe_backend(device_index(device), int(repeats), int(granules),
                                                  int(live_granules), int(evict_bytes)))


def allocation_pair_ns(device=None, iterations=200_000):
    """Nanoseconds per free + allocate pair through torchmem's own allocation path on `device`
    (a cached block served again: the hot path, without torch's wrapper around it)."""
    if iterations < 1:
        raise ValueError(f"allocation_pair_ns: iterations ({iterations}) must be at least 1")
    return float(extension().runtime_probe_pool_pair(device_index(device), int(iterations)))
