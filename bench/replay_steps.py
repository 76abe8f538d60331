"""Step by step: a real trace whose last step repeats, run longer under torchmem's
replay, with each step's driver calls, device barriers and stream waits.

    python bench/replay_steps.py fsdp_accum --repeats 6 --budgets 0 1.02 1.05 1.10
    python bench/replay_steps.py fsdp_train --budgets 1.05 --config stream_order=false
    python bench/replay_steps.py fsdp_accum --budgets 0 1.10 --host-time
    python bench/replay_steps.py fsdp_train --budgets 0 1.10 --host-time --evict-kib 1024

Why: "once warm, a step makes no driver call and takes no barrier" is a claim
about every step after some step, which the replay's whole-trace or
second-half counters do not show. The trace's last step is appended again
`--repeats` times (torchmem.analysis.patterns.repeat_last_step), and the replay
is run to the end of each step in turn; the deltas are that step's. A budget
is a multiple of the trace's peak request (0: none). `event_delay` models a GPU
that runs behind the host, as tests/test_step_plan.py does.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from torchmem.analysis import patterns, replay  # noqa: E402
from torchmem.analysis import trace as trace_io  # noqa: E402

GiB = 1 << 30
HOST_TIME_STEPS = 12  # --host-time: copies of the step the longer replay adds


def step_costs(events, period, limit, config=None, event_delay=10):
    """[(driver calls, barriers, stream waits)] per step, and the last replay's result."""
    steps = len(events) // period
    rows, previous, result = [], (0, 0, 0), None
    for step in range(1, steps + 1):
        stop = len(events) - (steps - step) * period - 1
        result = replay.replay(events, limit=limit, config=config, stop_at=stop, event_delay=event_delay)
        calls = result.backend_calls
        now = (replay.vmm_calls(calls), result.device_barriers, calls["stream_wait_calls"])
        rows.append(tuple(a - b for a, b in zip(now, previous)))
        previous = now
    return rows, result


def host_us_per_alloc(events, longer, extra_allocs, limit, config=None, event_delay=10, tries=3, evict_bytes=0):
    """The replay's host time per allocation (its free included) of the repeated step, on this CPU:
    the whole replay of `events` and of `longer` (the same with more copies of the step, holding
    `extra_allocs` more allocations), best of `tries` each, the difference over those allocations.
    The pool's own work on a steady step (the plan path where one is in force, the online path
    where not), the replay's event loop included; the simulated driver calls cost no host time here
    (the step is quiet once warm). `evict_bytes`: a scratch walk after every alloc and free
    (Note [Cold caches] in csrc/replay/replay.h), whose own time the difference of two runs
    does not cancel: compare paths at the same setting, not across settings."""
    best = []
    for run in (events, longer):
        times = []
        for _ in range(tries):
            start = time.perf_counter()
            replay.replay(run, limit=limit, config=config, event_delay=event_delay, evict_bytes=evict_bytes)
            times.append(time.perf_counter() - start)
        best.append(min(times))
    return (best[1] - best[0]) / extra_allocs * 1e6


def quiet_from(rows):
    """The first step from which every step makes no driver call and takes no barrier (None: never)."""
    return next((i for i in range(len(rows)) if all(c == 0 and b == 0 for c, b, _ in rows[i:])), None)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace", help="a bundled trace's name or a trace file")
    parser.add_argument("--repeats", type=int, default=6, help="times the last step is appended")
    parser.add_argument("--budgets", type=float, nargs="+", default=[0, 1.02, 1.05, 1.10],
                        help="multiples of the peak request (0: no budget)")
    parser.add_argument("--config", default=None, help="torchmem options, key=value,...")
    parser.add_argument("--event-delay", type=int, default=10)
    parser.add_argument("--host-time", action="store_true",
                        help="also the replay's host time per allocation of the repeated step (host_us_per_alloc)")
    parser.add_argument("--evict-kib", type=int, default=0,
                        help="--host-time with the CPU caches evicted between events: a scratch walk of this many "
                             "KiB after every alloc and free, as a training step's own host work does")
    args = parser.parse_args(argv)
    source = args.trace if os.path.exists(args.trace) else trace_io.bundled_trace(args.trace)
    trace = trace_io.load(source)
    rows, period = patterns.repeat_last_step(trace.events, args.repeats)
    events = np.asarray(rows, dtype=np.int64)
    if args.host_time:  # the same run HOST_TIME_STEPS steps longer: host_us_per_alloc's difference
        longer_rows, _ = patterns.repeat_last_step(trace.events, args.repeats + HOST_TIME_STEPS)
        longer = np.asarray(longer_rows, dtype=np.int64)
        extra_allocs = HOST_TIME_STEPS * sum(1 for row in rows[-period:] if row[0] == patterns.ALLOC)
    peak = replay.replay(events, config=args.config, event_delay=args.event_delay).peak_requested
    print(f"{args.trace}: {len(events) // period} steps of {period} events, peak request {peak / GiB:.2f} GiB")
    print("| budget | per step: driver calls / barriers / stream waits | quiet from step | peak reserved GiB |"
          + (" host us per allocation |" if args.host_time else ""))
    print("|---|---|---|---|" + ("---|" if args.host_time else ""))
    for budget in args.budgets:
        costs, last = step_costs(events, period, int(peak * budget), args.config, args.event_delay)
        per_step = ", ".join("/".join(str(v) for v in step) for step in costs)
        quiet = quiet_from(costs)
        host = ""
        if args.host_time:
            us = host_us_per_alloc(events, longer, extra_allocs, int(peak * budget), args.config, args.event_delay,
                                   evict_bytes=args.evict_kib * 1024)
            host = f" {us:.3f} |"
        print(f"| {budget or 'none'} | {per_step} | {'never' if quiet is None else quiet} | "
              f"{last.peak_reserved / GiB:.2f} |{host}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
