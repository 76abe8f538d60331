"""BatchSizeController against a synthetic memory model (CPU, no allocator).

Most tests here pin objective="largest": they hold the memory logic (how fast
the largest size that fits is found, ceilings, probing, re-splits), which the
throughput objective builds on (tests/test_batch_throughput.py)."""

import math

import pytest
import torch

from torchmem.batch import (AdaptiveBatchSampler, BatchSizeController, MicroBatchOOMError, NullProbe, OptimizerStepOOMError,
                            SyntheticMemory)


def quantized_max(memory, quantum, cap, target=None):
    """The largest size of the controller's grid whose need stays <= target."""
    target = memory.budget if target is None else target
    best = 0
    for size in range(1, cap + 1):
        on_grid = size == cap or (size % quantum == 0) or (size < quantum and size & (size - 1) == 0)
        if on_grid and memory.need(size) <= target:
            best = size
    return best


def make_loop(memory, global_batch, **kwargs):
    kwargs.setdefault("objective", "largest")
    model = torch.nn.Linear(3, 1)
    ctl = BatchSizeController(global_batch, model=model, probe=memory, **kwargs)

    def step_fn(micro_batch):
        memory.use(micro_batch.shape[0])
        return model(micro_batch).square().mean()

    def one_step():
        loss = ctl.run(step_fn, torch.randn(global_batch, 3))
        model.zero_grad(set_to_none=True)
        return loss

    return ctl, one_step


@pytest.mark.parametrize("fixed,per_sample,room,global_batch,quantum,step_fixed", [
    (1000, 100, 27, 64, 8, 0),
    (5 << 20, 3 << 10, 203, 256, 8, 0),
    (1 << 30, 1 << 20, 5, 64, 8, 0),
    (7000, 13, 977, 512, 1, 0),
    (100, 1, 1000, 64, 8, 0),       # everything fits: stays at the whole batch
    # a step adds fixed bytes (gradients, workspaces): the cold-start bound allows
    # no growth from 16, so one calibration step at 8 measures the line (GPT-2 on the H200)
    (1000, 100, 27, 64, 8, 1600),
    (4 << 30, 600 << 20, 27, 64, 8, 5 << 30),
])
def test_cold_start_reaches_largest_feasible_size_in_three_steps_and_never_exceeds_it(
        fixed, per_sample, room, global_batch, quantum, step_fixed):
    memory = SyntheticMemory(fixed, per_sample, fixed + step_fixed + per_sample * room + per_sample // 2,
                             step_fixed=step_fixed)
    ctl, one_step = make_loop(memory, global_batch, quantum=quantum, margin=0.0)
    best = quantized_max(memory, quantum, global_batch)
    for _ in range(3):
        one_step()
    assert ctl.micro_batch == best
    tried_after, events_after = len(memory.sizes_tried), len(ctl.events)
    ooms = memory.ooms
    for _ in range(60):  # grow_after=50 clean steps pass: the ceiling must still hold
        one_step()
    assert ctl.micro_batch == best
    assert memory.ooms == ooms
    assert max(memory.sizes_tried[tried_after:]) == best
    assert not [e for e in list(ctl.events)[events_after:] if e["event"] in ("grow", "shrink")]


def test_margin_keeps_the_prediction_under_the_budget():
    memory = SyntheticMemory(10_000, 100, 10_000 + 100 * 60)
    ctl, one_step = make_loop(memory, 128, margin=0.1)
    for _ in range(3):
        one_step()
    assert ctl.micro_batch == quantized_max(memory, 8, 128, target=memory.budget * 0.9)
    assert ctl.micro_batch < quantized_max(memory, 8, 128)


def test_grows_back_when_the_budget_rises_and_shrinks_when_it_falls():
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 20)
    ctl, one_step = make_loop(memory, 64, margin=0.0)
    for _ in range(3):
        one_step()
    assert ctl.micro_batch == 16
    memory.budget = 1000 + 100 * 50
    one_step()
    one_step()
    assert ctl.micro_batch == 48
    memory.budget = 1000 + 100 * 30
    ooms = memory.ooms
    loss = one_step()  # OOMs at 48, retries the same batch at the model's size
    assert torch.isfinite(loss)
    assert memory.ooms == ooms + 1
    assert ctl.micro_batch == 24
    memory.budget = 1000 + 100 * 64
    one_step()
    one_step()
    assert ctl.micro_batch == 64 and ctl.accumulation_steps == 1


