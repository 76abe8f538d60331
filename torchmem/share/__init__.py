"""GPU sharing: elastic memory budgets for several processes on one GPU.

    TORCHMEM_CONF="share=team,guarantee=30GiB" python train.py   # in each process

Each member of a group owns a guaranteed share of the device and may borrow
what the others do not use (docs/sharing.md). The parts:

- arbiter.py: the rule, a pure function (who may hold how much).
- agent.py: the I/O around it: the group's lock and decision file, this
  process's limit, the owner's wait on OOM (Note [Owners wait, borrowers yield]).
- levers.py: the two actions on the allocator (set the limit, give back cache),
  through the gate to the compiled module.

How it plugs in, so that neither the monitor nor the batch controller knows
about sharing: the agent reads the other members' records that the monitor
publishes (monitor/record.py) and rides on this process's publisher thread
(monitor/publisher.py runs its `agent` every tick); and it plugs a budget
mover into runtime/budget.py, which the batch controller reports its
micro-batch to and its probe reads the guarantee from, and whose OOM waiter
the OOM path runs before the user's hooks.
"""

import threading

import torch

from torchmem import monitor
from torchmem.runtime import budget, hooks
from torchmem.share.agent import ShareAgent, group_files
from torchmem.share.levers import RuntimeLevers

__all__ = ["start", "stop", "ShareAgent", "group_files"]

_lock = threading.Lock()
_state = {"mover": None}


class _Mover:
    """The budget mover (runtime/budget.py) of a sharing process."""

    def __init__(self, pub, agent, wait_on_oom):
        self.pub = pub
        self.agent = agent
        # Note [Owners wait, borrowers yield] in share/agent.py: only on the installed allocator,
        # whose OOM path calls it; `publish` rewrites the record first so borrowers see the need.
        self.oom_waiter = agent.oom_hook(publish=pub.tick) if wait_on_oom else None

    def step_boundary(self):
        self.agent.give_back_now()

    def owned_bytes(self, device=None):
        """This process's guaranteed share of `device` (an index; None: the current device) in
        bytes, as last published, else None."""
        latest = self.pub.latest
        if latest is None:
            return None
        if device is None:
            device = torch.cuda.current_device()
        for row in latest.devices:
            if row.index == device and row.guarantee_bytes:
                return int(row.guarantee_bytes)
        return None


def start(source=None, group=None, guarantee=None, wait_s=30.0, directory=None, interval=0.5, job=None):
    """Joins sharing group `group` with `guarantee` (bytes, or a fraction of the device as a
    float) and starts publishing; returns the Publisher, or None when the record cannot be
    created (a warning says why). `source` defaults to the installed allocator; a test gives
    a fake with the levers' methods (share/levers.py)."""
    runtime = source is None
    source = RuntimeLevers() if runtime else source
    agent = ShareAgent(source, group, guarantee, directory=directory, wait_s=wait_s)
    pub = monitor.start(source=source, interval=interval, directory=directory, job=job, group=group, agent=agent)
    if pub is None or pub.agent is not agent:  # no record, or publishing started already without sharing
        return pub
    mover = _Mover(pub, agent, wait_on_oom=runtime)
    with _lock:
        _state["mover"] = mover
        budget.plug(mover)
    if runtime:
        hooks._attach_runtime()  # the OOM path calls back into Python (as on_oom() did for the waiter)
    return pub


def stop():
    """Leaves the group: the budget mover is unplugged and publishing stops (the record goes)."""
    with _lock:
        mover, _state["mover"] = _state["mover"], None
    if mover is not None:
        budget.unplug(mover)
    monitor.stop()
