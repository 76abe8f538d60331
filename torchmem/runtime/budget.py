"""The memory budget between the batch controller and whatever moves it.

The BatchSizeController (torchmem/batch/) sizes its micro-batches to a budget
and says which size it picked; something else may move that budget while the
job runs: today GPU sharing (torchmem/share/), where an arbiter grants each
process a limit and asks a borrower to give memory back. This module is the
small interface between the two, so batch/ depends on neither share/ nor the
monitor:

- report_micro_batch(size, batch): the controller's pick at a step boundary.
  It is recorded (the monitor publishes it: `top`, metrics, and the arbiter
  reads it from the record) and the plugged mover is told (a sharing borrower
  gives back what it holds over its grant at once).
- owned_bytes(device): the part of the device this process can always get
  back (a sharing process's guarantee), or None.
- elastic(): whether a mover is plugged; the controller's probe then takes the
  pool's limit as the budget (the grant), not the device's free memory, which
  a borrower may hold.
- oom_waiter(): a callable the OOM path runs before the user's hooks (a
  sharing owner waits for borrowers to yield: Note [Owners wait, borrowers
  yield] in share/agent.py), or None.

A mover plugs itself with plug(mover) and leaves with unplug(mover). A mover
has step_boundary(), owned_bytes(device) and an `oom_waiter` attribute.
"""

import threading

__all__ = ["record_micro_batch", "report_micro_batch", "micro_batch", "owned_bytes", "elastic", "oom_waiter",
           "plug", "unplug"]

_lock = threading.Lock()
_micro_batch = {"value": -1, "batch": None}
_mover = {"current": None}


def record_micro_batch(size, batch=None):
    """Records the controller's micro-batch (-1 = none) and the batch it splits, without telling
    the mover: a micro-batch below the batch means more memory would be used (the sharing
    arbiter counts such a process as wanting to borrow)."""
    _micro_batch["value"] = int(size)
    _micro_batch["batch"] = None if batch is None else int(batch)


def report_micro_batch(size, batch=None):
    """Called by the BatchSizeController when it picks a micro-batch for a batch of `batch`
    samples (a step boundary): records it and tells the mover (a sharing process over its
    granted limit gives memory back now)."""
    record_micro_batch(size, batch)
    mover = _mover["current"]
    if mover is not None:
        mover.step_boundary()


def micro_batch():
    """(micro-batch, batch) last reported; (-1, None) before the controller's first pick."""
    return _micro_batch["value"], _micro_batch["batch"]


def owned_bytes(device=None):
    """The bytes of `device` (an index; None: the current device) this process can always get
    back while a mover is plugged (a sharing process's guarantee), else None."""
    mover = _mover["current"]
    return None if mover is None else mover.owned_bytes(device)


def elastic():
    """True while a mover may change this process's budget (it shares its GPU: share=GROUP)."""
    return _mover["current"] is not None


def oom_waiter():
    """The mover's fn(device, requested_bytes, stats) -> bool that the OOM path runs before the
    user's hooks, or None."""
    mover = _mover["current"]
    return None if mover is None else mover.oom_waiter


def plug(mover):
    with _lock:
        if _mover["current"] is not None and _mover["current"] is not mover:
            raise RuntimeError("torchmem budget: a budget mover is plugged already (one per process)")
        _mover["current"] = mover


def unplug(mover):
    with _lock:
        if _mover["current"] is mover:
            _mover["current"] = None
