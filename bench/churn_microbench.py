"""The Python-level allocation churn microbenchmark (the `microbench` row of
torchmem/data/anchors.jsonl): mean seconds of one `torch.empty` of a mixed size
that replaces one of 64 live tensors (so each iteration is one malloc and one
free through the whole PyTorch stack), under one allocator per process.

    python bench/churn_microbench.py --allocator torchmem --iters 200000 --out results.jsonl

Sizes are drawn log-uniformly from 512 B to 16 MiB and precomputed, with the
slot to replace, so the timed loop holds nothing but the allocation churn.
The same loop on the `meta` device (torch's dispatch with no allocator behind
it) is timed in the same process (`meta_s_per_alloc`), with the CPU the process
ran on (`placement`): the same allocator's churn moves ~2x from one process to
the next (BENCHMARKS.md, How to reproduce), and this tells a slow process from a
slow allocator.
Anchors on the H200 (torch 2.11): native 2.7 us, expandable 3.2, cudaMallocAsync 4.3.
"""

import argparse
import json
import os
import statistics
import sys
import time

from common import append_jsonl, environment, install_allocator  # noqa: E402  (bench/common.py)


def placement():
    """The CPU this process runs on now, its NUMA node and the CPUs it may run on (Linux)."""
    try:
        with open("/proc/self/stat") as f:
            cpu = int(f.read().rsplit(")", 1)[1].split()[36])  # field 39, 'processor'
    except (OSError, IndexError, ValueError):
        return {}
    nodes = [n for n in os.listdir(f"/sys/devices/system/cpu/cpu{cpu}") if n.startswith("node")] \
        if os.path.isdir(f"/sys/devices/system/cpu/cpu{cpu}") else []
    return {"cpu": cpu, "node": int(nodes[0][4:]) if nodes else None,
            "allowed": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None}


def timed_rounds(repeats, sizes, slots, live, make):
    """Seconds per iteration of `repeats` rounds of the churn loop, allocating with `make`."""
    rounds = []
    for _ in range(repeats):
        start = time.perf_counter()
        for size, slot in zip(sizes, slots):
            live[slot] = make(size)
        rounds.append((time.perf_counter() - start) / len(sizes))
    return rounds


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--allocator", choices=("native", "expandable", "async", "torchmem"), required=True)
    parser.add_argument("--iters", type=int, default=200_000)
    parser.add_argument("--repeats", type=int, default=5, help="timed rounds; the median is reported")
    parser.add_argument("--live", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pattern", default="random",
                        help="size pattern (torchmem/analysis/patterns.py): random, periodic, bimodal, kv_cache")
    parser.add_argument("--out", help="JSON-lines file to append the result to")
    args = parser.parse_args(argv)
    from torchmem.analysis.patterns import sizes_and_slots

    torch = install_allocator(args.allocator)

    sizes, slots = sizes_and_slots(args.pattern, args.iters, args.live, args.seed)
    empty, device, dtype = torch.empty, torch.device("cuda"), torch.uint8

    live = [empty(sizes[i], dtype=dtype, device=device) for i in range(args.live)]
    for size, slot in zip(sizes[: args.iters // 10], slots):  # warm the caches
        live[slot] = empty(size, dtype=dtype, device=device)
    torch.cuda.synchronize()

    def driver_calls():
        # torchmem only: what the pool asked of the driver, to explain the time.
        if args.allocator != "torchmem":
            return {}
        from torchmem.runtime.stats import raw_stats

        raw = raw_stats()
        calls = {name: raw["backend"][name] for name in ("map_calls", "unmap_calls", "create_calls",
                                                          "release_calls", "event_record_calls")}
        calls["num_reclaims"] = raw["num_reclaims"]
        return calls

    before = driver_calls()
    rounds = timed_rounds(args.repeats, sizes, slots, live, lambda size: empty(size, dtype=dtype, device=device))
    torch.cuda.synchronize()
    after = driver_calls()
    meta = torch.device("meta")
    meta_live = [empty(sizes[i], dtype=dtype, device=meta) for i in range(args.live)]
    meta_rounds = timed_rounds(args.repeats, sizes, slots, meta_live, lambda size: empty(size, dtype=dtype, device=meta))
    per_iter = {name: (after[name] - before[name]) / (args.iters * args.repeats) for name in after}

    if args.allocator == "torchmem":
        from torchmem.runtime.stats import raw_stats

        stats = raw_stats()
        peak_alloc, peak_reserved = stats["allocated_bytes"]["all"]["peak"], stats["reserved_bytes"]["all"]["peak"]
    else:
        peak_alloc, peak_reserved = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    result = {
        "workload": "microbench", "pattern": args.pattern, "seed": args.seed, "allocator": args.allocator,
        **environment(torch), "iters": args.iters, "repeats": args.repeats,
        "mean_s_per_alloc": statistics.median(rounds), "rounds_s_per_alloc": rounds,
        "spread_s": max(rounds) - min(rounds),
        "meta_s_per_alloc": statistics.median(meta_rounds), "placement": placement(),
        "peak_allocated": peak_alloc, "peak_reserved": peak_reserved,
        "ratio": peak_reserved / peak_alloc if peak_alloc else None,
        "driver_calls_per_alloc": per_iter,
    }
    if args.out:
        append_jsonl(args.out, result)
    print(json.dumps({k: result[k] for k in ("pattern", "allocator", "mean_s_per_alloc", "spread_s",
                                             "meta_s_per_alloc", "placement", "ratio", "driver_calls_per_alloc")}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
