"""Elastic budgets on one GPU: the I/O around the arbiter (share/arbiter.py).

Processes that set ``share=GROUP,guarantee=SIZE`` form a group per physical
device (its UUID). Each member's publisher thread, every tick (0.1 s), takes
the group's lock (an flock'ed file next to the records), reads the members'
records, runs `arbiter.decide`, writes the decision to the group's JSON file
(write-then-rename, for `top` and for people) and applies its own line: the
pool's limit (torchmem's set-limit path) and, when it holds more than that
limit or was asked to trim, gives back cached memory down to the limit or the
trim mark (release_to: never the whole cache, which a step would map again).
Note [Release slack]: a give-back waits for the device (a barrier before any
unmap: Note [Device barrier] in csrc/core/pool.h), which stalls this process's
queue. So an excess below `release_slack` of the device is kept until it
grows or an owner's allocation waits (the decision is `urgent`): limits that
move by a little at every tick must not cost a barrier each. Its BatchSizeController sees the
lower budget and shrinks the micro-batch at its next micro-step. No server: any
member can decide, the lock makes one decide at a time.

Note [Owners wait, borrowers yield]
An owner that grows back into its share may find the device full of a
borrower's memory. Its allocation then fails in the pool, the pool's own OOM
ladder finds nothing, and the OOM path runs (torchmem/runtime/hooks.py: the
budget mover's waiter, runtime/budget.py, before the user's hooks): the
waiter here records the bytes the allocation needs (`need`), arbitrates at once
(the borrowers' limits fall) and waits, sleeping without the GIL, until the
device has room, then asks the allocator to retry. Borrowers see the new
decision within a tick: their cached memory goes back at once, their live
memory at their next micro-step (the controller re-splits the rest of a step
whose budget fell: Note [Shrinking inside a step] in batch/controller.py). An allocation beyond the owner's own
guarantee (a borrower's, for one) is not a neighbour's doing: the hook
declines at once and the OOM is the process's own (its controller recovers
from it as from any OOM).
"""

import collections
import fcntl
import json
import logging
import os
import threading
import time

from torchmem.monitor import record as _record
from torchmem.share import arbiter

__all__ = ["ShareAgent", "group_files"]

_log = logging.getLogger("torchmem.monitor")
_GRANULE = 2 << 20  # a request maps whole granules (2 MiB on the GPUs torchmem runs on)


def group_files(directory, group, uuid):
    """(lock path, decision path) of a group on the device with this UUID."""
    stem = os.path.join(directory, f"share-{group}-{bytes(uuid).hex()[:16]}")
    return stem + ".lock", stem + ".json"


class _DeviceState:
    def __init__(self):
        self.granted = 0
        self.need = 0
        self.need_since = 0.0


