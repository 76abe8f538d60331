"""Markdown tables from the JSON lines of bench/gpu_workloads.py and
bench/churn_microbench.py (as written by bench/run_gpu_bench.sh).

    python bench/bench_table.py RESULTS.jsonl

Per workload and allocator: peak allocated, peak reserved and device memory used
(MiB, medians over repeats), reserved/allocated ratio, median step time with its
spread over repeats (max - min of the per-run medians) and its ratio to native,
and the processes' own speed (gpu_workloads' host_speed: us per `torch.empty` on
the meta device, which moves 2x between processes: BENCHMARKS.md, How to reproduce; then
where measured us per kernel launch and per device `torch.empty`; medians over
repeats; "-" for older rows); for the causal LMs the
share of a step the host took to queue it (gpu_workloads' enqueue_s / step_s:
near 1, host-bound) and the allocations per step; with --kernel-time the GPU's
own time (kernels, copies) for one step of each shape, summed over the cycle.
Then each allocator against native round by round (runs with the same seed).
"""

import collections
import json
import math
import statistics
import sys

ORDER = ("native", "expandable", "async", "torchmem")


def ordered(allocators):
    """ORDER first, then variants such as "torchmem[backend=cuda_malloc]" by name."""
    known = [a for a in ORDER if a in allocators]
    return known + sorted(set(allocators) - set(known))


def host_speed_cell(speeds):
    """Medians of the processes' meta loop, and (newer rows) kernel launch and device `torch.empty`."""
    if not speeds:
        return "-"
    cells = [f"{statistics.median(s['meta_s_per_alloc'] for s in speeds) * 1e6:.2f}"]
    for key in ("launch_s", "cuda_s_per_alloc"):
        values = [s[key] for s in speeds if key in s]
        if values:
            cells.append(f"{statistics.median(values) * 1e6:.2f}")
    return " / ".join(cells)


def mib(value):
    return "-" if value is None else f"{value / 2**20:,.0f}"


def load(path):
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def workload_table(rows):
    groups = collections.defaultdict(list)
    for row in rows:
        if row.get("workload") != "microbench":
            groups[(row["workload"], row["allocator"])].append(row)
    lines = ["| workload | allocator | runs | peak allocated MiB | peak reserved MiB | device used MiB | ratio "
             "| median step ms (spread) | step vs native | process meta / launch / alloc us | queued / step | allocs / step | kernel ms / cycle |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for workload in sorted({w for w, _ in groups}):
        native = groups.get((workload, "native"))
        native_step = statistics.median(r["median_step_s"] for r in native) if native else None
        for allocator in ordered({a for w, a in groups if w == workload}):
            runs = groups.get((workload, allocator))
            if not runs:
                continue
            med = lambda key: statistics.median(r[key] for r in runs if r.get(key) is not None)  # noqa: E731
            steps = [r["median_step_s"] for r in runs]
            step = statistics.median(steps)
            spread = max(steps) - min(steps)
            vs_native = f"{step / native_step:.3f}" if native_step else "-"
            speed = host_speed_cell([r["host_speed"] for r in runs if r.get("host_speed")])
            shares = [statistics.median(q / t for q, t in zip(r["enqueue_s"], r["step_s"]))
                      for r in runs if r.get("enqueue_s")]
            queued = f"{statistics.median(shares):.2f}" if shares else "-"
            counts = [statistics.median(r["allocs_per_step"]) for r in runs if r.get("allocs_per_step")]
            per_step = f"{statistics.median(counts):,.0f}" if counts else "-"
            cycles = [sum(r["kernel_ms"]) for r in runs if r.get("kernel_ms")]
            kernel = f"{statistics.median(cycles):.1f}" if cycles else "-"
            lines.append(
                f"| {workload} | {allocator} | {len(runs)} | {mib(med('peak_allocated'))} | "
                f"{mib(med('peak_reserved'))} | {mib(med('device_used_peak'))} | {med('ratio'):.3f} | "
                f"{step * 1e3:.1f} ({spread * 1e3:.1f}) | {vs_native} | {speed} | {queued} | {per_step} | {kernel} |"
            )
    return "\n".join(lines)


def paired_table(rows):
    """Each allocator against native in the same round (same seed: the same shapes), as the
    geometric mean of the per-round ratios of median step and of total step time, with their range.
    One process's host can run 20-40% off another's (BENCHMARKS.md, Step time), so a ratio of
    medians over processes hides how far single rounds scatter; this shows it."""
    native = {(r["workload"], r.get("seed")): r for r in rows
              if r.get("workload") != "microbench" and r["allocator"] == "native"}
    ratios = collections.defaultdict(list)
    for row in rows:
        pair = native.get((row.get("workload"), row.get("seed")))
        if row.get("workload") == "microbench" or row["allocator"] == "native" or pair is None:
            continue
        ratios[(row["workload"], row["allocator"])].append(
            (row["median_step_s"] / pair["median_step_s"],
             row["total_s"] / pair["total_s"] if row.get("total_s") and pair.get("total_s") else None))
    if not ratios:
        return ""
    geomean = lambda values: math.exp(statistics.fmean(math.log(v) for v in values))  # noqa: E731
    lines = ["| workload | allocator | rounds | median step / native (range) | total / native (range) |",
             "|---|---|---|---|---|"]
    for workload in sorted({w for w, _ in ratios}):
        for allocator in ordered({a for w, a in ratios if w == workload}):
            pairs = ratios[(workload, allocator)]
            cells = []
            for values in ([m for m, _ in pairs], [t for _, t in pairs if t is not None]):
                cells.append(f"{geomean(values):.3f} ({min(values):.2f}-{max(values):.2f})" if values else "-")
            lines.append(f"| {workload} | {allocator} | {len(pairs)} | {cells[0]} | {cells[1]} |")
    return "\n".join(lines)


def churn_table(rows):
    groups = collections.defaultdict(list)
    for row in rows:
        if row.get("workload") == "microbench":
            groups[row["allocator"]].append(row)
    if not groups:
        return ""
    lines = ["| allocator | runs | torch.empty churn us (spread) | ratio |", "|---|---|---|---|"]
    for allocator in ordered(groups):
        runs = groups[allocator]
        means = [r["mean_s_per_alloc"] for r in runs]
        spread = max(max(r["rounds_s_per_alloc"]) - min(r["rounds_s_per_alloc"]) for r in runs)
        ratio = statistics.median(r["ratio"] for r in runs if r.get("ratio"))
        lines.append(f"| {allocator} | {len(runs)} | {statistics.median(means) * 1e6:.2f} ({spread * 1e6:.2f}) "
                     f"| {ratio:.3f} |")
    return "\n".join(lines)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python bench/bench_table.py RESULTS.jsonl", file=sys.stderr)
        return 2
    rows = load(argv[0])
    print(workload_table(rows))
    paired = paired_table(rows)
    if paired:
        print()
        print(paired)
    churn = churn_table(rows)
    if churn:
        print()
        print(churn)
    return 0


if __name__ == "__main__":
    sys.exit(main())
