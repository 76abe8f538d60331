"""Synthetic allocation patterns: (size, slot) sequences that replace one of a
fixed set of live tensors per step, as the churn microbenchmark (bench/) runs
them on a GPU and the replay tests run them on the CPU.

Why: the bundled traces are training steps; an allocator must also not pay
driver calls forever on patterns they do not show (issue: "No cliffs").

- `random`: log-uniform sizes 512 B .. 16 MiB, a random slot each step.
- `periodic`: a fixed cycle of mixed sizes, slots round-robin (a loop body).
- `bimodal`: mostly small tensors, one in 50 a huge one (activations vs buffers).
- `kv_cache`: sequences that grow a cache by one block per step up to a length,
  then drop it and start over (generation with a growing KV cache).
"""

import math
import random

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
    """The pattern as a trace (rows of action, address, size, stream; torchmem.trace's
    codes): `live` initial allocations, then per step one alloc and the free of the
    tensor it replaces (freed after the new one exists, as `live[slot] = empty(...)` does)."""
    from torchmem.trace import ALLOC, FREE_REQUESTED

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
