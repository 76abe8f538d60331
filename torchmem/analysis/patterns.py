"""Synthetic allocation patterns: (size, slot) sequences that replace one of a
fixed set of live tensors per step, as the churn microbenchmark (bench/) runs
them on a GPU and the replay tests run them on the CPU.

Why: the bundled traces are training steps; an allocator must also not pay
driver calls forever on patterns they do not show (no cliffs).

- `random`: log-uniform sizes 512 B .. 16 MiB, a random slot each step.
- `periodic`: a fixed cycle of mixed sizes, slots round-robin (a loop body).
- `bimodal`: mostly small tensors, one in 50 a huge one (activations vs buffers).
- `kv_cache`: sequences that grow a cache by one block per step up to a length,
  then drop it and start over (generation with a growing KV cache).

`training_steps` is another kind: whole training steps with the same shapes every
time (a model's parameters and optimizer state, then per step a forward that saves
activations, a backward that frees them and makes gradients, an optimizer step),
as a trace, to hold Note [Step plan] on the CPU: a step that repeats must stop
costing driver calls and device barriers once warm, at any budget it fits.
"""

import math
import random

import numpy as np

from torchmem.analysis.trace import ALLOC, FREE_REQUESTED

PATTERNS = ("random", "periodic", "bimodal", "kv_cache")
MiB = 1 << 20


def sizes_and_slots(pattern, steps, live=64, seed=0):
    """Two lists of `steps` ints: the size of each new tensor and the slot (0..live-1)
    of the live tensor it replaces. Raises ValueError for an unknown pattern."""
    rng = random.Random(seed)
    if pattern == "random":
        low, high = math.log(512), math.log(16 * MiB)
        sizes = [int(math.exp(rng.uniform(low, high))) for _ in range(steps)]
        slots = [rng.randrange(live) for _ in range(steps)]
    elif pattern == "periodic":
        cycle = [int(math.exp(rng.uniform(math.log(512), math.log(16 * MiB)))) for _ in range(live)]
        sizes = [cycle[i % live] for i in range(steps)]
        slots = [i % live for i in range(steps)]
    elif pattern == "bimodal":
        sizes = [rng.randrange(256 * MiB, 512 * MiB) if rng.random() < 0.02 else rng.randrange(512, 256 << 10)
                 for _ in range(steps)]
        slots = [rng.randrange(live) for _ in range(steps)]
    elif pattern == "kv_cache":
        # `live` caches grow in turn by 2 MiB per step to 64 steps, then restart.
        sizes, slots, length = [], [], [0] * live
        for i in range(steps):
            slot = i % live
            length[slot] = length[slot] + 1 if length[slot] < 64 else 1
            sizes.append(length[slot] * 2 * MiB)
            slots.append(slot)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; expected one of {', '.join(PATTERNS)}")
    return sizes, slots


def replay_events(pattern, steps, live=64, seed=0):
    """The pattern as a trace (rows of action, address, size, stream; torchmem.analysis.trace's
    codes): `live` initial allocations, then per step one alloc and the free of the
    tensor it replaces (freed after the new one exists, as `live[slot] = empty(...)` does)."""

    sizes, slots = sizes_and_slots(pattern, steps + live, live, seed)
    events, owner, next_addr = [], [None] * live, 1
    for slot in range(live):
        owner[slot] = (next_addr, sizes[slot])
        events.append((ALLOC, next_addr, sizes[slot], 0))
        next_addr += 1
    for size, slot in zip(sizes[live:], slots[live:]):
        events.append((ALLOC, next_addr, size, 0))
        old_addr, old_size = owner[slot]
        events.append((FREE_REQUESTED, old_addr, old_size, 0))
        owner[slot] = (next_addr, size)
        next_addr += 1
    return events


def training_steps(steps, layers=24, seed=0, side_stream=None, micro_steps=1):
    """A trace (rows of action, address, size, stream) of `steps` optimizer steps of a
    made-up model of `layers` layers whose shapes are drawn once from `seed`: each
    layer has a parameter (1-80 MiB), 2-5 activations saved for backward (256 KiB -
    200 MiB) and 1-3 temporaries (4 KiB - 300 MiB). Parameters and two optimizer
    states per parameter are allocated first and stay. Each optimizer step runs
    `micro_steps` forward/backward passes (gradient accumulation: gradients made in
    the first backward, kept until the optimizer step), then one temporary per
    parameter, then frees the gradients (zero_grad(set_to_none=True)).
    `side_stream` (a stream id): each layer's gathered weights (twice the parameter)
    are allocated and freed on that stream around its forward and backward, as FSDP
    gathers sharded parameters on a stream of its own."""

    rng = random.Random(seed)

    def draw(low, high):
        return int(math.exp(rng.uniform(math.log(low), math.log(high)))) // 512 * 512 + rng.randrange(512)

    params = [draw(1 * MiB, 80 * MiB) for _ in range(layers)]
    saved = [[draw(256 << 10, 200 * MiB) for _ in range(rng.randrange(2, 6))] for _ in range(layers)]
    temps = [[draw(4 << 10, 300 * MiB) for _ in range(rng.randrange(1, 4))] for _ in range(layers)]
    events, next_addr = [], [1]

    def alloc(size, stream=0):
        addr = next_addr[0]
        next_addr[0] += 1
        events.append((ALLOC, addr, size, stream))
        return addr, size, stream

    def free(block):
        events.append((FREE_REQUESTED, *block))

    def gathered(layer):
        return alloc(2 * params[layer], side_stream) if side_stream is not None else None

    for size in params + params + params:  # parameters, then two optimizer states each
        alloc(size)
    for _ in range(steps):
        grads = None
        for _ in range(micro_steps):
            kept = []
            for layer in range(layers):
                weights = gathered(layer)
                scratch = [alloc(size) for size in temps[layer]]
                kept.append([alloc(size) for size in saved[layer]])
                for block in scratch:
                    free(block)
                if weights:
                    free(weights)
            loss = alloc(512)
            made = []
            for layer in reversed(range(layers)):
                weights = gathered(layer)
                scratch = [alloc(size) for size in temps[layer]]
                if grads is None:
                    made.append(alloc(params[layer]))
                for block in scratch:
                    free(block)
                for block in reversed(kept[layer]):
                    free(block)
                if weights:
                    free(weights)
            free(loss)
            if grads is None:
                grads = made
        for layer in range(layers):
            free(alloc(params[layer]))
        for block in grads:
            free(block)
    return events


