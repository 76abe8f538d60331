"""Elastic sharing across real processes over a simulated GPU (tests/monitor_fakes.py).

Each tenant is a separate process with its own publisher thread and sharing
agent (torchmem/monitor/, torchmem/share/), exactly as under torchmem.install(); only the
allocator is a fake whose device is a shared array. A tenant's "training loop"
behaves like a BatchSizeController: between steps it shrinks to its granted
limit and grows toward its target otherwise.
"""

import json
import multiprocessing
import os
import signal
import time

import pytest
import torch

from monitor_fakes import MiB, UUID, FakeDevice, FakeOOM, FakeTenant
from torchmem.batch import BatchSizeController, MicroBatchOOMError
from torchmem.batch.probe import SyntheticMemory
from torchmem import share
from torchmem.monitor import record

CTX = multiprocessing.get_context("fork")
CAPACITY = 1000 * MiB
GUARANTEE = 500 * MiB
CHUNK = 50 * MiB


def _start(tenant, directory):
    from torchmem.monitor.publisher import Publisher
    from torchmem.runtime.budget import record_micro_batch as report_micro_batch

    report_micro_batch(-1)  # a forked tenant must not inherit a controller's size from the test process

    agent = share.ShareAgent(tenant, "team", GUARANTEE, directory=directory, wait_s=10.0, headroom=0.0)
    pub = Publisher(tenant, interval=0.05, directory=directory, group="team", agent=agent)
    assert pub.start()
    tenant.hook = agent.oom_hook(publish=pub.tick)
    return pub


def borrower_main(device, slot, directory, target, done, results):
    tenant = FakeTenant(device, slot)
    pub = _start(tenant, directory)
    max_live = 0
    while not done.is_set():  # one "step" per pass
        limit = tenant.limit
        if limit and tenant.live > limit:  # the controller's shrink at the next step
            while tenant.live > limit:
                tenant.free(CHUNK)
            tenant.empty_cache()
        elif tenant.live + CHUNK <= target:
            try:
                tenant.allocate(CHUNK)
            except FakeOOM:
                pass  # its own budget or a full card: the controller stays at this size
        max_live = max(max_live, tenant.live)
        time.sleep(0.02)
    results.put({"role": "borrower", "max_live": max_live, "live": tenant.live, "limit": tenant.limit})
    pub.stop()


def owner_main(device, slot, directory, claim, done, results):
    tenant = FakeTenant(device, slot)
    pub = _start(tenant, directory)
    tenant.allocate(CHUNK)  # a light phase: 50 MiB of its 500 MiB share
    claim.wait()
    waits, crashed = [], None
    while tenant.live + CHUNK <= GUARANTEE:
        t0 = time.monotonic()
        try:
            tenant.allocate(CHUNK)
        except FakeOOM as exc:
            crashed = str(exc)
            break
        waits.append(time.monotonic() - t0)
    results.put({"role": "owner", "waits": waits, "crashed": crashed, "live": tenant.live})
    done.wait()
    pub.stop()


def _live_of(directory, pid):
    for rec in record.scan(directory, clean=False):
        if rec.pid == pid:
            return rec.devices[0].live_bytes
    return 0