class ShareAgent:
    """This process's member of a sharing group. `guarantee` is bytes (int) or a fraction of the
    device (float); `wait_s` bounds how long an owner's allocation waits for borrowers."""

    def __init__(self, source, group, guarantee, directory=None, wait_s=30.0, headroom=0.01, release_slack=0.01,
                 clock=time.monotonic):
        if not guarantee:
            raise ValueError("torchmem sharing: 'share' needs a 'guarantee' (bytes such as '30GiB' or a fraction "
                             "such as '33%'): the share of the device this process can always get back")
        self.source = source
        self.group = group
        self.guarantee = guarantee
        self.directory = directory or _record.default_dir()
        self.wait_s = float(wait_s)
        self.headroom = headroom
        self.release_slack = release_slack  # fraction of the device (Note [Release slack])
        self.clock = clock
        self.pid = os.getpid()
        self.state = collections.defaultdict(_DeviceState)
        self.last_decision = {}
        self._lock = threading.Lock()  # the publisher thread and an OOM hook may both arbitrate
        self._bad_paths = set()
        self.waits = []  # (seconds, granted): every wait of an owner's allocation, for reports
        # what this member's levers did, for reports (bench/share_scenario.py)
        self.counts = {"limit_changes": 0, "releases": 0, "released_bytes": 0}

    def guarantee_bytes(self, row):
        if isinstance(self.guarantee, float):
            return int(self.guarantee * row.device_total_bytes)
        return int(self.guarantee)

    def annotate(self, rows):
        """Fills the sharing fields of this process's rows (its demand is their peak_live_bytes:
        the publisher's window, monitor/publisher.py)."""
        now = self.clock()
        for row in rows:
            st = self.state[row.index]
            if st.need and (row.reserved_bytes >= st.need or now - st.need_since > self.wait_s):
                st.need = 0  # the allocation that waited went through (or gave up)
            row.guarantee_bytes = self.guarantee_bytes(row)
            row.need_bytes = st.need
            row.granted_bytes = st.granted

    def _note_bad(self, path, error):
        if path not in self._bad_paths:
            self._bad_paths.add(path)
            _log.warning("torchmem sharing: ignoring %s: %s", path, error)

    def arbitrate(self, rows):
        """One round for every device in `rows` (this process's fresh figures): decide under the
        group's lock, publish the decision, apply this process's limit."""
        with self._lock:
            others = [r for r in _record.scan(self.directory, clean=True, on_error=self._note_bad)
                      if r.group == self.group and r.pid != self.pid]
            for row in rows:
                self._arbitrate_device(row, others)

    def _arbitrate_device(self, row, others):
        members = [arbiter.Member(self.pid, row.guarantee_bytes, row.reserved_bytes, row.peak_live_bytes,
                                  row.need_bytes, row.recent_ooms > 0 or bool(row.constrained))]
        reserved_elsewhere = 0
        for rec in others:
            for dev in rec.devices:
                if dev.uuid == row.uuid and dev.guarantee_bytes:
                    members.append(arbiter.Member(rec.pid, dev.guarantee_bytes, dev.reserved_bytes,
                                                  dev.peak_live_bytes, dev.need_bytes,
                                                  dev.recent_ooms > 0 or bool(dev.constrained)))
                    reserved_elsewhere += dev.reserved_bytes
        headroom = int(self.headroom * row.device_total_bytes)  # contexts, workspaces outside the pools
        free = self.source.device_free(row.index)
        capacity = free + row.reserved_bytes + reserved_elsewhere - headroom
        lock_path, decision_path = group_files(self.directory, self.group, row.uuid)
        with open(lock_path, "a") as lock_file:
            fcntl.flock(lock_file, fcntl.LOCK_EX)
            try:
                decision = arbiter.decide(members, max(0, capacity), max(0, row.device_total_bytes - headroom))
                self._publish(decision_path, decision)
            finally:
                fcntl.flock(lock_file, fcntl.LOCK_UN)
        self.last_decision[row.index] = decision
        self._apply(row, decision)

    def _publish(self, path, decision):
        tmp = f"{path}.{self.pid}.tmp"
        try:
            with open(tmp, "w") as f:
                json.dump(dict(decision.as_dict(), decided_by=self.pid, time=time.time()), f)
            os.replace(tmp, path)
        except OSError as exc:  # a full tmpfs: the limits still apply, only the file is stale
            self._note_bad(path, f"cannot write the group's decision ({exc.strerror})")

    def _apply(self, row, decision):
        st = self.state[row.index]
        limit = decision.limits[self.pid]
        if limit != st.granted:
            self.counts["limit_changes"] += 1
            self.source.set_limit(row.index, limit)
            _log.info("torchmem sharing: device %d limit %d -> %d bytes", row.index, st.granted, limit)
            st.granted = limit
            row.granted_bytes = limit
            row.limit_bytes = limit
        keep = min(limit, decision.trim_to.get(self.pid, limit))
        if self._worth_releasing(row.reserved_bytes - keep, row.device_total_bytes, decision.urgent):
            self._release_to(row.index, keep)

    def _worth_releasing(self, excess, device_total, urgent):
        """Note [Release slack]."""
        return excess > 0 and (urgent or excess >= self.release_slack * device_total)

    def _release_to(self, index, keep):
        released = self.source.release_to(index, keep)
        self.counts["releases"] += 1
        self.counts["released_bytes"] += int(released or 0)

    def give_back_now(self):
        """Called at a step boundary (the controller reports its size): memory above the limit
        that the step just freed goes back at once instead of at the next tick."""
        for index, st in list(self.state.items()):
            if st.granted:
                rows = [r for r in self.source.rows() if r.index == index]
                decision = self.last_decision.get(index)
                urgent = decision is not None and decision.urgent
                if rows and self._worth_releasing(rows[0].reserved_bytes - st.granted, rows[0].device_total_bytes,
                                                  urgent):
                    self._release_to(index, st.granted)

    def wait_for_room(self, index, requested, live, publish=None):
        """Note [Owners wait, borrowers yield]: True when the device has room for `requested` bytes
        (retry the allocation), False when this allocation is beyond the guarantee or the wait
        timed out. `publish` rewrites this process's record (so borrowers see the need)."""
        st = self.state[index]
        rows = [r for r in self.source.rows() if r.index == index]
        if not rows:
            return False
        guarantee = self.guarantee_bytes(rows[0])
        room = -(-requested // _GRANULE) * _GRANULE  # the request as the pool maps it (whole granules)
        need = live + room
        if need > guarantee:
            return False  # borrowed memory is not guaranteed: this OOM is the process's own
        st.need, st.need_since = max(st.need, need), self.clock()
        deadline = self.clock() + self.wait_s
        next_round = 0.0
        while self.clock() < deadline:
            if self.clock() >= next_round:  # publish the need first: borrowers must not regrow into the room
                if publish is not None:
                    publish()
                else:
                    self.annotate(rows)
                    self.arbitrate(rows)
                next_round = self.clock() + 0.05
            if self.source.device_free(index) >= room:
                self.waits.append((self.clock() - st.need_since, True))
                return True
            time.sleep(0.01)
        self.waits.append((self.clock() - st.need_since, False))
        _log.warning("torchmem sharing: waited %.1f s for %d bytes on device %d; the borrowers did not give "
                     "them back (do they run a BatchSizeController?)", self.wait_s, requested, index)
        return False

    def oom_hook(self, publish=None):
        """A torchmem.on_oom hook that waits for borrowers (installed allocator)."""
        def hook(device, requested, stats):
            live = int(stats.get("allocated_bytes.all.current", 0))
            return self.wait_for_room(device, requested, live, publish)
        return hook
