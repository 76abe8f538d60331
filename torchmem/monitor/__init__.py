"""Watching and sharing: per-process figure records, `top`, Prometheus, elastic GPU budgets.

    torchmem.install()                    # publishes by default (monitor=true)
    torchmem.serve_metrics(9400)          # or TORCHMEM_CONF=metrics_port=9400
    python -m torchmem top                # from another shell

Layers: record.py (the shared-memory record: layout, seqlock, dead-process
cleanup), sources.py (where a process reads its own figures), publisher.py
(the background thread), arbiter.py (the sharing rule, a pure function),
share.py (the sharing I/O: lock, group file, limits, OOM-hook waits),
metrics.py (Prometheus), exporter.py (one endpoint for every process on the
node: `python -m torchmem exporter`). docs/monitoring.md and docs/sharing.md
are the guides.
"""

import threading

from torchmem.monitor.publisher import Publisher, current_micro_batch
from torchmem.monitor.publisher import report_micro_batch as _set_micro_batch

__all__ = ["start", "stop", "publisher", "start_from_config", "report_micro_batch", "serve_metrics",
           "figures"]

_lock = threading.Lock()
_state = {"publisher": None, "hook": None}


def publisher():
    """The running Publisher of this process, or None."""
    return _state["publisher"]


def start(source=None, interval=0.5, group=None, guarantee=None, wait_s=30.0, directory=None, job=None):
    """Starts publishing this process's figures (and sharing its GPU when `group` is given);
    returns the Publisher, or None when the record cannot be created (a warning says why).
    `source` defaults to the installed allocator (monitor/sources.py). The record names the
    process's rank and job (the exporter's labels): `job`, else the launcher's environment
    (monitor/sources.py process_identity)."""
    from torchmem.monitor import share
    from torchmem.monitor.sources import RuntimeSource

    with _lock:
        if _state["publisher"] is not None:
            return _state["publisher"]
        runtime = source is None
        source = RuntimeSource() if runtime else source
        agent = None
        if group:
            agent = share.ShareAgent(source, group, guarantee, directory=directory, wait_s=wait_s)
        pub = Publisher(source, interval=interval, directory=directory, group=group or "", agent=agent, job=job)
        if not pub.start():
            return None
        _state["publisher"] = pub
    if agent is not None and runtime:  # Note [Owners wait, borrowers yield] in monitor/share.py
        from torchmem import hooks

        _state["hook"] = hooks.on_oom(agent.oom_hook(publish=pub.tick))
    return pub


def stop():
    """Stops publishing and removes this process's record."""
    with _lock:
        pub, _state["publisher"] = _state["publisher"], None
        hook, _state["hook"] = _state["hook"], None
    if hook is not None:
        hook.remove()
    if pub is not None:
        pub.stop()


def start_from_config(cfg):
    """What torchmem.install() starts: the publisher (monitor=true), sharing (share=GROUP) and
    the metrics server (metrics_port=N)."""
    pub = None
    if cfg.monitor or cfg.share:
        try:
            pub = start(interval=cfg.monitor_interval, group=cfg.share, guarantee=cfg.guarantee,
                        wait_s=cfg.share_wait, job=getattr(cfg, "job", None))
        except Exception as exc:  # the allocator is installed already: watching must not stop the job
            import warnings

            warnings.warn(f"torchmem monitor: could not start publishing ({exc!r}); training goes on without "
                          f"`top`, metrics{' or sharing' if cfg.share else ''}", RuntimeWarning, stacklevel=3)
    if cfg.metrics_port:
        serve_metrics(cfg.metrics_port)
    return pub


def report_micro_batch(size, batch=None):
    """Called by the BatchSizeController when it picks a micro-batch for a batch of `batch`
    samples: `top` and the metrics show it, the sharing arbiter sees whether more memory would
    be used (size < batch), and a sharing process over its granted limit gives memory back now
    (a step boundary)."""
    _set_micro_batch(size, batch)
    pub = _state["publisher"]
    if pub is not None and pub.agent is not None:
        pub.agent.give_back_now()


def share_guarantee_bytes(device=None):
    """This process's guaranteed share of `device` (an index; None: the current device) in bytes
    while it shares its GPU (share=GROUP), else None (docs/sharing.md)."""
    pub = _state["publisher"]
    if pub is None or pub.agent is None or pub.latest is None:
        return None
    if device is None:
        import torch

        device = torch.cuda.current_device()
    for row in pub.latest.devices:
        if row.index == device and row.guarantee_bytes:
            return int(row.guarantee_bytes)
    return None


def _own_records():
    pub = _state["publisher"]
    if pub is not None and pub.latest is not None:
        return [pub.latest]
    from torchmem._loader import is_installed

    if not is_installed():
        return []
    import os

    from torchmem.monitor.publisher import identity_now
    from torchmem.monitor.record import Record
    from torchmem.monitor.sources import RuntimeSource, process_identity

    source = RuntimeSource()
    rows = source.rows()
    for row in rows:
        row.micro_batch = current_micro_batch()
    return [Record(pid=os.getpid(), start_ticks=0, devices=rows, **identity_now(process_identity()))]


def serve_metrics(port, addr="127.0.0.1", all_processes=False):
    """Serves Prometheus metrics on http://addr:port/metrics: this process's figures, or every
    torchmem process of this user on the node with all_processes=True. Returns the server, or
    None with a warning when the port is taken (training goes on)."""
    from torchmem.monitor import metrics, record

    records_fn = (lambda: record.scan(clean=False)) if all_processes else _own_records
    return metrics.serve_metrics(port, records_fn, addr=addr)


def figures(device=None):
    """This process's latest figures for one device as {name: number} (the callbacks log them);
    empty when torchmem is not installed and nothing publishes."""
    from torchmem.monitor import metrics

    records = _own_records()
    return metrics.flat_figures(records[0] if records else None, device)
