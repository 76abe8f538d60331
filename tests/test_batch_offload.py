"""BatchSizeController(offload="auto"): the last rung before MicroBatchOOMError
(CPU: a step that runs out of memory unless offload is on)."""

import pytest
import torch

from torchmem import host
from torchmem.batch import BatchSizeController, MicroBatchOOMError, NullProbe
from torchmem.batch.offload_rung import OffloadRung
from torchmem.host.offload import OffloadActivations


def setup(grow_after=3, offload="auto"):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 1))
    ctl = BatchSizeController(8, model=model, probe=NullProbe(), grow_after=grow_after, offload=offload)
    pool = host.HostPool(backend="sim", chunk_mb=4, sim={"auto_complete": True})
    ctl.offload_rung.offload_factory = lambda budget: OffloadActivations(budget, min_bytes=0, pool=pool,
                                                                         devices=("cpu",))

    def step_fn(mb):
        if not ctl.offload_rung.active:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return model(mb).square().mean()

    return model, ctl, step_fn


def test_offload_instead_of_raising_and_gradients_unchanged():
    model, ctl, step_fn = setup()
    x = torch.randn(8, 16)
    loss = ctl.run(step_fn, x)
    assert ctl.offload_rung.active and ctl.micro_batch == 1
    assert [e["event"] for e in ctl.events][-1] == "offload"
    assert ctl.offload_rung.offload.last_step["offloaded_bytes"] > 0
    got = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    expected_loss = 0
    for i in range(8):  # the same micro-steps without offload
        part = model(x[i:i + 1]).square().mean()
        (part * (1 / 8)).backward()
        expected_loss = expected_loss + part.detach() * (1 / 8)
    assert all(torch.equal(a, p.grad) for a, p in zip(got, model.parameters()))
    assert torch.allclose(loss, expected_loss)


def test_offload_turns_off_and_back_on_with_growing_patience():
    model, ctl, step_fn = setup(grow_after=3)
    x = torch.randn(8, 16)
    for _ in range(3):
        ctl.run(step_fn, x)
        model.zero_grad(set_to_none=True)
    assert not ctl.offload_rung.active  # tried off after 3 clean steps (no figures)
    ctl.run(step_fn, x)  # runs out of memory without it: on again
    model.zero_grad(set_to_none=True)
    assert ctl.offload_rung.active
    for _ in range(4):
        ctl.run(step_fn, x)
        model.zero_grad(set_to_none=True)
    assert ctl.offload_rung.active  # 5 clean steps: it now waits 6
    notes = [e["reason"] for e in ctl.events if e["event"] == "offload"]
    assert notes[0].startswith("offload on") and notes[1].startswith("offload off") and notes[2].startswith("offload on")


def test_without_offload_it_still_raises():
    _, ctl, step_fn = setup(offload=None)
    with pytest.raises(MicroBatchOOMError, match="smallest size"):
        ctl.run(step_fn, torch.randn(8, 16))
    with pytest.raises(ValueError, match="offload"):
        BatchSizeController(8, model=torch.nn.Linear(2, 1), probe=NullProbe(), offload="always")


def test_offload_everything_and_still_out_of_memory_raises():
    model = torch.nn.Linear(16, 1)
    ctl = BatchSizeController(8, model=model, probe=NullProbe(), offload="auto")
    ctl.offload_rung.offload_factory = lambda budget: OffloadActivations(budget, devices=("cpu",))

    def never_fits(mb):
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(MicroBatchOOMError):
        ctl.run(never_fits, torch.randn(8, 16))
    assert ctl.offload_rung.active  # it tried offload before giving up


class FakeOffload:
    def __init__(self, budget):
        self.budget_bytes = budget
        self.last_step = {"saved_bytes": 1000, "offloaded_bytes": 600, "kept_bytes": 400, "offloaded_count": 3}

    def set_budget(self, budget):
        self.budget_bytes = budget


def test_rung_tunes_the_budget_from_figures_then_turns_off():
    rung = OffloadRung("auto", offload_factory=FakeOffload)
    assert rung.engage().startswith("offload on")
    # headroom 500 < 600 moved: keep what stayed plus 80% of the headroom
    assert rung.after_success(peak=9500, target=10000).startswith("offload budget")
    assert rung.offload.budget_bytes == 400 + 400
    assert rung.engage() == "offload back to every eligible activation"
    assert rung.offload.budget_bytes is None
    rung.after_success(peak=9500, target=10000)  # that plan failed: use half as much headroom now
    assert rung.offload.budget_bytes == 400 + 200
    rung.engage()
    assert rung.engage() is None  # everything moves already: nothing more to give
    # headroom 700 >= 600 moved: memory allows running without offload
    assert rung.after_success(peak=9300, target=10000).startswith("offload off: memory allows")
    assert not rung.active
    assert OffloadRung(None).engage() is None
