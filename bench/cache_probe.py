"""The pool's host work per allocation and free, by callgrind's cache simulator (CPU only).

    make bench-cache-probe
    python bench/cache_probe.py --trace llama_ckpt_train --step 10 --budgets 0 1.10
    python bench/cache_probe.py --timed --evict-mib 0 2 8   (the pool's own time instead, no valgrind)
        [--config stitch_above_limit=0.95,backed_fit=false]  (a pool that stitches, so plans the step)

One step of a bundled real trace is run 6 and then 18 times in turn (patterns.repeated_steps),
under each budget (a multiple of the trace's peak request; 0: no limit), once with the CPU caches
hot and once with a scratch walk after every event that evicts the pool's data from a 64 KiB L1
(Note [Cold caches] in csrc/replay/replay.h), as a training step's own host work does between two
allocations. The difference between the two lengths, over the allocations added, is one steady
allocation and its free: instructions, L1 misses hot, and L1 misses evicted (the cache lines the
pool touches). Counts, not seconds: the same on any machine for the same binary and input.
Needs valgrind and build/bench/replay_cache_probe.

--timed: the pool's own host time per allocation and free on this machine instead (config
time_host_ops, Note [Host time]), by torchmem's replay with a scratch walk of each --evict-mib
after every event: seconds, not counts, so a proxy for what the GPU host measures in a
training process (lockstep_tables.py's pool-time table), where the framework's own work between two
allocations evicts the pool's data from caches larger than the simulated ones.
"""

import argparse
import concurrent.futures
import os
import re
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, REPO)  # torchmem from this checkout

from torchmem.analysis import patterns, replay  # noqa: E402
from torchmem.analysis import trace as trace_io  # noqa: E402

PROBE = os.path.join(REPO, "build", "bench", "replay_cache_probe")
SHORT, LONG = 6, 18
EVICT_BYTES = 256 * 1024  # past the simulated 64 KiB L1 (and the 256 KiB last level)
CALLGRIND = ["valgrind", "--tool=callgrind", "--cache-sim=yes", "--D1=65536,8,64", "--LL=262144,16,64",
             "--toggle-collect=torchmem::Pool::*", "--callgrind-out-file=/dev/null"]


def write_events(trace, step, repeats, path):
    """The trace's set-up, then its step `step` `repeats` times; returns its allocations."""
    rows = trace_io.load(trace_io.bundled_trace(trace)).events.tolist()
    events = np.asarray(patterns.repeated_steps(rows, (step,), repeats), dtype=np.int64)
    events.tofile(path)
    return int((events[:, 0] == 0).sum())


def load_events(path):
    return np.fromfile(path, dtype=np.int64).reshape(-1, 4)


def peak_request(path):
    """The events' peak requested bytes (every repetition of the step peaks alike)."""
    return int(replay.replay(load_events(path), "torchmem").peak_requested)


def totals(stderr):
    """(instructions, L1 data misses) of a callgrind run's summary."""
    refs = re.search(r"I\s+refs:\s+([\d,]+)", stderr)
    misses = re.search(r"D1\s+misses:\s+([\d,]+)", stderr)
    if not refs or not misses:
        raise RuntimeError("cache_probe: no callgrind summary in:\n" + stderr[-2000:])
    return int(refs.group(1).replace(",", "")), int(misses.group(1).replace(",", ""))


def measure(events_path, budget, evict, peak):
    proc = subprocess.run(CALLGRIND + [PROBE, events_path, str(budget), str(evict), str(peak)],
                          capture_output=True, text=True, check=True)
    return totals(proc.stderr)


def per_allocation(short, long, added):
    """The difference of two runs' (instructions, misses) over the allocations added."""
    return tuple((b - a) / added for a, b in zip(short, long))


def budget_label(budget):
    return f"{budget:.2f}x" if budget else "no limit"


def timed(files, added, peak, budgets, evict_mib, config=None):
    """The pool's ns per steady allocation and free (alloc, free, the plan's part of both), by
    replay with time_host_ops (and `config`, key=value,...), per budget and scratch walk."""
    options = "time_host_ops=true" + (f",{config}" if config else "")
    print("| budget | evicted after every event | alloc ns | free ns | of them, plan ns |")
    print("|---|---|---|---|---|")
    events = {n: load_events(files[n]) for n in (SHORT, LONG)}
    for mib in evict_mib:
        for budget in budgets:
            runs = []
            for n in (SHORT, LONG):
                r = replay.replay(events[n], "torchmem", limit=int(peak * budget), config=options,
                                  event_delay=10, evict_bytes=int(mib * 2**20))
                runs.append((r.host_alloc_ns, r.host_free_ns, r.host_plan_ns))
            alloc, free, plan = per_allocation(runs[0], runs[1], added)
            print(f"| {budget_label(budget)} | {mib:g} MiB | {alloc:,.0f} | {free:,.0f} | {plan:,.0f} |")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--trace", default="llama_ckpt_train")
    parser.add_argument("--step", type=int, default=10, help="index of the step to repeat")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.0, 1.10])
    parser.add_argument("--timed", action="store_true", help="the pool's own time instead of callgrind's counts")
    parser.add_argument("--evict-mib", type=float, nargs="+", default=[0, 2, 8],
                        help="with --timed: scratch walked after every event, MiB")
    parser.add_argument("--config", help="with --timed: torchmem options, key=value,... (e.g. "
                        "stitch_above_limit=0.95,backed_fit=false: a pool that stitches, and plans the step)")
    args = parser.parse_args(argv)
    if not args.timed and not os.path.exists(PROBE):
        sys.exit(f"cache_probe: {PROBE} is missing: run `make bench-cache-probe` first")
    with tempfile.TemporaryDirectory() as tmp:
        files = {n: os.path.join(tmp, f"events_{n}.bin") for n in (SHORT, LONG)}
        counts = {n: write_events(args.trace, args.step, n, files[n]) for n in (SHORT, LONG)}
        added, peak = counts[LONG] - counts[SHORT], peak_request(files[SHORT])
        print(f"{args.trace}, step {args.step} repeated {SHORT} and {LONG} times: {added:,} allocations added, "
              f"peak request {peak:,} bytes")
        if args.timed:
            timed(files, added, peak, args.budgets, args.evict_mib, args.config)
            return 0
        print("| budget | instructions | L1 misses, hot | L1 misses, caches evicted |")
        print("|---|---|---|---|")
        runs = [(budget, evict, n) for budget in args.budgets for evict in (0, EVICT_BYTES) for n in (SHORT, LONG)]
        with concurrent.futures.ThreadPoolExecutor(max(1, os.cpu_count() or 1)) as pool:  # each run is one process
            counted = dict(zip(runs, pool.map(lambda r: measure(files[r[2]], r[0], r[1], peak), runs)))
        for budget in args.budgets:
            hot = per_allocation(counted[budget, 0, SHORT], counted[budget, 0, LONG], added)
            cold = per_allocation(counted[budget, EVICT_BYTES, SHORT], counted[budget, EVICT_BYTES, LONG], added)
            print(f"| {budget_label(budget)} | {hot[0]:,.0f} | {hot[1]:.1f} | {cold[1]:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
