"""How long a repeating step takes to go quiet under a budget: the step plan's warm-up.

    python bench/plan_warmup.py traces [--budgets 1.02 1.03 ... 1.12]
    python bench/plan_warmup.py synthetic [--steps 20 --seeds 5]

Why: under a tight limit the pool learns a layout for the repeating step (Note
[Step plan]), and until it holds each step makes driver calls and may take
device barriers. How many steps that takes depends on the budget and on the
cycle (gradient accumulation repeats micro-steps inside the step), so a rule
about plan windows or the OOM ladder has to be judged across budgets and
workloads, not on one run. Both modes replay on the CPU through `_C.replay`
(the simulator, event_delay 10), today's defaults:

- `traces`: the bundled FSDP2 recordings (fixed shapes; fsdp_train 4 steps,
  fsdp_accum 3 steps of 32 micro-batches), their last step repeated (12 and 16
  steps in all), at each budget x the peak request. Per budget: the step from
  which every later step makes no driver call and takes no barrier (counted in
  the repeated steps; "never" if the last one still did), and the whole run's
  driver calls, barriers and plans.
- `synthetic`: torchmem.analysis.patterns.training_steps (12 layers; 1, 2, 4, 8
  and 16 micro-steps; with and without a side stream; seeds 0..N-1) at 1.02,
  1.05 and 1.10x each run's min-cap. Per run: its calls and barriers, and those
  of its second half; then the totals, and how many runs were not quiet in
  their second half.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from torchmem._loader import _C  # noqa: E402
from torchmem.analysis import patterns, replay  # noqa: E402
from torchmem.analysis import trace as trace_io  # noqa: E402

LAG = 10  # polls a simulated event stays pending: the GPU runs behind the host
TRACES = {"fsdp_train": 8, "fsdp_accum": 13}  # bundled trace -> steps appended
BUDGETS = (1.02, 1.03, 1.04, 1.05, 1.06, 1.07, 1.08, 1.10, 1.12)


def run(events, limit, stop_at=-1):
    return _C.replay(events, "torchmem", pool_config=replay.pool_config(None), limit=limit,
                     capacity=140 << 30, event_delay=LAG, stop_at=stop_at)


def driver_calls(result):
    c = result["backend_calls"]
    return c["create_calls"] + c["map_calls"] + c["unmap_calls"] + c["release_calls"]


def quiet_from(events, period, repeats, limit):
    """(the first repeated step from which no step makes a call or takes a barrier, or None;
    the whole run's result)."""
    n = len(events)
    marks = [n - k * period - 1 for k in range(repeats, 0, -1)]
    results = [run(events, limit, stop) for stop in marks] + [run(events, limit)]
    steps = [(driver_calls(b) - driver_calls(a), b["device_barriers"] - a["device_barriers"])
             for a, b in zip(results, results[1:])]
    quiet = next((i for i in range(len(steps)) if not any(c or w for c, w in steps[i:])), None)
    return quiet, results[-1]


def traces(budgets):
    print("| trace | budget | quiet from repeated step | calls | barriers | plans | OOMs |")
    print("|---|---|---|---|---|---|---|")
    for name, repeats in TRACES.items():
        rows, period = patterns.repeat_last_step(trace_io.load(trace_io.bundled_trace(name)).events, repeats)
        events = np.asarray(rows, dtype=np.int64)
        peak = run(events, 0)["peak_requested"]
        for budget in budgets:
            quiet, whole = quiet_from(events, period, repeats, int(budget * peak))
            print(f"| {name} (+{repeats}) | {budget:.2f}x | {'never' if quiet is None else quiet} | "
                  f"{driver_calls(whole):,} | {whole['device_barriers']:,} | {whole['plans']} | {whole['ooms']} |",
                  flush=True)


def synthetic(steps, seeds, micro_steps=(1, 2, 4, 8, 16), factors=(1.02, 1.05, 1.10)):
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
                    limit = int(cap * factor)
                    whole, half = run(events, limit), run(events, limit, len(events) // 2)
                    late = driver_calls(whole) - driver_calls(half)
                    late_barriers = whole["device_barriers"] - half["device_barriers"]
                    totals["runs"] += 1
                    totals["calls"] += driver_calls(whole)
                    totals["barriers"] += whole["device_barriers"]
                    totals["late_calls"] += late
                    totals["not_quiet"] += bool(late or late_barriers)
                    totals["ooms"] += whole["ooms"]
                    print(f"| {micro} | {'yes' if side else 'no'} | {seed} | {factor:.2f} | {driver_calls(whole):,} | "
                          f"{whole['device_barriers']:,} | {late:,} | {late_barriers:,} |", flush=True)
    print(f"\n{totals['runs']} runs: {totals['calls']:,} driver calls, {totals['barriers']:,} barriers, "
          f"{totals['not_quiet']} not quiet in their second half ({totals['late_calls']:,} calls there), "
          f"{totals['ooms']} OOMs")
    return totals


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("traces", "synthetic"))
    parser.add_argument("--budgets", type=float, nargs="+", default=list(BUDGETS),
                        help="traces: multiples of each trace's peak request")
    parser.add_argument("--steps", type=int, default=20, help="synthetic: steps per run")
    parser.add_argument("--seeds", type=int, default=5, help="synthetic: seeds per workload")
    args = parser.parse_args(argv)
    if any(b <= 1.0 for b in args.budgets):
        parser.error("--budgets are multiples of the peak request, above 1 (1.05: 5% above it)")
    if args.steps < 2 or args.seeds < 1:
        parser.error("--steps must be at least 2 and --seeds at least 1")
    if args.mode == "traces":
        traces(args.budgets)
    else:
        synthetic(args.steps, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
