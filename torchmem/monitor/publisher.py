"""The background thread that publishes this process's figures (and runs an agent, if given).

One daemon thread per process reads the source's counters every `interval`
seconds (0.5 by default, 0.1 with an agent: a sharing owner's memory must come
back within a second) and writes the record (monitor/record.py). An `agent` is
run on the same thread, in the same order, every tick: `agent.annotate(rows)`
fills fields of the fresh rows before the record is built, `agent.arbitrate(rows)`
acts on them before it is written. GPU sharing is the agent (share/agent.py):
riding on this tick keeps its timing tied to the figures it decides on, and the
monitor needs no knowledge of it. Nothing here is on the allocation path: the
allocator never waits for this thread.

Note [Failures do not stop training]
A full shared-memory filesystem, a directory we may not write, a stats call
that raises: each is reported once (a warning naming the problem and the fix)
and the job goes on. A failure to create or write the record stops publishing;
any other error skips that tick.
"""

import atexit
import collections
import logging
import os
import threading
import time
import warnings

from torchmem.monitor import record as _record
from torchmem.monitor.sources import distributed_identity, process_command, process_identity
from torchmem.runtime import budget

__all__ = ["Publisher", "identity_now"]

_log = logging.getLogger("torchmem.monitor")
# peak_live_bytes is the peak over this window (a sharing member's demand) and
# recent_ooms the OOMs within it (a member pressed against its limit)
WINDOW_S = 2.0


def identity_now(base):
    """`base` (process_identity()) with the rank and world size of torch.distributed's default
    group once it exists: a process started by mp.spawn learns its rank only there."""
    identity = dict(base)
    group = distributed_identity()
    if group is not None:
        identity["rank"], identity["world_size"] = group
    return identity


class Publisher:
    def __init__(self, source, interval=0.5, directory=None, group="", agent=None, command=None, job=None,
                 identity=None):
        if not interval > 0:
            raise ValueError(f"torchmem monitor: interval must be > 0 seconds, got {interval!r}")
        self.source = source
        self.agent = agent
        self.interval = min(interval, 0.1) if agent is not None else interval
        self.group = group or ""
        self.command = command or process_command()
        self.identity = dict(identity) if identity is not None else process_identity(job)
        self.writer = _record.RecordWriter(directory)
        self.latest = None
        self.errors = 0
        self._tick_lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = None
        self._warned = set()
        self._peaks = collections.defaultdict(collections.deque)  # device -> (time, live peak, OOM count)

    def _warn_once(self, key, message):
        if key not in self._warned:
            self._warned.add(key)
            _log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=3)

    def _snapshot(self):
        rows = self.source.rows()
        micro, batch = budget.micro_batch()  # the batch controller's pick (runtime/budget.py)
        now = time.monotonic()
        for row in rows:
            row.micro_batch = micro
            row.constrained = int(batch is not None and 0 < micro < batch)
            # The pool's peak restarts whenever someone resets it (the controller does each
            # step); the window keeps the peaks of the last WINDOW_S seconds.
            peaks = self._peaks[row.index]
            peaks.append((now, max(row.live_bytes, row.peak_live_bytes), row.ooms))
            while peaks[0][0] < now - WINDOW_S:
                peaks.popleft()
            row.peak_live_bytes = max(p[1] for p in peaks)
            row.recent_ooms = row.ooms - peaks[0][2]
        if self.agent is not None:
            self.agent.annotate(rows)
        host_reserved, host_active = self.source.host()
        return _record.Record(pid=self.writer.pid, start_ticks=self.writer.start_ticks,
                              updated_ns=time.time_ns(), interval_ms=int(self.interval * 1000),
                              group=self.group, command=self.command, host_reserved_bytes=host_reserved,
                              host_active_bytes=host_active, devices=rows, **identity_now(self.identity))

    def start(self):
        """Creates the record and starts the thread; False (with a warning) when the record cannot
        be created (Note [Failures do not stop training])."""
        _record.clean_dead(self.writer.directory)
        try:
            self.writer.open(self._snapshot())
        except OSError as exc:
            self._warn_once("open", str(exc.strerror or exc))
            return False
        self.tick()
        self._thread = threading.Thread(target=self._run, name="torchmem-monitor", daemon=True)
        self._thread.start()
        atexit.register(self.stop)
        return True

    def tick(self):
        """One round: read, share, write. Safe to call from any thread (the OOM hook does)."""
        with self._tick_lock:
            if self.writer._fd is None:
                return
            record = self._snapshot()
            if self.agent is not None:
                self.agent.arbitrate(record.devices)
            try:
                self.writer.write(record)
            except OSError as exc:
                self._warn_once("write", f"torchmem monitor: cannot write {self.writer.path} ({exc.strerror}); "
                                         f"publishing stops, training goes on")
                self.writer.close(remove=False)
                return
            self.latest = record

    def _run(self):
        while not self._stop.wait(self.interval):
            try:
                self.tick()
            except Exception as exc:  # Note [Failures do not stop training]
                self.errors += 1
                self._warn_once(type(exc).__name__, f"torchmem monitor: a publishing round failed: {exc!r} "
                                                    f"(reported once; later rounds go on)")

    def stop(self):
        """Stops the thread and removes the record (only in the process that created it)."""
        self._stop.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
        if os.getpid() == self.writer.pid:
            with self._tick_lock:
                self.writer.close(remove=True)
