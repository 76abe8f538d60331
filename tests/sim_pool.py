"""Simulated pools for the Python-surface tests (stats, snapshots, leaks, hooks, patch).

The pool is torchmem's real core (_C.Pool) over the simulated backend, so these
tests read the same counters and snapshots the installed allocator gives on a GPU.
"""

MiB = 1 << 20


def make_pool(limit=0, trace_capacity=10_000, capacity=8 << 30, vmm=True, event_delay=0, **config):
    """A _C.Pool over a SimBackend (event_delay: polls a stream event stays pending)."""
    from torchmem._loader import _C

    backend = _C.SimBackend(capacity=capacity, granularity=2 * MiB, vmm=vmm, event_delay=event_delay)
    config = dict(config, limit_bytes=limit, trace_capacity=trace_capacity)
    return _C.Pool(backend, config)