def test_without_figures_it_learns_from_ooms_and_probes_up_below_the_ceiling():
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 20)
    model = torch.nn.Linear(3, 1)
    ctl = BatchSizeController(64, model=model, probe=NullProbe(), grow_after=5, objective="largest")

    def step_fn(mb):
        memory.use(mb.shape[0])
        return model(mb).sum()

    for _ in range(40):
        ctl.run(step_fn, torch.randn(64, 3))
        model.zero_grad(set_to_none=True)
    assert ctl.micro_batch == 16  # 64 and 32 failed, 24 failed once; 16 is the grid's best below
    assert memory.ooms <= 4


def _mlp():
    torch.manual_seed(1)
    return torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2)).double()


def _full_batch_grads(x, y):
    model = _mlp()
    torch.nn.functional.mse_loss(model(x), y).backward()
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("budget_room", [37, 9, 5])
def test_split_gradients_equal_full_batch_gradients_even_after_ooms(budget_room):
    torch.manual_seed(0)
    x, y = torch.randn(37, 5, dtype=torch.double), torch.randn(37, 2, dtype=torch.double)
    reference = _full_batch_grads(x, y)
    model = _mlp()
    memory = SyntheticMemory(0, 1, budget_room)
    ctl = BatchSizeController(37, model=model, probe=memory, margin=0.0)

    def step_fn(batch):
        xb, yb = batch
        loss = torch.nn.functional.mse_loss(model(xb), yb)
        memory.use(xb.shape[0])  # OOM after forward, as a real backward would
        return loss

    loss = ctl.run(step_fn, (x, y))
    with torch.no_grad():
        expected_loss = torch.nn.functional.mse_loss(_mlp()(x), y)
    assert abs(loss.item() - expected_loss.item()) < 1e-9
    for got, want in zip((p.grad for p in model.parameters()), reference):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)
    assert (memory.ooms > 0) == (budget_room < 37)


def test_state_dict_round_trip_resumes_at_the_same_size_without_ooms():
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 27)
    ctl, one_step = make_loop(memory, 64, margin=0.0)
    for _ in range(4):
        one_step()
    state = ctl.state_dict()
    fresh, fresh_step = make_loop(memory, 64, margin=0.0)
    fresh.load_state_dict(state)
    assert fresh.state_dict() == state
    ooms = memory.ooms
    fresh_step()
    assert fresh.micro_batch == ctl.micro_batch == 24 and memory.ooms == ooms
    with pytest.raises(ValueError, match="version"):
        fresh.load_state_dict({"version": 99})


def test_oom_inside_optimizer_step_is_not_retried():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = BatchSizeController(8, model=model, optimizer=optimizer, probe=NullProbe())

    def failing_step(closure=None):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    optimizer.step = lambda *a, **k: failing_step()
    ctl.run(lambda mb: model(mb).sum(), torch.randn(8, 3))
    with pytest.raises(OptimizerStepOOMError, match="not retried"):
        ctl.step()


def test_oom_raised_while_the_optimizer_steps_inside_run_is_not_retried():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = BatchSizeController(8, model=model, optimizer=optimizer, probe=NullProbe())
    calls = []

    def step_fn(mb):
        calls.append(mb.shape[0])
        ctl._enter_optimizer_step()  # what the optimizer's step pre-hook does
        raise torch.OutOfMemoryError("CUDA out of memory.")

    with pytest.raises(OptimizerStepOOMError):
        ctl.run(step_fn, torch.randn(8, 3))
    assert calls == [8]


def test_optimizer_step_hooks_track_the_step():
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ctl = BatchSizeController(8, model=model, optimizer=optimizer, probe=NullProbe())
    seen = []
    optimizer.register_step_pre_hook(lambda *args: seen.append(ctl._in_optimizer_step))
    ctl.run(lambda mb: model(mb).sum(), torch.randn(8, 3))
    optimizer.step()
    assert seen == [True] and not ctl._in_optimizer_step


def test_other_errors_propagate_and_smallest_size_oom_raises():
    model = torch.nn.Linear(3, 1)
    ctl = BatchSizeController(8, model=model, probe=NullProbe())
    with pytest.raises(KeyError):
        ctl.run(lambda mb: {}["missing"], torch.randn(8, 3))
    memory = SyntheticMemory(10, 1, 5)
    with pytest.raises(MicroBatchOOMError, match="micro-batch 1"):
        ctl.run(lambda mb: memory.use(mb.shape[0]), torch.randn(8, 3))
    assert memory.sizes_tried == [8, 4, 2, 1]


