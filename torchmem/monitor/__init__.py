"""Watching: per-process figure records, `top`, Prometheus.

    torchmem.install()                    # publishes by default (monitor=true)
    torchmem.serve_metrics(9400)          # or TORCHMEM_CONF=metrics_port=9400
    python -m torchmem top                # from another shell

Layers: record.py (the shared-memory record: layout, seqlock, dead-process
cleanup), sources.py (where a process reads its own figures), publisher.py
(the background thread), metrics.py (Prometheus), exporter.py (one endpoint
for every process on the node: `python -m torchmem exporter`).
docs/monitoring.md is the guide.

The monitor only publishes. GPU sharing (torchmem/share/, docs/sharing.md)
reads the records it publishes and moves the limits; it rides on the
publisher's thread as its `agent` (publisher.py), which the monitor runs each
tick without knowing what it does.
"""

import os
import threading

from torchmem._loader import is_installed
from torchmem.monitor import metrics, record
from torchmem.monitor.publisher import Publisher, identity_now
from torchmem.monitor.record import Record
from torchmem.monitor.sources import RuntimeSource, process_identity
from torchmem.runtime import budget

__all__ = ["start", "stop", "publisher", "serve_metrics", "figures"]

_lock = threading.Lock()
_state = {"publisher": None}


def publisher():
    """The running Publisher of this process, or None."""
    return _state["publisher"]


def start(source=None, interval=0.5, directory=None, job=None, group="", agent=None):
    """Starts publishing this process's figures; returns the Publisher, or None when the record
    cannot be created (a warning says why). `source` defaults to the installed allocator
    (monitor/sources.py). The record names the process's rank and job (the exporter's labels):
    `job`, else the launcher's environment (monitor/sources.py process_identity). `group` and
    `agent` are GPU sharing's (torchmem/share/): the group written in the record, and the object
    the publisher runs each tick. Once per process: a second call returns the running one."""
    with _lock:
        if _state["publisher"] is not None:
            return _state["publisher"]
        source = RuntimeSource() if source is None else source
        pub = Publisher(source, interval=interval, directory=directory, group=group or "", agent=agent, job=job)
        if not pub.start():
            return None
        _state["publisher"] = pub
    return pub


def stop():
    """Stops publishing and removes this process's record."""
    with _lock:
        pub, _state["publisher"] = _state["publisher"], None
    if pub is not None:
        pub.stop()


def _own_records():
    pub = _state["publisher"]
    if pub is not None and pub.latest is not None:
        return [pub.latest]
    if not is_installed():
        return []
    source = RuntimeSource()
    rows = source.rows()
    for row in rows:
        row.micro_batch = budget.micro_batch()[0]
    return [Record(pid=os.getpid(), start_ticks=0, devices=rows, **identity_now(process_identity()))]


def serve_metrics(port, addr="127.0.0.1", all_processes=False):
    """Serves Prometheus metrics on http://addr:port/metrics: this process's figures, or every
    torchmem process of this user on the node with all_processes=True. Returns the server, or
    None with a warning when the port is taken (training goes on)."""
    records_fn = (lambda: record.scan(clean=False)) if all_processes else _own_records
    return metrics.serve_metrics(port, records_fn, addr=addr)


def figures(device=None):
    """This process's latest figures for one device as {name: number} (the callbacks log them);
    empty when torchmem is not installed and nothing publishes."""
    records = _own_records()
    return metrics.flat_figures(records[0] if records else None, device)
