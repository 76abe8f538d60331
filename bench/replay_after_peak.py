"""Driver calls once a trace has seen its largest step: torchmem against the expandable model.

    python bench/replay_after_peak.py gpt2_train llama_ckpt_train fsdp_train --budgets 1.03 1.06 1.12 \\
        [--configs - backed_fit=false,stitch_above_limit=0.95]
    python bench/replay_after_peak.py pattern:kv_cache pattern:random:400   # a churn pattern, 400 steps

Why: the bundled traces draw a new shape every step and their peak request keeps
rising late (GPT-2's at 88% of its events), so `replay`'s "after warm-up" (the
second half) still holds growth to new peaks. This counts from the event where
the trace's live requested bytes reach their peak: after it no step needs more
memory than one already run, so what calls remain are the pool rearranging
itself for shapes it has seen the like of. Per trace, budget (a multiple of the
peak request) and torchmem configuration (`-`: the defaults), and for the
expandable model: creates, maps, unmaps and releases after that event (the
expandable model maps and unmaps 20 MiB pages, each counted as a create and a map,
or an unmap and a release), device barriers, and OOMs over the whole trace.
A churn pattern of torchmem.analysis.patterns (`pattern:NAME[:STEPS]`, 400 steps
unless named) stands in for a trace: shapes that vary with no training step.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402

from torchmem.analysis import patterns, replay  # noqa: E402
from torchmem.analysis import trace as trace_io  # noqa: E402


def load_events(name):
    """A trace's events as an int64 array: `name` is a bundled trace, a trace file, or
    pattern:NAME[:STEPS] (a churn pattern, 400 steps by default)."""
    if name.startswith("pattern:"):
        _, pattern, *steps = name.split(":")
        return np.asarray(patterns.replay_events(pattern, int(steps[0]) if steps else 400), dtype=np.int64)
    source = name if os.path.exists(name) else trace_io.bundled_trace(name)
    return np.asarray(trace_io.load(source).events, dtype=np.int64)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("traces", nargs="+", help="bundled trace names or trace files")
    parser.add_argument("--budgets", type=float, nargs="+", default=[1.03, 1.06, 1.12],
                        help="multiples of each trace's peak request")
    parser.add_argument("--configs", nargs="+", default=["-", "backed_fit=false,stitch_above_limit=0.95"],
                        help="torchmem options per row, key=value,... ('-': the defaults)")
    parser.add_argument("--event-delay", type=int, default=10)
    args = parser.parse_args(argv)
    if any(b < 1.0 for b in args.budgets):
        parser.error("--budgets are multiples of the peak request: each must be >= 1")
    print("| trace | peak request at event | budget | policy | creates / maps / unmaps / releases after it "
          "| calls | barriers | OOMs |")
    print("|---|---|---|---|---|---|---|---|")
    for name in args.traces:
        events = load_events(name)
        at, peak = trace_io.peak_requested_at(events.tolist())
        rows = [("torchmem", None if c == "-" else c) for c in args.configs] + [("expandable", None)]
        for budget in args.budgets:
            for policy, config in rows:
                by_kind, barriers, ooms = replay.calls_after(events, at, policy, limit=int(peak * budget),
                                                             config=config, event_delay=args.event_delay)
                kinds = [by_kind[k] for k in replay.VMM_CALL_KINDS]
                label = policy if config is None else f"torchmem ({config})"
                print(f"| {name} | {at:,} of {len(events):,} | {budget:g}x | {label} | "
                      f"{' / '.join(f'{k:,}' for k in kinds)} | {sum(kinds):,} | {barriers} | {ooms} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