def test_oom_with_gradients_from_before_run_refuses_to_discard_them():
    model = torch.nn.Linear(3, 1)
    model(torch.randn(2, 3)).sum().backward()
    memory = SyntheticMemory(0, 1, 4)
    ctl = BatchSizeController(8, model=model, probe=memory)
    with pytest.raises(MicroBatchOOMError, match="gradients existed"):
        ctl.run(lambda mb: (memory.use(mb.shape[0]), model(mb).sum())[1], torch.randn(8, 3))


def test_adapt_global_scales_learning_rate_by_rule():
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 16)
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.4)
    ctl = BatchSizeController(64, model=model, optimizer=optimizer, probe=memory, margin=0.0,
                              adapt_global=True, lr_rule="sqrt")

    def step_fn(mb):
        memory.use(mb.shape[0])
        return model(mb).sum()

    for _ in range(3):
        ctl.run(step_fn, torch.randn(ctl.local_batch, 3))
        model.zero_grad(set_to_none=True)
    assert ctl.global_batch == 16 and ctl.accumulation_steps == 1
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.4 * math.sqrt(16 / 64))
    memory.budget = 1000 + 100 * 128
    for _ in range(2):
        ctl.run(step_fn, torch.randn(ctl.local_batch, 3))
    assert ctl.global_batch == 128
    assert math.isclose(optimizer.param_groups[0]["lr"], 0.4 * math.sqrt(2))
    sampler = AdaptiveBatchSampler(range(300), ctl)
    assert [len(b) for b in sampler] == [128, 128, 44] and len(sampler) == 3


def test_scaler_state_is_reset_after_oom():
    class FakeScaler:
        def __init__(self):
            self._per_optimizer_states = {"opt": {"stage": "unscaled"}}

        def scale(self, loss):
            return loss * 4.0

    scaler = FakeScaler()
    model = torch.nn.Linear(3, 1)
    memory = SyntheticMemory(0, 1, 4)
    ctl = BatchSizeController(8, model=model, probe=memory, scaler=scaler, margin=0.0)
    ctl.run(lambda mb: (memory.use(mb.shape[0]), model(mb).sum())[1], torch.randn(8, 3))
    assert dict(scaler._per_optimizer_states) == {}
    assert ctl.micro_batch == 4 and ctl.ooms == 1


def test_bad_arguments_name_the_problem():
    with pytest.raises(ValueError, match="global_batch"):
        BatchSizeController(0)
    with pytest.raises(ValueError, match="quantum"):
        BatchSizeController(8, quantum=0)
    with pytest.raises(ValueError, match="lr_rule"):
        BatchSizeController(8, lr_rule="cubic")
    with pytest.raises(TypeError, match="step function returned"):
        BatchSizeController(8, model=torch.nn.Linear(3, 1), probe=NullProbe()).run(lambda mb: "x", torch.randn(8, 3))


def test_margin_defaults_to_the_probes_and_can_be_given():
    from torchmem.batch import TorchmemProbe, TorchProbe
    model = torch.nn.Linear(2, 1)
    assert BatchSizeController(8, model=model, probe=TorchmemProbe()).margin == 0.01  # exact budget
    assert BatchSizeController(8, model=model, probe=TorchProbe()).margin == 0.05     # fragmentation unseen
    assert BatchSizeController(8, model=model, probe=NullProbe()).margin == 0.05
    assert BatchSizeController(8, model=model, probe=NullProbe(), margin=0.2).margin == 0.2
    for bad in (1.0, -0.1, "5%"):
        with pytest.raises(ValueError, match="margin must be None or a number in"):
            BatchSizeController(8, model=model, probe=NullProbe(), margin=bad)


def test_without_figures_it_grows_back_when_memory_frees_and_backs_off_while_it_does_not():
    # Learning from OOMs alone it settles at 8: 16 OOMs, and the grid has nothing between.
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 12)
    model = torch.nn.Linear(3, 1)
    grow_after = 10
    ctl = BatchSizeController(64, model=model, probe=NullProbe(), grow_after=grow_after, objective="largest")

    def step_fn(mb):
        memory.use(mb.shape[0])
        return model(mb).sum()

    def steps(n):
        for _ in range(n):
            ctl.run(step_fn, torch.randn(64, 3))
            model.zero_grad(set_to_none=True)

    steps(1)
    assert ctl.micro_batch == 8
    # Memory stays tight: it probes 16 again, each probe OOMs, is retried at 8, and
    # the wait before the next probe grows 4x (hysteresis).
    ooms = memory.ooms
    steps(grow_after * (1 + 4 + 16))
    probes = [e["step"] for e in ctl.events if e["event"] == "grow"]
    assert [b - a for a, b in zip([0] + probes, probes)] == [grow_after, 4 * grow_after, 16 * grow_after]
    assert memory.ooms - ooms == len(probes) and ctl.micro_batch == 8
    # Memory frees: the next probe holds and it grows back to the whole batch, OOM-free.
    memory.budget = 1000 + 100 * 64
    ooms = memory.ooms
    steps(64 * grow_after + 6 * grow_after)
    assert ctl.micro_batch == 64 and ctl.accumulation_steps == 1
    assert memory.ooms == ooms


