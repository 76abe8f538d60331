"""Replay report for BENCHMARKS.md: every bundled trace (and any extra trace given)
under torchmem and the native model, with min-cap, as Markdown tables.

    python bench/replay_report.py [EXTRA_TRACE ...] [--config key=value,...]

The first table has one row per (trace, policy); the second compares the ratios
with what PyTorch's allocators measured on the H200 for the same workloads
(torchmem/data/anchors.jsonl). Modeled backend time prices each backend call at
the H200 costs of the simulated backend (csrc/backend/sim_backend.h), so it says
how much driver time a policy would spend over the whole trace.
"""

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torchmem.analysis import replay as replay_api  # noqa: E402
from torchmem.analysis import trace as trace_io  # noqa: E402
from torchmem.cli.anchors import load_anchors  # noqa: E402

MiB = 1 << 20


def measure(paths, config):
    rows = []
    for path in paths:
        trace = trace_io.load(path)
        for policy in replay_api.POLICIES:
            started = time.perf_counter()
            result = replay_api.replay(trace, policy, config=config, min_cap=True, name=trace.name)
            print(f"  {trace.name} {policy}: {time.perf_counter() - started:.1f} s", file=sys.stderr)
            rows.append((trace, result))
    return rows


def results_table(rows):
    header = ("| trace | events | policy | peak requested (MiB) | peak reserved (MiB) | ratio | min-cap (MiB) "
              "| min-cap ratio | OOMs | create | map | unmap | segment alloc | stitched | modeled backend (ms) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    for trace, r in rows:
        calls = r.backend_calls
        lines.append(
            f"| {trace.name} | {r.events:,} | {r.policy} | {r.peak_requested / MiB:,.0f} | {r.peak_reserved / MiB:,.0f} "
            f"| {r.ratio:.3f} | {r.min_cap / MiB:,.0f} | {r.min_cap_ratio:.3f} | {r.ooms} "
            f"| {calls.get('create_calls', 0):,} | {calls.get('map_calls', 0):,} | {calls.get('unmap_calls', 0):,} "
            f"| {calls.get('segment_alloc_calls', 0):,} | {r.reclaims:,} | {r.modeled_backend_us / 1000:,.1f} |"
        )
    return "\n".join(lines)


def comparison_table(rows, anchors):
    header = ("| trace | torchmem (replay) | native (model) | native (recorded) | native (H200) "
              "| expandable (model) | expandable_segments (H200) | cudaMallocAsync (H200) |")
    lines = [header, "|" + "---|" * (header.count("|") - 1)]
    by_trace = {}
    for trace, r in rows:
        by_trace.setdefault(trace.name, (trace, {}))[1][r.policy] = r
    for name, (trace, results) in by_trace.items():
        ours, native, expandable = results.get("torchmem"), results.get("native"), results.get("expandable")
        recorded = trace.recorded_peak_reserved()
        measured = anchors.get(name, {})

        def anchor(conf):
            row = measured.get(conf)
            return f"{row['reserved_over_alloc']:.3f}" if row else "-"

        recorded_ratio = f"{recorded / native.peak_requested:.3f}" if recorded and native.peak_requested else "-"
        lines.append(
            f"| {name} | {ours.ratio:.3f} | {native.ratio:.3f} | {recorded_ratio} | {anchor('native')} "
            f"| {expandable.ratio:.3f} | {anchor('expandable_segments:True')} | {anchor('backend:cudaMallocAsync')} |"
        )
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("extra", nargs="*", help="more trace files (trace format or snapshot pickles)")
    parser.add_argument("--config", default="", help="torchmem options for the replay, key=value,...")
    args = parser.parse_args(argv)
    paths = trace_io.bundled_traces() + list(args.extra)
    rows = measure(paths, args.config or None)
    print("### Trace replay (CPU, simulated H200; `python bench/replay_report.py`)\n")
    print(results_table(rows))
    print("\nratio = peak reserved / peak requested; min-cap = smallest budget with no OOM (2 MiB precision).\n")
    print("### Ratio next to PyTorch's allocators (H200 columns: reserved / allocated, untraced runs)\n")
    print(comparison_table(rows, load_anchors()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