def _wait_for(predicate, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out after {timeout} s waiting for {what}")


@pytest.fixture
def setup(tmp_path):
    device = FakeDevice(CTX, CAPACITY, 2)
    events = {"claim": CTX.Event(), "done": CTX.Event()}
    results = CTX.Queue()
    procs = []
    yield str(tmp_path), device, events, results, procs
    events["claim"].set()
    events["done"].set()
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.kill()


def test_borrow_then_give_back_within_a_second(setup):
    directory, device, events, results, procs = setup
    owner = CTX.Process(target=owner_main, args=(device, 0, directory, events["claim"], events["done"], results))
    borrower = CTX.Process(target=borrower_main, args=(device, 1, directory, 900 * MiB, events["done"], results))
    procs += [owner, borrower]
    owner.start()
    borrower.start()
    # The owner uses 50 MiB of its 500: the borrower grows past its own 500 into the unused part.
    _wait_for(lambda: _live_of(directory, borrower.pid) >= 850 * MiB, 15, "the borrower to borrow 350 MiB")
    with open(share.group_files(directory, "team", UUID)[1]) as f:
        decision = json.load(f)
    assert decision["borrowers"] == [borrower.pid]
    assert decision["limits"][str(borrower.pid)] > GUARANTEE
    assert device.used() <= CAPACITY

    events["claim"].set()  # the owner wants its whole share back
    owner_result = results.get(timeout=30)
    assert owner_result["role"] == "owner"
    assert owner_result["crashed"] is None, owner_result
    assert owner_result["live"] == GUARANTEE
    assert max(owner_result["waits"]) < 1.0, owner_result["waits"]
    events["done"].set()
    borrower_result = results.get(timeout=30)
    assert borrower_result["max_live"] >= 850 * MiB
    assert borrower_result["live"] <= borrower_result["limit"]
    assert borrower_result["live"] + owner_result["live"] <= CAPACITY


def test_borrower_killed_while_borrowing(setup):
    directory, device, events, results, procs = setup
    owner = CTX.Process(target=owner_main, args=(device, 0, directory, events["claim"], events["done"], results))
    # A process killed inside a lock of multiprocessing's leaves it held for good, so the
    # borrower shares none it could die in with anyone who goes on: its stop event is its
    # own (Event.is_set takes the event's lock), and the test holds the simulated device's
    # lock (a real driver has none) across the kill.
    borrower_done = CTX.Event()
    borrower = CTX.Process(target=borrower_main, args=(device, 1, directory, 900 * MiB, borrower_done, results))
    procs += [owner, borrower]
    owner.start()
    borrower.start()
    _wait_for(lambda: _live_of(directory, borrower.pid) >= 850 * MiB, 15, "the borrower to borrow")
    with device.reserved.get_lock():
        os.kill(borrower.pid, signal.SIGKILL)
        borrower.join(timeout=10)
        device.reserved[1] = 0  # the driver frees a dead process's memory
    assert borrower.exitcode == -signal.SIGKILL  # it could not clean up after itself
    # No check that the record outlives the kill: the owner's agent may already have removed
    # it (its scan runs on its own clock), which is what the test waits for below.
    events["claim"].set()
    owner_result = results.get(timeout=30)
    assert owner_result["crashed"] is None and owner_result["live"] == GUARANTEE
    # the owner's agent saw a dead pid (start time check) and removed its record
    _wait_for(lambda: not os.path.exists(record.record_path(directory, borrower.pid)), 5, "the dead record's removal")

    def decided_without_the_dead():
        with open(share.group_files(directory, "team", UUID)[1]) as f:
            return str(borrower.pid) not in json.load(f)["limits"]

    _wait_for(decided_without_the_dead, 5, "a decision without the dead borrower")


def test_corrupt_and_foreign_records_do_not_stop_sharing(setup):
    directory, device, events, results, procs = setup
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, "12345.rec"), "wb") as f:
        f.write(b"not a torchmem record")
    with open(os.path.join(directory, "23456.rec"), "wb") as f:
        f.write(b"X" * record.RECORD_BYTES)
    owner = CTX.Process(target=owner_main, args=(device, 0, directory, events["claim"], events["done"], results))
    procs.append(owner)
    owner.start()
    events["claim"].set()
    owner_result = results.get(timeout=30)
    assert owner_result["crashed"] is None and owner_result["live"] == GUARANTEE
    errors = []
    record.scan(directory, on_error=lambda path, err: errors.append(os.path.basename(path)))
    assert sorted(errors) == ["12345.rec", "23456.rec"]



class TenantMemory(SyntheticMemory):
    """A BatchSizeController probe whose bytes live in a FakeTenant: a step over `micro` samples
    holds fixed + per_sample x micro bytes, and the budget is the limit the arbiter granted."""

    def __init__(self, tenant, fixed, per_sample):
        super().__init__(fixed, per_sample, budget=GUARANTEE)
        self.tenant = tenant
        tenant.allocate(fixed)

    def budget_bytes(self):
        return self.tenant.limit or self.tenant.device.capacity

    def use(self, micro):
        self.budget = self.budget_bytes()
        super().use(micro)  # OOM above its own limit, as torchmem's pool would raise
        extra = self.need(micro) - self.fixed
        try:
            self.tenant.allocate(extra)
        except FakeOOM as exc:
            raise torch.OutOfMemoryError(f"CUDA out of memory ({exc})") from None
        self.tenant.free(extra)  # activations die at the end of the micro-step; the cache stays