def test_a_budget_that_falls_inside_a_step_resplits_the_rest_without_an_oom():
    # Note [Shrinking inside a step]: a sharing owner claims memory back while a borrower's
    # step runs; the samples not yet run are split smaller, nothing is thrown away, and the
    # gradient is still the full batch's.
    torch.manual_seed(0)
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 32 + 50)
    model = torch.nn.Linear(3, 1)
    ctl = BatchSizeController(64, model=model, probe=memory, quantum=8, margin=0.0, objective="largest")
    fall_after = {"calls": None}

    def step_fn(micro_batch):
        memory.use(micro_batch.shape[0])
        if fall_after["calls"] is not None:
            fall_after["calls"] -= 1
            if fall_after["calls"] == 0:
                memory.budget = 1000 + 100 * 8 + 50  # an owner took memory back mid-step
        return model(micro_batch).square().mean()

    for _ in range(4):  # calibrate: the controller settles at 32 (two micro-steps)
        ctl.run(step_fn, torch.randn(64, 3))
        model.zero_grad(set_to_none=True)
    assert ctl.micro_batch == 32 and ctl.policy.memory_model.ready
    batch = torch.randn(64, 3)
    want = torch.autograd.grad(model(batch).square().mean(), list(model.parameters()))
    ooms, tried = memory.ooms, len(memory.sizes_tried)
    fall_after["calls"] = 1
    ctl.run(step_fn, batch)
    assert memory.ooms == ooms  # no OOM, no batch run again
    assert memory.sizes_tried[tried:] == [32, 8, 8, 8, 8]
    assert ctl.micro_batch == 8 and ctl.events[-1]["event"] == "shrink"
    for p, g in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, g)


def test_a_borrower_runs_micro_steps_short_enough_to_give_memory_back_fast(monkeypatch):
    # Note [Borrowed memory comes back fast]: a sharing process may use borrowed memory
    # only at sizes whose micro-step ends within _BORROWED_MICRO_STEP_S; sizes that fit its
    # guarantee are never capped.
    from torchmem.batch import controller as controller_module

    clock = {"now": 0.0}
    monkeypatch.setattr(controller_module.time, "perf_counter", lambda: clock["now"])
    seconds_per_sample = 0.01  # the "GPU" pace: a micro-step of 50 samples takes 0.5 s
    owned = 1000 + 100 * 16 + 50  # the guarantee fits micro 16
    memory = SyntheticMemory(1000, 100, 1000 + 100 * 256 + 50, owned=owned)
    model = torch.nn.Linear(3, 1)
    ctl = BatchSizeController(256, model=model, probe=memory, quantum=8, margin=0.0, objective="largest")

    def step_fn(micro_batch):
        memory.use(micro_batch.shape[0])
        clock["now"] += seconds_per_sample * micro_batch.shape[0]
        return model(micro_batch).square().mean()

    sizes = []
    for _ in range(8):
        ctl.run(step_fn, torch.randn(256, 3))
        model.zero_grad(set_to_none=True)
        sizes.append(ctl.micro_batch)
    # The first step ran the whole batch (nothing measured). After it no pace is known, so
    # nothing beyond the guarantee; once one is, sizes whose micro-step lasts <= 0.5 s.
    assert sizes[0] == 16
    assert any("no pace measured yet" in e["reason"] for e in ctl.events)
    assert sizes[-1] == 48  # the largest grid size whose micro-step lasts <= 0.5 s
    assert max(sizes[2:]) == 48 and memory.ooms == 0
    assert any("borrowed memory" in e["reason"] for e in ctl.events)

    memory.owned = 1000 + 100 * 128 + 50  # a larger guarantee: 128 fits it, so it is not capped
    for _ in range(3):
        ctl.run(step_fn, torch.randn(256, 3))
        model.zero_grad(set_to_none=True)
    assert ctl.micro_batch == 128

    memory.owned = None  # not sharing: no cap at all
    for _ in range(3):
        ctl.run(step_fn, torch.randn(256, 3))
        model.zero_grad(set_to_none=True)
    assert ctl.micro_batch == 256
