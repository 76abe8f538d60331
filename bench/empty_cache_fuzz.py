"""Allocation churn with empty_cache in the loop: PyTorch's test_allocator_fuzz as a benchmark.

PyTorch's own test_cuda.py::test_allocator_fuzz draws 10,000 actions: allocate a
2-20 MiB int32 tensor, free a random live one (checking its contents), or call
torch.cuda.empty_cache() (weight 0.1 against 1 and 1), with at most 100 MiB
live. Each empty_cache gives back every cached segment, so the allocations after
it pay for growth again; code that calls empty_cache every step pays the same
kind of cost (BENCHMARKS.md, Growth and driver calls). This script times it per
allocator, alone or beside `--load` other processes that keep the same GPU busy
with kernels and their own allocator traffic, and splits the time between the
actions (torchmem also reports its driver calls).

    python bench/empty_cache_fuzz.py --allocator torchmem --load 4 --out fuzz.jsonl
"""

import argparse
import contextlib
import json
import multiprocessing as mp
import os
import random
import sys
import time

from common import append_jsonl, set_native_conf  # noqa: E402  (bench/common.py)
MiB = 1 << 20


def background_load(stop, ready):
    """Another tenant: matmuls and native-allocator churn with empty_cache, until `stop` is set."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    rng = random.Random(os.getpid())
    ready.release()
    held = []
    while not stop.is_set():
        for _ in range(8):
            a = torch.tanh(a @ a)
        held.append(torch.empty(rng.randrange(1, 40) * MiB, dtype=torch.uint8, device="cuda"))
        if len(held) > 8:
            held.pop(rng.randrange(len(held)))
        if rng.random() < 0.05:
            torch.cuda.empty_cache()
        torch.cuda.synchronize()


@contextlib.contextmanager
def busy_gpu(tenants):
    """`tenants` spawned processes running background_load (native allocator) while the block
    runs; they have touched the GPU before it starts."""
    ctx = mp.get_context("spawn")
    stop, ready = ctx.Event(), ctx.Semaphore(0)
    procs = [ctx.Process(target=background_load, args=(stop, ready), daemon=True) for _ in range(tenants)]
    for p in procs:
        p.start()
    try:
        started = 0
        while started < len(procs):
            if ready.acquire(timeout=1.0):
                started += 1
            elif any(not p.is_alive() for p in procs):
                raise RuntimeError("busy_gpu: a background tenant exited before it started (see its stderr)")
        yield
    finally:
        stop.set()
        for p in procs:
            p.join(10)


def emit(row, out):
    """Prints `row` as a JSON line and appends it to `out` (a path or None)."""
    line = json.dumps(row)
    print(line, flush=True)
    if out:
        append_jsonl(out, row)


def fuzz(torch, actions, seed, check):
    """The test's loop; seconds spent in each kind of action."""
    rng = random.Random(seed)
    spent = {"alloc": 0.0, "free": 0.0, "empty_cache": 0.0}
    counts = dict.fromkeys(spent, 0)
    mem, total, c = [], 0, 0
    clock = time.perf_counter

    def free():
        nonlocal total
        v, x = mem.pop(rng.randrange(len(mem)))
        t0 = clock()
        if check and not bool(torch.all(x == v)):
            raise AssertionError(f"tensor {v} lost its contents")
        total -= x.numel()
        del x
        spent["free"] += clock() - t0
        counts["free"] += 1

    for _ in range(actions):
        while total >= 1024 * MiB // (4 * 10):
            free()
        action = rng.choices(("alloc", "free", "empty_cache"), weights=(1, 1 if mem else 0, 0.1))[0]
        if action == "free":
            free()
            continue
        t0 = clock()
        if action == "alloc":
            numel = rng.randrange(2 * MiB // 4, 20 * MiB // 4)
            mem.append((c, torch.full((numel,), c, dtype=torch.int32, device="cuda")))
            c += 1
            total += numel
        else:
            torch.cuda.empty_cache()
        spent[action] += clock() - t0
        counts[action] += 1
    mem.clear()
    torch.cuda.synchronize()
    return spent, counts


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--allocator", choices=("native", "expandable", "torchmem"), required=True)
    parser.add_argument("--actions", type=int, default=10_000)
    parser.add_argument("--seed", type=int, default=123)
    parser.add_argument("--load", type=int, default=0, help="other processes keeping the GPU busy meanwhile")
    parser.add_argument("--no-check", action="store_true", help="skip the per-free content check (a sync)")
    parser.add_argument("--conf", default="", help="TORCHMEM_CONF for the torchmem run")
    parser.add_argument("--probe", action="store_true",
                        help="instead of the fuzz, time the driver's VMM calls (bench/gpu_probe.py's probe) "
                             "beside the load: what each call costs while other processes use the GPU")
    parser.add_argument("--out", help="JSON-lines file to append the result to")
    args = parser.parse_args(argv)
    # The load starts before this process sets its allocator or touches CUDA: the tenants
    # inherit the environment as it was (the native allocator).
    with busy_gpu(args.load):
        set_native_conf(args.allocator)
        import torch

        if args.allocator == "torchmem":
            import torchmem

            if args.conf:
                os.environ["TORCHMEM_CONF"] = args.conf
            torchmem.install(patch_torch=False, warn_unsupported=False)
            before = _driver_calls(torch)
        torch.zeros(1, device="cuda")
        if args.probe:
            from torchmem.runtime import probe

            emit({"bench": "vmm_probe", "load": args.load,
                  "runs": [probe.driver_costs(torch.cuda.current_device(), 20, g) for g in (1, 8)]},
                 args.out)
            return 0
        t0 = time.perf_counter()
        spent, counts = fuzz(torch, args.actions, args.seed, not args.no_check)
        wall = time.perf_counter() - t0
    row = {"bench": "empty_cache_fuzz", "allocator": args.allocator, "load": args.load, "conf": args.conf,
           "actions": args.actions, "wall_s": wall, "seconds": spent, "counts": counts,
           "us_per": {k: 1e6 * spent[k] / counts[k] for k in spent if counts[k]}}
    if args.allocator == "torchmem":
        after = _driver_calls(torch)
        row["driver_calls"] = {k: after[k] - before[k] for k in after}
    emit(row, args.out)
    return 0


def _driver_calls(torch):
    from torchmem.runtime.stats import raw_stats

    raw = raw_stats()["backend"]
    return {k: raw[k] for k in ("create_calls", "release_calls", "map_calls", "unmap_calls", "device_sync_calls")}


if __name__ == "__main__":
    sys.exit(main())
