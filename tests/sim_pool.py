"""Simulated pools for the Python-surface tests (stats, snapshots, leaks, hooks, patch).

The pool is torchmem's real core (_C.Pool) over the simulated backend, so these
tests read the same counters and snapshots the installed allocator gives on a GPU.
"""

MiB = 1 << 20

# A pool that stitches in the top 5% of its limit and fills fits by size: torchmem under a limit
# before stitch_above_limit=1 and backed_fit became the defaults. The tests of stitching and of
# the step plan run it, since the defaults keep their steps quiet without either (Note [When to
# stitch]); STITCHING_CONF is the same as --config / TORCHMEM_CONF text.
STITCHING = {"stitch_above_limit": 0.95, "backed_fit": False}
STITCHING_CONF = ",".join(f"{key}={str(value).lower()}" for key, value in STITCHING.items())


def make_pool(limit=0, trace_capacity=10_000, capacity=8 << 30, vmm=True, event_delay=0, **config):
    """A _C.Pool over a SimBackend (event_delay: polls a stream event stays pending)."""
    from torchmem._loader import _C

    backend = _C.SimBackend(capacity=capacity, granularity=2 * MiB, vmm=vmm, event_delay=event_delay)
    config = dict(config, limit_bytes=limit, trace_capacity=trace_capacity)
    return _C.Pool(backend, config)
