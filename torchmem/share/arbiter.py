"""The sharing arbiter's rule: who may hold how much of one GPU, as a pure function.

Processes that opt in to a sharing group (``share=GROUP,guarantee=30GiB``) each
own a guaranteed share of the device and may borrow what the others do not
use. `decide` turns one snapshot of the members' figures into a limit per
member (the budget torchmem's pool enforces) and a set of members asked to give
their cached memory back. It reads no files and no clocks, so every case is a
unit test; share/agent.py is the I/O around it.

Note [The rule]
- demand = max(recent peak of live bytes, bytes an allocation waits for).
- A member whose demand is below its guarantee is an owner: it uses
  min(max(demand, reserved), guarantee) (what it holds counts until it trims
  its cache) and keeps the rest of its share on call: its limit is its guarantee, so it can
  always grow back into it (borrowers then yield).
- A member with no allocation waiting that is at or above its guarantee
  (within `near`), or that is `pressed` (it ran out of memory at its limit
  lately, or its batch controller splits batches it would run whole with more
  memory: its peak can sit well below the limit), is a borrower: its limit is its guarantee plus a share, weighted by
  guarantee, of what is left when every member's used share is counted:
  capacity - sum(owners' use) - sum(borrowers' g). Borrowed bytes
  are rounded down to the granule.
- So the limits of borrowers plus what owners use never exceed the capacity:
  when an owner's demand rises the borrowers' limits fall at once.
- While some member borrows, an owner that holds more than twice its demand
  (`trim_ratio` 1.0) plus `trim_slack` (4 granules) is asked to trim its cache
  down to that mark (`trim_to`). Cached memory that only sits there (a former
  borrower's, after its heavy phase) is what borrowers grow into. The cache a
  step reuses stays: a step holds more than its peak of live bytes (1.002-1.15x
  on the bundled traces, more for a pool far below its budget, which does not
  pack), so a mark near the bare peak would have the owner map and give back
  memory every step. Emptying the whole cache did that to all of it
  (bench/share_scenario.py on the H200: 113 samples/s, against 287 for the
  static split). A borrower above its
  own limit gives back only the excess, on its own (share.py).
- `capacity` is what the members can hold now (device free + their reserved
  bytes: memory of other processes, or of a process that just died and whose
  memory the driver has not freed yet, is not there to lend); guarantees are
  measured against the device's usable size `total`, which does not move, so
  an owner's limit never falls because of a transient. Guarantees that add up
  to more than `total` are scaled down in proportion (and reported), never
  refused: the job must go on.
"""

import dataclasses

__all__ = ["Member", "Decision", "decide"]


@dataclasses.dataclass(frozen=True)
class Member:
    """One process's figures for one device, as the arbiter needs them (bytes)."""

    pid: int
    guarantee: int
    reserved: int = 0
    live_peak: int = 0
    need: int = 0  # an allocation waiting for this much in all (live + request); 0 = none
    # it ran out of memory at its limit lately, or its controller splits batches it
    # could run whole with more memory: it would use a loan
    pressed: bool = False


@dataclasses.dataclass(frozen=True)
class Decision:
    limits: dict        # pid -> bytes the member may reserve
    borrowers: tuple    # pids borrowing beyond their guarantee
    capacity: int
    scaled: bool        # guarantees were scaled down to fit the capacity
    trim_to: dict = dataclasses.field(default_factory=dict)  # pid -> bytes a member asked to trim keeps
    urgent: bool = False  # some member's allocation waits for memory: give back now, to the byte

    @property
    def trim(self):
        """The pids asked to give cached memory back."""
        return tuple(self.trim_to)

    def as_dict(self):
        return {"limits": {str(k): v for k, v in self.limits.items()}, "borrowers": list(self.borrowers),
                "trim": list(self.trim), "trim_to": {str(k): v for k, v in self.trim_to.items()},
                "capacity": self.capacity, "scaled": self.scaled, "urgent": self.urgent}


def _round_down(value, granule):
    return value - value % granule if granule > 1 else value


def decide(members, capacity, total=None, granule=2 << 20, near=0.05, trim_slack=None, trim_ratio=1.0):
    """Limits for `members` (Members) sharing `capacity` bytes now, on a device whose usable size
    is `total` (default: capacity) (Note [The rule])."""
    total = capacity if total is None else total
    if capacity < 0 or total < 0 or granule < 1:
        raise ValueError(f"arbiter: capacity and total must be >= 0 and granule >= 1, got {capacity}, {total}, {granule}")
    members = sorted(members, key=lambda m: m.pid)
    if not members:
        return Decision({}, (), capacity, False)
    total_g = sum(m.guarantee for m in members)
    scaled = total_g > total
    factor = total / total_g if scaled else 1.0
    guarantee = {m.pid: max(granule, _round_down(int(m.guarantee * factor), granule)) for m in members}
    demand = {m.pid: max(m.live_peak, m.need) for m in members}
    borrowers = [m for m in members
                 if m.need == 0 and (m.pressed or demand[m.pid] >= guarantee[m.pid] * (1.0 - near))]
    borrower_ids = {m.pid for m in borrowers}
    # an owner's cache counts as used until it trims: lending memory a process still holds
    # would send the borrower into a full device
    used = sum(min(max(demand[m.pid], m.reserved), guarantee[m.pid]) for m in members if m.pid not in borrower_ids)
    used += sum(guarantee[m.pid] for m in borrowers)
    spare = max(0, capacity - used)
    limits = {m.pid: guarantee[m.pid] for m in members}
    weight = sum(guarantee[m.pid] for m in borrowers)
    for m in borrowers:
        limits[m.pid] = guarantee[m.pid] + _round_down(spare * guarantee[m.pid] // weight, granule)
    trim_to = {}
    if borrowers:
        slack = granule * 4 if trim_slack is None else trim_slack
        keep = {m.pid: int(demand[m.pid] * (1.0 + trim_ratio)) + slack for m in members}
        trim_to = {m.pid: keep[m.pid] for m in members
                   if m.pid not in borrower_ids and m.reserved > keep[m.pid]}
    urgent = any(m.need for m in members)
    return Decision(limits, tuple(m.pid for m in borrowers), capacity, scaled, trim_to, urgent)
