"""The node exporter: one Prometheus endpoint for every torchmem process on a node.

A cluster scrapes one endpoint per node, not one per process: ports per
process collide between jobs, and the scrape config cannot know them. So
`python -m torchmem exporter --port N` (torchmem/cli/exporter.py) runs once
per node and serves the records every torchmem process already publishes
(monitor/record.py), read at each scrape: a scrape costs a few file reads, and
nothing runs between scrapes. Every series carries the labels `device`, `pid`,
`rank` and `job` (monitor/metrics.py); rank and job are written into the record
by the publishing process, from its launcher's environment (monitor/sources.py
process_identity), because the exporter, another process, cannot see it.

Besides the per-device figures of metrics.py it serves
`torchmem_process_info` (one series per process: local rank, world size,
command, sharing group), `torchmem_record_age_seconds` (a publisher that stopped
writing) and `torchmem_exporter_records{state}` (what the last scan found).

Note [The exporter never removes records]
Liveness is judged by pid and start time in the reader's PID namespace (Note
[Dead records] in monitor/record.py). An exporter in a container that does not
share the trainers' PID namespace sees every trainer as dead; if it removed
dead records as `top` does, it would delete the live ones, and they would stay
unreadable until their processes exit. So it only skips them. A record that
looks dead but is still being rewritten belongs to a process the exporter
cannot see: it is counted as `invisible`, and a warning (once) names the fix.
Publishers remove dead records when they start, `top` when it reads.
"""

import glob
import logging
import os
import time
import warnings

from torchmem.monitor import metrics, record

__all__ = ["NodeCollector", "exposition", "serve"]

_log = logging.getLogger("torchmem.monitor")

STATES = ("live", "dead", "invisible", "unreadable")


def record_directories(directories=None, all_users=False):
    """The directories to scan: the given ones, else this user's default; with `all_users`, every
    user's directory beside the default one, /dev/shm/torchmem/<uid> (readable by root)."""
    dirs = list(directories or [record.default_dir()])
    if all_users and not os.environ.get("TORCHMEM_MONITOR_DIR"):
        parent = os.path.dirname(record.default_dir())
        dirs += sorted(d for d in glob.glob(os.path.join(parent, "*"))
                       if os.path.basename(d).isdigit() and os.path.isdir(d))
    seen, out = set(), []
    for d in dirs:
        key = os.path.realpath(d)
        if key not in seen:
            seen.add(key)
            out.append(d)
    return out


class NodeCollector:
    """A prometheus_client collector of every live record in `directories` (Note [The exporter
    never removes records]). `job` labels the processes whose record names no job."""

    def __init__(self, directories=None, job="", all_users=False):
        self.directories = record_directories(directories, all_users)
        self.job = job or ""
        self.counts = dict.fromkeys(STATES, 0)
        self._dead_seen = {}  # path -> (pid, updated_ns) of a record that looked dead at the last scan
        self._warned = set()

    def scan(self):
        """The live records, sorted by pid; sets `counts`."""
        counts = dict.fromkeys(STATES, 0)
        dead_now = {}

        def on_error(path, error):
            counts["unreadable"] += 1
            self._warn_once(path, f"torchmem exporter: skipping {path}: {error}")

        def on_dead(path, rec):
            dead_now[path] = (rec.pid, rec.updated_ns)
            if path in self._dead_seen and self._dead_seen[path][0] == rec.pid \
                    and self._dead_seen[path][1] != rec.updated_ns:
                counts["invisible"] += 1  # rewritten since the last scan: its writer runs
                self._warn_invisible(path, rec)
            else:
                counts["dead"] += 1

        by_pid = {}
        for directory in self.directories:
            try:
                found = record.scan(directory, clean=False, on_error=on_error, on_dead=on_dead)
            except OSError as exc:  # a directory of another user: the uid or root decides
                counts["unreadable"] += 1
                self._warn_once(directory, f"torchmem exporter: cannot read {directory} ({exc.strerror}); run the "
                                           f"exporter as the training processes' user, or as root with --all-users")
                continue
            for rec in found:
                by_pid.setdefault(rec.pid, rec)
        self._dead_seen = dead_now
        counts["live"] = len(by_pid)
        self.counts = counts
        return [by_pid[pid] for pid in sorted(by_pid)]

    def _warn_once(self, key, message, warn=False):
        if key in self._warned:
            return
        self._warned.add(key)
        _log.warning(message)
        if warn:
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _warn_invisible(self, path, rec):
        self._warn_once("invisible", f"torchmem exporter: {path} is still being written by pid {rec.pid}, which "
                                     f"this exporter cannot see: it runs in another PID namespace. Run the exporter "
                                     f"in the training processes' PID namespace (Kubernetes: shareProcessNamespace: "
                                     f"true in the pod; Docker: --pid=container:<trainer> or --pid=host); until then "
                                     f"their figures are not exported", warn=True)

    def describe(self):
        return []  # families vary with the processes: the registry must not describe them once

    def collect(self):
        # prometheus_client is optional (the metrics extra)
        from prometheus_client.core import GaugeMetricFamily, InfoMetricFamily

        try:
            records = self.scan()
        except Exception as exc:  # a scrape must answer; the records state says what went wrong
            _log.warning("torchmem exporter: reading records failed: %r", exc)
            records = []
        yield from metrics.families(records, self.job)
        labels = list(metrics.LABELS[1:])
        info = InfoMetricFamily("torchmem_process", "A torchmem process on this node (value 1).", labels=labels)
        age = GaugeMetricFamily("torchmem_record_age_seconds", "Seconds since the process last wrote its record.",
                                labels=labels)
        now = time.time_ns()
        for rec in records:
            values = metrics.process_labels(rec, self.job)
            info.add_metric(values, {"local_rank": str(rec.local_rank) if rec.local_rank >= 0 else "",
                                     "world_size": str(rec.world_size) if rec.world_size > 0 else "",
                                     "command": rec.command, "group": rec.group})
            age.add_metric(values, max(0.0, (now - rec.updated_ns) / 1e9))
        yield info
        yield age
        states = GaugeMetricFamily("torchmem_exporter_records",
                                   "Records found at this scrape: live, dead (process gone), invisible (written by a "
                                   "process in another PID namespace), unreadable.", labels=["state"])
        for state in STATES:
            states.add_metric([state], float(self.counts[state]))
        yield states


def _registry(collector):
    # prometheus_client is optional (the metrics extra)
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(collector)
    return registry


def exposition(collector):
    """One scrape's text (the Prometheus text format)."""
    # prometheus_client is optional (the metrics extra)
    from prometheus_client import generate_latest

    return generate_latest(_registry(collector)).decode("utf-8")


def serve(collector, port, host="0.0.0.0"):
    """Serves `collector` on http://host:port/metrics (every path answers); returns the server.
    OSError with the address in its message when the port cannot be bound."""
    # prometheus_client is optional (the metrics extra)
    from prometheus_client import start_http_server

    try:
        served = start_http_server(port, addr=host, registry=_registry(collector))
    except OSError as exc:
        raise OSError(exc.errno, f"torchmem exporter: cannot serve on {host}:{port} ({exc.strerror or exc}); "
                                 f"is another exporter running on this node? Pick another --port") from None
    return served[0] if isinstance(served, tuple) else served