def test_controller_shrinks_the_borrower_and_no_one_crashes(setup):
    """The borrower runs the real BatchSizeController (in this process; the owner is forked)."""
    directory, device, events, results, procs = setup
    owner = CTX.Process(target=owner_main, args=(device, 0, directory, events["claim"], events["done"], results))
    procs.append(owner)
    owner.start()
    tenant = FakeTenant(device, 1)
    pub = _start(tenant, directory)
    model = torch.nn.Linear(3, 1)
    memory = TenantMemory(tenant, fixed=100 * MiB, per_sample=10 * MiB)
    ctl = BatchSizeController(64, model=model, probe=memory, margin=0.0)

    def steps_until(done, timeout):
        deadline = time.monotonic() + timeout
        while not done():
            assert time.monotonic() < deadline, f"timed out; controller events: {ctl.events[-5:]}"

            def step_fn(micro_batch):
                memory.use(micro_batch.shape[0])
                return model(micro_batch).square().mean()

            try:
                ctl.run(step_fn, torch.randn(64, 3))
            except MicroBatchOOMError as exc:
                raise AssertionError(f"the borrower crashed: {exc}") from None
            model.zero_grad(set_to_none=True)
            time.sleep(0.02)

    claimed = {}

    def owner_done():
        if not results.empty():
            claimed.update(results.get())
        return bool(claimed)

    try:
        steps_until(lambda: ctl.micro_batch == 64, 15)  # 740 MiB a step: it borrowed beyond its 500
        events["claim"].set()
        steps_until(owner_done, 30)  # the borrower keeps training while the owner takes its share back
        assert claimed["crashed"] is None and claimed["live"] == GUARANTEE, claimed
        assert max(claimed["waits"]) < 1.0, claimed["waits"]
        steps_until(lambda: ctl.micro_batch <= 40, 5)  # (500 - 100) / 10: back within its own share
    finally:
        pub.stop()


def test_a_sharing_process_budget_is_the_arbiters_grant(tmp_path, monkeypatch):
    """TorchmemProbe: while this process shares its GPU, the controller's budget is the granted
    limit, not the device's free memory (a borrower may hold it); no CUDA call is needed."""
    from torchmem.batch import probe

    device = FakeDevice(CTX, CAPACITY, 1)
    tenant = FakeTenant(device, 0)
    monkeypatch.setattr(probe.TorchmemProbe, "_stats", lambda self: {"torchmem.limit_bytes": 700 * MiB})
    monkeypatch.setattr(probe.torch.cuda, "mem_get_info", lambda device=None: (0, CAPACITY))
    assert probe.TorchmemProbe(0).budget_bytes() == 0  # not sharing: capped by what is free now
    pub = share.start(source=tenant, group="team", guarantee=GUARANTEE, directory=str(tmp_path))
    try:
        assert pub.agent is not None
        assert probe.TorchmemProbe(0).budget_bytes() == 700 * MiB
    finally:
        share.stop()


class _Levers:
    """The two levers _apply pulls, recorded."""

    def __init__(self):
        self.limits, self.releases = [], []

    def set_limit(self, index, limit):
        self.limits.append(limit)

    def release_to(self, index, keep):
        self.releases.append(keep)
        return 0


def test_a_small_excess_waits_unless_an_owner_waits(tmp_path):
    # Note [Release slack]: a give-back costs a device barrier; a limit that moves by a
    # little must not cost one at every tick, but a waiting owner gets its bytes at once.
    from torchmem.share.arbiter import Decision
    from torchmem.monitor.record import DeviceFigures

    levers = _Levers()
    agent = share.ShareAgent(levers, "team", GUARANTEE, directory=str(tmp_path), release_slack=0.01)
    pid = agent.pid
    row = DeviceFigures(index=0, reserved_bytes=600 * MiB, device_total_bytes=CAPACITY)
    small = Decision({pid: 595 * MiB}, (pid,), CAPACITY, False)  # 5 MiB over: under 1% of the device
    agent._apply(row, small)
    assert levers.limits == [595 * MiB] and levers.releases == []
    large = Decision({pid: 580 * MiB}, (pid,), CAPACITY, False)  # 20 MiB over: worth a barrier
    agent._apply(row, large)
    assert levers.releases == [580 * MiB]
    urgent = Decision({pid: 598 * MiB}, (pid,), CAPACITY, False, urgent=True)
    agent._apply(row, urgent)
    assert levers.releases == [580 * MiB, 598 * MiB]
    assert agent.counts["releases"] == 2
