"""Prometheus metrics from torchmem's records (prometheus-client).

Names follow Prometheus' conventions: the `torchmem_` prefix, base units with a
unit suffix (`_bytes`), counters ending in `_total`, ratios in 0..1; labels are
`device` (the CUDA ordinal as the process sees it), `pid`, and the process's
`rank` and `job` from its record ("" where unknown: Prometheus reads an empty
label as an absent one). The collector
reads records when scraped, so a scrape costs nothing between scrapes and the
figures are the publisher's latest (at most one interval old).

`serve_metrics(port)` serves this process's figures; `all_processes=True`
serves every live record of this user on the node. `python -m torchmem
exporter` (monitor/exporter.py) is the node's endpoint for a cluster.
"""

import logging
import warnings

__all__ = ["GAUGES", "COUNTERS", "LABELS", "families", "process_labels", "serve_metrics", "flat_figures"]

_log = logging.getLogger("torchmem.monitor")

# metric name -> (DeviceFigures field, help)
GAUGES = {
    "torchmem_live_bytes": ("live_bytes", "Bytes held by live tensors."),
    "torchmem_reserved_bytes": ("reserved_bytes", "Bytes the allocator holds from the device."),
    "torchmem_cached_bytes": ("cached_bytes", "Reserved bytes not in use by any tensor (cache)."),
    "torchmem_largest_free_block_bytes": ("largest_free_bytes", "Largest cached free block."),
    "torchmem_limit_bytes": ("limit_bytes", "The pool's budget (0 = the whole device)."),
    "torchmem_peak_live_bytes": ("peak_live_bytes", "Peak live bytes over the recent window."),
    "torchmem_fragmentation_ratio": ("fragmentation", "1 - largest free block / cached bytes (0..1)."),
    "torchmem_micro_batch": ("micro_batch", "The batch controller's micro-batch (-1 = no controller)."),
    "torchmem_guarantee_bytes": ("guarantee_bytes", "Guaranteed share when sharing the GPU (0 = not sharing)."),
    "torchmem_granted_bytes": ("granted_bytes", "Limit the sharing arbiter granted (0 = not sharing)."),
    "torchmem_waiting_bytes": ("need_bytes", "Bytes an allocation waits for from borrowers (0 = none)."),
}
COUNTERS = {
    "torchmem_ooms": ("ooms", "Allocations that failed with out-of-memory."),
    "torchmem_reclaims": ("reclaims", "Granules moved (stitched) to serve a request."),
    "torchmem_device_barriers": ("barriers", "Waits for the whole device (every stream) the allocator took."),
    "torchmem_driver_calls": ("driver_calls", "Backend (driver) calls made by the pool."),
    "torchmem_alloc_retries": ("alloc_retries", "Allocations retried after releasing the cache."),
}


LABELS = ("device", "pid", "rank", "job")


def process_labels(rec, default_job=""):
    """[pid, rank, job] label values of a record; `default_job` names the job of a record that
    names none."""
    return [str(rec.pid), str(rec.rank) if rec.rank >= 0 else "", rec.job or default_job]


def families(records, default_job=""):
    """prometheus_client metric families for `records` (torchmem.monitor.record.Record)."""
    # prometheus_client is optional (the metrics extra)
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    out = []
    rows = [([str(dev.index)] + process_labels(rec, default_job), dev) for rec in records for dev in rec.devices]
    for kind, table in ((GaugeMetricFamily, GAUGES), (CounterMetricFamily, COUNTERS)):
        for name, (field, doc) in table.items():
            family = kind(name, doc, labels=LABELS)
            for labels, dev in rows:
                family.add_metric(labels, float(getattr(dev, field)))
            out.append(family)
    for name, field, doc in (("torchmem_host_reserved_bytes", "host_reserved_bytes", "Pinned host bytes cached."),
                             ("torchmem_host_active_bytes", "host_active_bytes", "Pinned host bytes in use.")):
        family = GaugeMetricFamily(name, doc, labels=LABELS[1:])
        for rec in records:
            family.add_metric(process_labels(rec, default_job), float(getattr(rec, field)))
        out.append(family)
    return out


class _Collector:
    def __init__(self, records_fn):
        self.records_fn = records_fn

    def collect(self):
        try:
            records = self.records_fn()
        except Exception as exc:  # a scrape must answer; an empty one says "no figures now"
            _log.warning("torchmem metrics: reading figures failed: %r", exc)
            records = []
        yield from families(records)


def serve_metrics(port, records_fn, addr="127.0.0.1"):
    """Serves /metrics on addr:port; returns the server, or None (with a warning naming the port)
    when the port cannot be bound: training goes on without metrics."""
    if not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535:
        raise ValueError(f"torchmem.serve_metrics: port must be an int in [0, 65535], got {port!r}")
    try:  # prometheus_client is optional (the metrics extra)
        from prometheus_client import CollectorRegistry, start_http_server
    except ImportError:
        raise ImportError("torchmem.serve_metrics needs prometheus-client: pip install prometheus-client") from None
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Collector(records_fn))
    try:
        served = start_http_server(port, addr=addr, registry=registry)
    except OSError as exc:
        message = (f"torchmem metrics: cannot serve on {addr}:{port} ({exc.strerror or exc}); is another "
                   f"process using the port? Pick another metrics_port. Training goes on without metrics.")
        _log.warning(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)
        return None
    server = served[0] if isinstance(served, tuple) else served
    return server


def flat_figures(rec, device=None):
    """{name: number} of one device of a record (the first when device is None), with the
    metric names less their `torchmem_` prefix: the dict the Lightning and HF callbacks log."""
    if rec is None or not rec.devices:
        return {}
    devs = [d for d in rec.devices if device is None or d.index == device]
    if not devs:
        return {}
    dev = devs[0]
    out = {name[len("torchmem_"):]: float(getattr(dev, field)) for name, (field, _) in GAUGES.items()}
    out.update({name[len("torchmem_"):] + "_total": float(getattr(dev, field)) for name, (field, _) in COUNTERS.items()})
    out["host_reserved_bytes"] = float(rec.host_reserved_bytes)
    return out