def step_boundaries(events):
    """Indices of a training trace's alloc/free rows (action 0/1 only, in order) where one step
    ends: the live bytes, having risen above 1.3x their floor (parameters and optimizer state,
    the lowest live bytes in the middle 80% of the trace), come back to within 1% of it."""

    rows = [e for e in events if e[0] in (0, 1)]
    live, current, curve = {}, 0, np.zeros(len(rows), dtype=np.int64)
    for i, (action, addr, size, _stream) in enumerate(rows):
        if action == 0:
            live[addr] = size
            current += size
        else:
            current -= live.pop(addr, 0)
        curve[i] = current
    floor = curve[len(rows) // 10:len(rows) * 9 // 10].min()
    bounds, high = [], False
    for i, value in enumerate(curve):
        if value > floor * 1.3:
            high = True
        elif high and value <= floor * 1.01:
            bounds.append(i)
            high = False
    return rows, bounds


def repeated_steps(events, steps, repeats):
    """A trace that runs a real trace's set-up, then its steps `steps` (indices into its steps,
    step_boundaries) in turn `repeats` times, each time at fresh addresses: a step that repeats
    with real shapes (a data loader cycling through a few batch shapes). A block a step leaves
    live is freed at its end, as the next step's zero_grad or loss would."""
    rows, bounds = step_boundaries(events)
    prefix = rows[:bounds[0] + 1]
    setup_live = {}
    for action, addr, size, _stream in prefix:
        if action == 0:
            setup_live[addr] = size
        else:
            setup_live.pop(addr, None)
    out = list(prefix)
    next_addr = max(row[1] for row in rows) + 1
    for r in range(repeats):
        k = steps[r % len(steps)]
        mapping = {}
        for action, addr, size, stream in rows[bounds[k] + 1:bounds[k + 1] + 1]:
            if action == 0:
                mapping[addr] = next_addr
                out.append((0, next_addr, size, stream))
                next_addr += 1
            elif addr in mapping:
                out.append((1, mapping.pop(addr), size, stream))
            elif addr in setup_live:
                out.append((1, addr, setup_live.pop(addr), stream))
        out.extend((1, new, 0, 0) for new in mapping.values())
    return out


def repeat_last_step(events, repeats, min_period=64):
    """A real trace whose last step repeats the one before it exactly (fixed shapes: the
    same requests in the same order) run `repeats` steps longer: its last step appended
    again and again, at fresh addresses. A free of a block the step before made (a
    gradient kept across steps) frees that step's copy. Returns (rows, period): the
    trace's alloc/free rows with the copies, and one step's rows.
    ValueError when the last step does not repeat the one before it."""
    rows = [tuple(int(v) for v in e) for e in events if e[0] in (ALLOC, FREE_REQUESTED)]
    n = len(rows)
    shape = [(action, size, stream) for action, _addr, size, stream in rows]
    period = next((p for p in range(min_period, n // 2 + 1) if shape[n - p:] == shape[n - 2 * p:n - p]), None)
    if period is None:
        raise ValueError("repeat_last_step: the trace's last step does not repeat the one before it")
    start, before = n - period, n - 2 * period
    live, freed = {}, {}  # freed: row index of a free -> row index of its alloc
    for i, (action, addr, _size, _stream) in enumerate(rows):
        if action == ALLOC:
            live[addr] = i
        elif addr in live:
            freed[i] = live.pop(addr)
    for i in range(start, n):
        if rows[i][0] == FREE_REQUESTED and freed.get(i, -1) < before:
            raise ValueError(f"repeat_last_step: row {i} frees a block older than the step before")
    out = list(rows)
    previous = {j - start: rows[j][1] for j in range(start, n) if rows[j][0] == ALLOC}
    next_addr = max(addr for _a, addr, _s, _st in rows) + 1
    for _ in range(repeats):
        current = {}
        for i in range(start, n):
            action, _addr, size, stream = rows[i]
            if action == ALLOC:
                current[i - start] = next_addr
                out.append((ALLOC, next_addr, size, stream))
                next_addr += 1
            else:
                j = freed[i]
                addr = current[j - start] if j >= start else previous[j - before]
                out.append((FREE_REQUESTED, addr, size, stream))
        previous = current
    return out, period
