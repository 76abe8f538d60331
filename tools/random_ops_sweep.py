"""The random-ops checker (csrc/replay/random_ops.h) over many seeds and
configurations: a deeper, hand-run version of tests/test_pool_random.py, for a
change to the pool's reuse or stitching rules before it goes to a GPU.

    python tools/random_ops_sweep.py --seeds 120 --ops 40000

Each configuration stresses one corner: captures and MemPool scopes (barriers
and stream waits refused), budgets, cudaMalloc segments, run handles, stitching
bands, alias_reclaim off, two to six streams, readers declared at one free in
one to four. Prints every failure (seed, operation, what broke) and a count;
exits 1 if any run failed.
"""

import argparse
import sys
import time

from torchmem._loader import _C

MiB = 1 << 20

CONFIGS = [
    {"scopes": 40, "event_delay": 10, "streams": 4, "declared_readers": 2},
    {"scopes": 300, "limit": 200 * MiB, "event_delay": 20, "streams": 5},
    {"scopes": 80, "capacity": 256 * MiB, "event_delay": 1, "streams": 2},
    {"scopes": 100, "vmm": False, "streams": 4, "event_delay": 10},
    {"scopes": 150, "limit": 256 * MiB, "run_below_limit": 0.5, "event_delay": 5, "streams": 3,
     "declared_readers": 2, "foreign_readers": 2},
    {"scopes": 60, "capacity": 256 * MiB, "stitch_above": 0.95, "event_delay": 2, "streams": 3},
    {"scopes": 120, "reclaim_slack": 0.05, "limit": 256 * MiB, "event_delay": 4, "streams": 6,
     "alias_reclaim": False},
    {"event_delay": 10, "streams": 5, "declared_readers": 1},
]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", type=int, default=20, help="seeds per configuration")
    parser.add_argument("--first-seed", type=int, default=2000)
    parser.add_argument("--ops", type=int, default=40_000, help="operations per run")
    args = parser.parse_args(argv)
    if args.seeds < 1 or args.ops < 1:
        parser.error("--seeds and --ops must be at least 1")
    start = time.monotonic()
    failures = 0
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        for config in CONFIGS:
            try:
                _C._random_ops(seed, args.ops, config)
            except RuntimeError as e:
                failures += 1
                print(f"FAILED {config}: {e}", flush=True)
    runs = args.seeds * len(CONFIGS)
    print(f"{runs} runs, {runs * args.ops:,} operations, {failures} failed, "
          f"{time.monotonic() - start:.0f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
