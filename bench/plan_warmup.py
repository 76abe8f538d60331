"""Warm-up under a budget across many training-like runs: how many driver calls and barriers a
repeating step costs before its layout holds, and which runs still make calls late.

    python bench/plan_warmup.py [--steps 20 --seeds 5]

Why: under a tight limit the pool learns a layout for the repeating step (Note [Step plan]);
until it holds, each step makes driver calls and may take device barriers. How long that takes
depends on the budget and on the cycle (gradient accumulation repeats micro-steps inside the
step, a side stream shares the layout), so a rule about plan windows or the OOM ladder has to be
judged across many runs, not on one. For one real trace step by step, bench/replay_steps.py.

The runs: torchmem.analysis.patterns.training_steps (12 layers; 1, 2, 4, 8 and 16 micro-steps;
with and without a side stream; seeds 0..N-1), each at 1.02, 1.05 and 1.10x its own min-cap,
replayed on the CPU with event_delay 10 and today's defaults. Per run: its driver calls and
barriers, and those of its second half; then the totals, and how many runs were not quiet in
their second half.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from torchmem.analysis import patterns, replay  # noqa: E402

LAG = 10  # polls a simulated event stays pending: the GPU runs behind the host


def sweep(steps, seeds, micro_steps=(1, 2, 4, 8, 16), factors=(1.02, 1.05, 1.10)):
    totals = dict(runs=0, calls=0, barriers=0, late_calls=0, not_quiet=0, ooms=0)
    print("| micro-steps | side stream | seed | x min-cap | calls | barriers | second half: calls | barriers |")
    print("|---|---|---|---|---|---|---|---|")
    for micro in micro_steps:
        for side in (None, 7):
            for seed in range(seeds):
                events = np.asarray(patterns.training_steps(steps, layers=12, seed=seed, side_stream=side,
                                                            micro_steps=micro), dtype=np.int64)
                cap = replay.find_min_cap(events, "torchmem", event_delay=LAG)["min_cap"]
                for factor in factors:
                    # The second half: the replay's own steady counts (Note [Steady state]).
                    result = replay.replay(events, limit=int(cap * factor), event_delay=LAG)
                    calls, barriers, ooms = replay.vmm_calls(result.backend_calls), result.device_barriers, result.ooms
                    late, late_barriers = replay.vmm_calls(result.steady_backend_calls), result.steady_barriers
                    totals["runs"] += 1
                    totals["calls"] += calls
                    totals["barriers"] += barriers
                    totals["late_calls"] += late
                    totals["not_quiet"] += bool(late or late_barriers)
                    totals["ooms"] += ooms
                    print(f"| {micro} | {'yes' if side else 'no'} | {seed} | {factor:.2f} | {calls:,} | {barriers:,} | "
                          f"{late:,} | {late_barriers:,} |", flush=True)
    print(f"\n{totals['runs']} runs: {totals['calls']:,} driver calls, {totals['barriers']:,} barriers, "
          f"{totals['not_quiet']} not quiet in their second half ({totals['late_calls']:,} calls there), "
          f"{totals['ooms']} OOMs")
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per run")
    parser.add_argument("--seeds", type=int, default=5, help="seeds per workload")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.seeds < 1:
        parser.error("--steps must be at least 2 and --seeds at least 1")
    sweep(args.steps, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
