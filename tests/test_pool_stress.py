"""Multi-threaded stress on a host-memory sim backend (after mimalloc's test-stress).

Eight Python threads allocate seeded random sizes (rarely huge), write a
cookie pattern derived from the address and a per-block seed, hand some
blocks to other threads through queues, and check the pattern before every
free. Pool calls release the GIL, so the threads really run concurrently;
overlapping blocks or a granule remapped under a live block would corrupt a
cookie. Patterns cover the first and last 4 KiB of each block (and all of it
for small blocks) to keep the run short."""

import queue
import random
import threading

import pytest

from block_cookies import ends_intact, write_ends
from torchmem._loader import _C

MiB = 1 << 20
THREADS = 8
STEPS = 4000


# vmm_lagging: fences stay pending for many polls, so granules are stitched by
# alias reclaim (Note [Alias reclaim]) while their old places await unmapping.
@pytest.mark.parametrize("vmm, delay", [(True, 1), (False, 1), (True, 50)],
                         ids=["vmm", "cuda_malloc", "vmm_lagging"])
def test_threads_share_a_pool(vmm, delay):
    sim = _C.SimBackend(capacity=768 * MiB, vmm=vmm, host_memory=True, event_delay=delay)
    pool = _C.Pool(sim, {"limit_bytes": 512 * MiB})
    inboxes = [queue.Queue() for _ in range(THREADS)]
    # Note [Hand-offs to finished threads] A block handed to a thread that has
    # finished its steps would sit in its inbox until the end, outside every
    # thread's reach: on 2 cores the early finishers' inboxes came to hold ~490 of
    # the 512 MiB budget, the threads still running OOMed on nearly every
    # allocation, and the number of allocations depended on scheduling. So a
    # thread that finishes closes its inbox (under `handoff`), and a block for a
    # closed inbox stays with its sender.
    handoff = threading.Lock()
    closed = [False] * THREADS
    errors = []
    ooms = [0] * THREADS

    def worker(index):
        rng = random.Random(1000 + index)
        stream = 0x100 * (index % 3)
        mine = []
        try:
            for step in range(STEPS):
                while not inboxes[index].empty():
                    mine.append(inboxes[index].get_nowait())
                r = rng.random()
                if r < 0.5 or not mine:
                    if rng.random() < 0.01:
                        size = rng.randint(16 * MiB, 64 * MiB)  # rare huge request
                    elif rng.random() < 0.6:
                        size = rng.randint(1, MiB)
                    else:
                        size = rng.randint(MiB, 8 * MiB)
                    addr = pool.allocate(size, stream)
                    if not addr:
                        ooms[index] += 1
                        continue
                    seed = rng.getrandbits(32)
                    write_ends(sim, addr, size, seed)
                    mine.append((addr, size, seed))
                    if rng.random() < 0.1:
                        pool.record_stream(addr, stream + 1)
                elif r < 0.65:
                    # Hand a block to another thread.
                    position, target = rng.randrange(len(mine)), rng.randrange(THREADS)
                    with handoff:
                        if not closed[target]:
                            inboxes[target].put(mine.pop(position))
                else:
                    addr, size, seed = mine.pop(rng.randrange(len(mine)))
                    if not ends_intact(sim, addr, size, seed):
                        errors.append(f"thread {index} step {step}: cookie of {addr:#x}+{size} overwritten")
                    pool.free(addr)
                if len(mine) > 40:
                    addr, size, seed = mine.pop(0)
                    if not ends_intact(sim, addr, size, seed):
                        errors.append(f"thread {index}: cookie of {addr:#x}+{size} overwritten")
                    pool.free(addr)
            with handoff:
                closed[index] = True
                while not inboxes[index].empty():
                    mine.append(inboxes[index].get_nowait())
            for addr, size, seed in mine:
                if not ends_intact(sim, addr, size, seed):
                    errors.append(f"thread {index}: cookie of {addr:#x}+{size} overwritten at the end")
                pool.free(addr)
        except Exception as exc:  # surfaced below with the thread's index
            errors.append(f"thread {index}: {exc!r}")

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[:5]
    assert all(inbox.empty() for inbox in inboxes)
    pool.check_invariants()
    s = pool.stats()
    assert s["allocation"]["all"]["current"] == 0
    assert s["num_allocs"] == s["num_frees"] > THREADS * STEPS // 4
    assert s["reserved_bytes"]["all"]["peak"] <= 512 * MiB
    if vmm and delay > 1:
        assert s["num_reclaims"] > 0  # stitched while fences were pending: aliases
    pool.release_cached()
    assert sim.device_used() == 0
