"""Note [Step plan] on the CPU: a training step that repeats, replayed through the
pool over the simulated device (events that complete late, as on a GPU), stops
costing driver calls and device barriers once warm, at every budget from its
smallest (min-cap) + 2% upwards and with no budget; what a plan cannot cover is
served as before; invariants hold throughout."""

import numpy as np
import pytest

from torchmem.analysis import patterns, replay
from torchmem._loader import _C

from sim_pool import STITCHING, MiB, make_pool

STEPS = 10
LAG = 10  # polls a simulated event stays pending: the GPU runs behind the host
# A plan is learnt once the pool stitches (or waits for the device): the plan's own tests run
# STITCHING, since the defaults keep these steps quiet under a limit with no plan at all.


def events_of(**kwargs):
    return np.asarray(patterns.training_steps(STEPS, **kwargs), dtype=np.int64)


def run(events, limit=0, stop_at=-1, **config):
    cfg = replay.pool_config(",".join(f"{k}={v}" for k, v in config.items()) or None)
    return _C.replay(events, "torchmem", pool_config=cfg, limit=limit, capacity=140 << 30, event_delay=LAG,
                     stop_at=stop_at)


def min_cap(events, **config):
    cfg = ",".join(f"{k}={v}" for k, v in config.items()) or None
    return replay.find_min_cap(events, "torchmem", config=cfg, event_delay=LAG)["min_cap"]


def driver_calls(result):
    c = result["backend_calls"]
    return c["create_calls"] + c["map_calls"] + c["unmap_calls"] + c["release_calls"]


def last_steps_cost(events, limit, steps=2, **config):
    """Driver calls and device barriers of the last `steps` steps, and the whole run."""
    step_len = (len(events) - 3 * 24) // STEPS  # after the parameters and optimizer states
    start = len(events) - steps * step_len
    before, after = run(events, limit, stop_at=start - 1, **config), run(events, limit, **config)
    return driver_calls(after) - driver_calls(before), after["device_barriers"] - before["device_barriers"], after


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("above_min_cap", [None, 1.02, 1.05, 1.10])
def test_a_repeating_step_makes_no_driver_call_once_warm(seed, above_min_cap):
    events = events_of(seed=seed)
    limit = 0
    if above_min_cap:
        limit = int(replay.find_min_cap(events, "torchmem", event_delay=LAG)["min_cap"] * above_min_cap)
    calls, barriers, whole = last_steps_cost(events, limit)
    assert whole["ooms"] == 0
    assert (calls, barriers) == (0, 0), f"seed {seed}, budget {above_min_cap}: {calls} calls, {barriers} barriers"
    if above_min_cap == 1.02:  # memory is the limit: a pool that stitches holds by a plan
        limit = int(min_cap(events, **STITCHING) * above_min_cap)
        calls, barriers, whole = last_steps_cost(events, limit, **STITCHING)
        assert (calls, barriers, whole["ooms"]) == (0, 0, 0)
        assert whole["plans"] >= 1 and whole["plan_hits"] > 0


def test_min_cap_is_not_raised_by_planning():
    for seed in range(3):
        events = events_of(seed=seed)
        planned = replay.find_min_cap(events, "torchmem", event_delay=LAG)["min_cap"]
        online = replay.find_min_cap(events, "torchmem", config="step_plan=false", event_delay=LAG)["min_cap"]
        assert planned <= online, seed


def test_without_a_plan_the_same_step_keeps_paying():
    """What the plan is for: step_plan=false at the same budget moves granules every step."""
    events = events_of(seed=2)
    limit = int(min_cap(events, **STITCHING) * 1.02)
    calls, _, _ = last_steps_cost(events, limit, step_plan="false", **STITCHING)
    assert calls > 0


def test_gradient_accumulation_is_one_cycle():
    """Micro-steps and the optimizer step together repeat: the plan covers the whole cycle."""
    events = np.asarray(patterns.training_steps(8, layers=12, seed=4, micro_steps=4), dtype=np.int64)
    limit = int(min_cap(events, **STITCHING) * 1.05)
    step_len = (len(events) - 3 * 12) // 8
    before = run(events, limit, stop_at=len(events) - 2 * step_len - 1, **STITCHING)
    after = run(events, limit, **STITCHING)
    assert after["ooms"] == 0 and after["plans"] >= 1
    assert after["backend_calls"]["map_calls"] == before["backend_calls"]["map_calls"]
    assert after["device_barriers"] == before["device_barriers"]


@pytest.mark.parametrize("budget", [None, 1.10])
def test_a_side_stream_takes_no_barrier_once_warm(budget):
    """FSDP-like: weights gathered on a stream of their own. Streams hand memory over
    with a device-side wait, online and in the plan's arena (Note [Reuse behind a stream
    wait]), so no step needs a device barrier, with or without a budget."""
    events = events_of(seed=1, side_stream=7)
    limit = int(replay.find_min_cap(events, "torchmem", event_delay=LAG)["min_cap"] * budget) if budget else 0
    calls, barriers, whole = last_steps_cost(events, limit)
    assert whole["ooms"] == 0
    assert (calls, barriers) == (0, 0)


def test_a_plan_whose_windows_need_a_barrier_is_learnt_again():
    """Note [Step plan arena]: a plan in force takes no device barrier. Sixteen micro-steps with a
    side stream at 1.02x min-cap once settled into a plan that missed two requests a step, each
    served online behind the OOM ladder's barrier: too few misses to drop it, so a barrier every
    step for good. A window that needed a barrier does not hold; the plan learnt again is quiet."""
    events = np.asarray(patterns.training_steps(20, layers=12, seed=2, side_stream=7, micro_steps=16), dtype=np.int64)
    limit = int(min_cap(events) * 1.02)
    half, whole = run(events, limit, stop_at=len(events) // 2 - 1), run(events, limit)
    assert whole["ooms"] == 0
    assert (driver_calls(whole) - driver_calls(half), whole["device_barriers"] - half["device_barriers"]) == (0, 0)


@pytest.mark.parametrize("micro_steps, seed", [(1, 1), (8, 2)])
def test_a_plan_adopted_while_the_last_layout_is_still_backed_is_kept(micro_steps, seed):
    """Note [Lent arena cache]: right after adoption the arena backs its ranges as they are first
    used while the blocks placed before it still hold theirs. At 1.02x min-cap, with a side
    stream, their sum passed the budget and the OOM ladder gave each plan up within a few hundred
    requests, again and again. The arena lends its free granules to the ladder in the plan's
    first window (Note [When the arena lends]); the plan is kept and the run's second half is quiet."""
    events = np.asarray(patterns.training_steps(20, layers=12, seed=seed, side_stream=7, micro_steps=micro_steps),
                        dtype=np.int64)
    limit = int(min_cap(events) * 1.02)
    half, whole = run(events, limit, stop_at=len(events) // 2 - 1), run(events, limit)
    assert whole["ooms"] == 0
    assert (driver_calls(whole) - driver_calls(half), whole["device_barriers"] - half["device_barriers"]) == (0, 0)


def test_shapes_that_change_are_served_and_planned_again():
    """A new model mid-run: the plan in force misses and is dropped; the new steps are
    served, and once they repeat they cost nothing again. A budget the online layout
    fits, the planned run fits too."""
    first = patterns.training_steps(8, layers=12, seed=5)
    second = patterns.training_steps(8, layers=12, seed=6)
    offset = max(row[1] for row in first) + 1
    # the second model's steps after the first's (its own parameters added on top)
    events = np.asarray(first + [(a, addr + offset, size, s) for a, addr, size, s in second], dtype=np.int64)
    online = replay.find_min_cap(events, "torchmem", config="step_plan=false", event_delay=LAG)["min_cap"]
    limit = int(online * 1.03)
    planned = run(events, limit)
    assert planned["ooms"] == 0
    assert planned["plans"] >= 1
    step_len = (len(second) - 3 * 12) // 8
    before = run(events, limit, stop_at=len(events) - 2 * step_len - 1)
    assert planned["backend_calls"]["map_calls"] == before["backend_calls"]["map_calls"]
    assert planned["device_barriers"] == before["device_barriers"]


def test_invariants_hold_while_planning():
    events = events_of(seed=3)
    limit = int(min_cap(events, **STITCHING) * 1.02)
    result = run(events, limit, debug_checks="true", **STITCHING)  # check_invariants() after every operation
    assert result["ooms"] == 0 and result["plans"] >= 1


def run_steps(pool, events, live):
    for action, addr, size, stream in events:
        if action == 0:
            live[addr] = pool.allocate(size, stream)
            assert live[addr], "no OOM at 1.02x min-cap"
        else:
            pool.free(live.pop(addr))


def pool_with_plan(**config):
    """A simulated pool that ran a repeating step at 1.02x its min-cap (a plan in force)."""
    pool, limit, _ = pool_with_plan_and_steps(**config)
    return pool, limit


def pool_with_plan_and_steps(**config):
    """pool_with_plan, and the events that ran (each step allocates and frees the same)."""
    events = patterns.training_steps(6, layers=8, seed=7)
    limit = int(replay.find_min_cap(np.asarray(events, dtype=np.int64), "torchmem", event_delay=LAG)["min_cap"] * 1.02)
    pool = make_pool(limit=limit, trace_capacity=0, capacity=140 << 30, event_delay=LAG, debug_checks=True, **config)
    run_steps(pool, events, {})
    return pool, limit, events


def test_a_plan_forms_in_a_pool_and_empty_cache_gives_its_memory_back():
    pool, _ = pool_with_plan()
    stats = pool.stats()
    assert stats["num_plans"] >= 1 and stats["num_plan_hits"] > 0
    reserved = stats["reserved_bytes"]["all"]["current"]
    assert pool.release_cached() > 0
    stats = pool.stats()
    assert stats["num_plan_drops"] >= 1  # empty_cache ends the plan: its arena's cache goes too
    assert stats["reserved_bytes"]["all"]["current"] < reserved
    pool.check_invariants()  # raises naming the first violation


def test_a_lower_budget_ends_the_plan():
    pool, limit = pool_with_plan()
    drops = pool.stats()["num_plan_drops"]
    pool.set_limit(limit - 2 * MiB)
    assert pool.stats()["num_plan_drops"] == drops + 1
    addr = pool.allocate(24 * MiB)
    pool.free(addr)
    pool.check_invariants()  # raises naming the first violation


def test_a_wholly_mapped_arena_counts_again_and_fences_its_frees_when_its_plan_ends():
    """Note [Lazy pins]: once the plan's warm-up has mapped its footprint, its blocks stop moving
    per-granule counts; when the plan ends the counts are made again (check_invariants after
    every operation) and the granules freed meanwhile carry the latest such free's fence: after
    a device barrier and one more step on stream 0, another stream takes them only behind a new
    barrier (what they held before that step was freed before the first one)."""
    pool, limit, events = pool_with_plan_and_steps()
    assert pool.stats()["num_lazy_pins"] >= 1
    # A device barrier while the plan is in force: a private pool's cache given back.
    pool.create_private_pool(5)
    pool.free(pool.allocate(4 * MiB, stream=3, pool=5))
    pool.release_private_pool(5)
    pool.release_pool_cache(5)
    barriers = pool.stats()["num_device_barriers"]
    assert barriers > 0
    step = (len(events) - 3 * 8) // 6  # training_steps: 8 parameters and their two states, then six steps alike
    run_steps(pool, events[-step:], {})  # lazily freed, after the barrier
    assert pool.stats()["num_plan_drops"] == 0
    pool.set_limit(limit - 2 * MiB)  # ends the plan: its arena thaws
    addr = pool.allocate(limit // 2, stream=9)  # only the cache can back it, freed on stream 0
    assert addr
    assert pool.stats()["num_device_barriers"] > barriers
    pool.free(addr)
    pool.check_invariants()


def test_step_plan_off_never_plans():
    pool, _ = pool_with_plan(step_plan=False)
    assert pool.stats()["num_plans"] == 0


@pytest.mark.parametrize("name,steps", [("gpt2_train", (10, 11)), ("gpt2_train", (5, 40)),
                                        ("llama_ckpt_train", (3, 30))])
@pytest.mark.parametrize("budget", [1.02, 1.05])
def test_real_steps_that_repeat_make_no_driver_call_once_planned(name, steps, budget):
    """Two real steps of a bundled H200 trace (different batch and sequence shapes), taking
    turns, ten times: once planned, the last two make no driver call and take no barrier."""
    from torchmem.analysis import trace as trace_io

    rows = patterns.repeated_steps(trace_io.load(trace_io.bundled_trace(name)).events.tolist(), steps, 10)
    events = np.asarray(rows, dtype=np.int64)
    _, bounds = patterns.step_boundaries(rows)
    start = bounds[-3] + 1  # the last two steps
    peak = run(events)["peak_requested"]
    limit = int(peak * budget)
    for config in ({}, STITCHING):  # quiet by backed placement, and by a plan where the pool stitches
        before, after = run(events, limit, stop_at=start - 1, **config), run(events, limit, **config)
        assert after["ooms"] == 0 and (after["plans"] >= 1 or not config)
        assert driver_calls(after) - driver_calls(before) == 0, config
        assert after["device_barriers"] == before["device_barriers"], config


@pytest.mark.parametrize("name,steps", [("gpt2_train", (10, 11, 20, 30)), ("llama_ckpt_train", (3, 30, 10, 11))])
def test_a_cycle_of_four_real_shapes_is_planned_whole(name, steps):
    """A data loader cycling through four batch shapes: the cycle (four steps) is what repeats.
    The plan's window takes about three cycles to close and one more to back the arena; the
    last cycle then makes no driver call and takes no barrier at 1.05x the peak request."""
    from torchmem.analysis import trace as trace_io

    rows = patterns.repeated_steps(trace_io.load(trace_io.bundled_trace(name)).events.tolist(), steps, 20)
    events = np.asarray(rows, dtype=np.int64)
    _, bounds = patterns.step_boundaries(rows)
    start = bounds[-5] + 1  # the last four steps: one whole cycle
    limit = int(run(events)["peak_requested"] * 1.05)
    for config in ({}, STITCHING):  # quiet by backed placement, and by a plan where the pool stitches
        before, after = run(events, limit, stop_at=start - 1, **config), run(events, limit, **config)
        assert after["ooms"] == 0 and (after["plans"] >= 1 or not config)
        calls = driver_calls(after) - driver_calls(before)
        assert (calls, after["device_barriers"] - before["device_barriers"]) == (0, 0), config


def test_every_planning_pass_is_counted_with_its_host_time():
    """Note [Planning pass cost]: a pass shows in the stats whether or not its plan was adopted."""
    events = events_of(seed=0)
    limit = int(min_cap(events, **STITCHING) * 1.02)
    whole = run(events, limit, **STITCHING)
    assert whole["plans"] >= 1
    assert whole["plan_passes"] >= whole["plans"]
    assert whole["plan_pass_us"] > 0  # a window of ~10 steps of 24 layers takes milliseconds to plan
    # No pressure, no recording, no pass.
    assert run(events)["plan_passes"] == 0
    # The pool's own stats carry both counters (torchmem.memory_stats() reads them).
    pool = make_pool(limit=64 * MiB)
    assert {"num_plan_passes", "plan_pass_us"} <= set(pool.stats())


def real_fsdp_steps(repeats=8, trace="fsdp_train"):
    """A bundled FSDP2 trace (the all-gathers on a stream of their own) run `repeats` steps
    longer; returns the events and one step's length."""
    from torchmem.analysis import trace as trace_io

    rows, period = patterns.repeat_last_step(trace_io.load(trace_io.bundled_trace(trace)).events, repeats)
    return np.asarray(rows, dtype=np.int64), period


def last_steps_of_real_trace(events, period, budget, steps=2, **config):
    """The replays up to `steps` steps before the end and to the end, under `budget` x the
    peak request (None: no limit), and the driver calls and barriers between them."""
    limit = int(run(events)["peak_requested"] * budget) if budget else 0
    before = run(events, limit, stop_at=len(events) - steps * period - 1, **config)
    after = run(events, limit, **config)
    return driver_calls(after) - driver_calls(before), after["device_barriers"] - before["device_barriers"], before, after


@pytest.mark.parametrize("budget", [None, 1.02, 1.05, 1.10])
def test_real_fsdp_steps_make_no_driver_call_once_planned(budget):
    """FSDP2 on an H200: every request of a step gets a place in one layout across both
    streams; the last two steps make no driver call and take no barrier, and hand the
    gathered weights' ranges between the streams with a few device-side waits (at most
    two per side-stream block: its range handed to it, and back) instead."""
    events, period = real_fsdp_steps()
    calls, barriers, before, after = last_steps_of_real_trace(events, period, budget)
    start = len(events) - 2 * period
    # unconstrained, the online layout holds by itself (streams hand memory over with
    # waits, Note [Cross-stream reuse]): no pressure, so no plan is needed; under a limit
    # a plan forms where the pool stitched (1.02-1.05x), and at 1.10x backed placement
    # needs none
    assert after["ooms"] == 0
    assert (calls, barriers) == (0, 0)
    side_requests = sum(1 for action, _a, _s, stream in events[start:] if action == 0 and stream != 0)
    waits = after["backend_calls"]["stream_wait_calls"] - before["backend_calls"]["stream_wait_calls"]
    assert side_requests > 0 and waits <= 2 * side_requests


def test_a_plan_that_does_not_fit_beside_what_stays_is_not_adopted():
    """Blocks named in the window but live since before its last cycle (optimizer state
    made there) keep their place outside the arena: the fit check counts them as staying,
    so a plan adopted under a budget holds (none dropped) instead of failing mid-step."""
    events, period = real_fsdp_steps(repeats=8)
    calls, _, before, result = last_steps_of_real_trace(events, period, 1.02, **STITCHING)
    assert result["ooms"] == 0
    assert (result["plans"], result["plan_drops"]) == (1, 0)
    # it misses while it settles in; then at most one request a step, served from the cache
    assert result["plan_misses"] - before["plan_misses"] <= 2
    assert calls == 0


def test_a_refused_handover_leaves_the_range_to_its_stream():
    """While a stream captures, the backend cannot order one stream after another
    (order_streams refuses): the arena then serves the request elsewhere rather than
    hand another stream's freed range over unordered."""
    from torchmem._loader import _C

    events = patterns.training_steps(8, layers=8, seed=4, side_stream=7)
    backend = _C.SimBackend(capacity=140 << 30, granularity=2 * MiB, vmm=True, event_delay=LAG)
    # online, every handover is a barrier (stream_order off): pressure, so a plan is made
    pool = _C.Pool(backend, {"trace_capacity": 0, "debug_checks": True, "stream_order": False})
    live, half = {}, len(events) // 2
    for i, (action, addr, size, stream) in enumerate(events):
        if i == half:
            assert pool.stats()["num_plans"] >= 1
            waits = backend.counters()["stream_wait_calls"]
            misses = pool.stats()["num_plan_misses"]
            backend.allow_stream_order(False)
        if action == 0:
            live[addr] = pool.allocate(size, stream)
            assert live[addr]
        else:
            pool.free(live.pop(addr))
    assert backend.counters()["stream_wait_calls"] == waits
    assert pool.stats()["num_plan_misses"] > misses
    pool.check_invariants()


@pytest.mark.parametrize("budget", [None, 1.02, 1.05, 1.10])
def test_real_fsdp_with_gradient_accumulation_settles(budget):
    """FSDP2 with 32 micro-batches a step (the bundled fsdp_accum trace, recorded on an
    H200): the all-gather stream's few frees sit between the compute stream's. Merged into
    one free block they used to fence it off from both streams until a device barrier,
    about 400 a step with no budget at all. Now a tag behind a barrier no longer taints a
    merge, and a fit another stream freed is taken behind a device-side wait: once warm,
    no driver call and no barrier, with or without a budget."""
    events, period = real_fsdp_steps(6, "fsdp_accum")
    calls, barriers, _, after = last_steps_of_real_trace(events, period, budget)
    assert after["ooms"] == 0
    assert (calls, barriers) == (0, 0)


def test_names_that_turn_over_every_two_steps_are_planned_as_one():
    """Note [Names that turn over]: in fsdp_accum a 512 KiB tensor lives one step and two
    requests, so its copies take sub-slots 0 and 1 in turn. At 1.06x a whole-step plan saw
    one name only live at its window's start and the other only at its end; the first name's
    next copy took a range planned for a 250 MiB request and the OOM ladder gave the plan up
    two steps later (not quiet before step 10 of 16). Planned as one, the plan holds."""
    events, period = real_fsdp_steps(13, "fsdp_accum")
    calls, barriers, _, after = last_steps_of_real_trace(events, period, 1.06, steps=9)
    assert after["ooms"] == 0
    assert (calls, barriers) == (0, 0)


def test_with_no_limit_a_failed_plan_is_not_learnt_again_until_empty_cache():
    """Note [Step plan arena]: a dropped arena's cache is stitched away only when memory is
    short, which with no limit means a full device. A plan learnt again after every drop
    stranded an arena's worth each time (FSDP with 32 micro-batches and stream_order off:
    1.25 GiB more every two steps). With no limit one failed plan is the last, until the
    cache is emptied or a limit is set."""
    events, period = real_fsdp_steps(6, "fsdp_accum")
    early = run(events, stop_at=4 * period - 1, stream_order=False)
    late = run(events, stream_order=False)
    assert late["ooms"] == 0 and late["plans"] == early["plans"] == 1
    assert late["peak_reserved"] == early["peak_reserved"]


def test_empty_cache_lets_a_plan_given_up_with_no_limit_be_learnt_again():
    """The same FSDP steps as above through a Pool: the plan given up stays off through
    more steps, and after release_cached (empty_cache) the pool learns one again."""
    from torchmem._loader import _C

    rows, period = real_fsdp_steps(8, "fsdp_accum")
    backend = _C.SimBackend(capacity=140 << 30, granularity=2 * MiB, vmm=True, event_delay=LAG)
    pool = _C.Pool(backend, {"trace_capacity": 0, "stream_order": False})
    live = {}
    for i, (action, addr, size, stream) in enumerate(rows):
        if i == 6 * period:
            given_up = pool.stats()
            assert given_up["num_plans"] == 1 and given_up["num_plan_drops"] == 1
            pool.release_cached()
        if action == 0:
            live[addr] = pool.allocate(size, stream)
            assert live[addr]
        else:
            pool.free(live.pop(addr))
    assert pool.stats()["num_plans"] > 1
    pool.check_invariants()


def test_host_time_is_counted_only_when_asked():
    """Note [Host time]: time_host_ops counts the pool's host time per allocate and free, the
    plan's part inside it; off (the default), the counters stay at zero."""
    timed, _ = pool_with_plan(time_host_ops=True)
    stats = timed.stats()
    assert stats["num_plan_hits"] > 0
    assert stats["host_alloc_ns"] > 0 and stats["host_free_ns"] > 0
    # The plan's part is inside the two totals.
    assert 0 < stats["host_plan_ns"] < stats["host_alloc_ns"] + stats["host_free_ns"]
    untimed, _ = pool_with_plan()
    stats = untimed.stats()
    assert (stats["host_alloc_ns"], stats["host_free_ns"], stats["host_plan_ns"]) == (0, 0, 0)


def test_a_repeating_step_is_named_without_hash_lookups_once_followed():
    """Note [Naming on the host]: the history of names predicts every request of a step that
    repeats (a real Llama step, its layers' items recurring with different successors): the last
    steps make no hash lookup at all, where the first cycle makes one per new item."""
    from torchmem.analysis import trace as trace_io

    rows = patterns.repeated_steps(trace_io.load(trace_io.bundled_trace("llama_ckpt_train")).events.tolist(),
                                   (10,), 8)
    events = np.asarray(rows, dtype=np.int64)
    limit = int(run(events)["peak_requested"] * 1.10)
    pool = make_pool(limit=limit, trace_capacity=0, capacity=140 << 30, event_delay=LAG, **STITCHING)
    live, lookups = {}, {}
    marks = {len(rows) * 3 // 4, len(rows) - 1}  # the last quarter: more than one whole step
    for i, (action, addr, size, stream) in enumerate(rows):
        if action == 0:
            live[addr] = pool.allocate(size, stream)
            assert live[addr]
        else:
            pool.free(live.pop(addr))
        if i in marks:
            lookups[i] = pool.stats()["num_plan_lookups"]
    stats = pool.stats()
    assert stats["num_plans"] >= 1 and stats["num_plan_hits"] > 0
    first, last = sorted(lookups)
    assert lookups[first] > 0  # the first cycle was looked up
    assert lookups[last] == lookups[first]  # the last steps: none
