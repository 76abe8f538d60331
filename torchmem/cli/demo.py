"""`python -m torchmem demo`: the project's main job in one command.

With a GPU it trains a small GPT-style model with torchmem installed
(torchmem/cli/demo_train.py). Without one (or with --replay) it replays a real
training trace recorded on an H200 (GPT-2; with --all four of the bundled traces)
on the CPU, under torchmem's pool and under models of PyTorch's allocator
(native, and with expandable segments), and prints two small tables:

1. with room to spare (no budget): what each allocator holds, and how often it
   calls the driver;
2. under a budget: torchmem's min-cap, the smallest budget it runs the trace in,
   given to every allocator: PyTorch's fail there, and each one's own min-cap
   says how much more it would need. This is where torchmem stitches granules.

Every figure is shown once, in GiB with three decimals, each row is explained in
words after the tables, and lines stay within 100 columns. The replay runs the
same pool code as the GPU, over a simulated device; a few seconds per trace.
"""

import json
import sys
import textwrap
import time

import torch

from torchmem.analysis import trace as trace_io
from torchmem.cli import demo_train
from torchmem.cli.anchors import load_anchors, step_cost_us, step_timing
from torchmem.cli.replay import Progress

HELP = "the main demo: train with torchmem on a GPU, or replay a real trace side by side without one"

DEMO_TRACES = ("gpt2_train", "llama_ckpt_train", "kv_generate", "vision")
# What each bundled trace recorded (torchmem/data/traces/README.md).
WORKLOADS = {
    "gpt2_train": "GPT-2 124M training, batch and sequence length drawn at random each step",
    "llama_ckpt_train": "a Llama-style 300M model trained with gradient checkpointing, varying shapes",
    "kv_generate": "autoregressive decoding with a growing KV cache, varying prompts and batch",
    "vision": "ResNet-50 training at varying resolutions and batch sizes",
}
POLICY_LABELS = {"torchmem": "torchmem", "native": "native", "expandable": "expandable"}
ANCHOR_CONFS = (("native", "native"), ("expandable_segments:True", "expandable_segments"),
                ("backend:cudaMallocAsync", "cudaMallocAsync"))
WIDTH = 100
GIB = float(1 << 30)

LEGEND = (
    ("peak reserved", "the most memory the allocator held from the GPU at once: what has to fit "
                      "on the card"),
    ("reserved / requested", "peak reserved over the program's peak requested (the most its live "
                             "tensors needed at once); 1.000 = nothing wasted"),
    ("driver calls", "calls into the CUDA driver to get or give back memory: cudaMalloc and cudaFree "
                     "of a segment (native), or reserving, creating, mapping and unmapping 2 MiB "
                     "granules of virtual memory (torchmem, expandable). Each costs microseconds "
                     "to milliseconds of the host's time"),
    ("... after warm-up", "the same in the trace's second half, once the working set is known"),
    ("driver time", "those calls at the costs measured on the H200, plus a third of a step for each wait "
                    "for the whole device (the queued work it drains), per training step: host time, "
                    "so an upper bound where the GPU is the bottleneck and hides it"),
    ("failed allocations", "requests the allocator could not serve within the budget: each would "
                           "be an out-of-memory error in training"),
    ("granules stitched", "2 MiB granules torchmem moved out of cached free space to where a new "
                          "block goes, instead of growing past the budget (near a budget only)"),
    ("min-cap", "the smallest budget the allocator runs the trace in without a failed allocation "
                "(bisection to 2 MiB); its ratio is over the program's peak requested"),
)


def add_arguments(parser):
    parser.add_argument("--replay", action="store_true",
                        help="replay the bundled trace(s) on the CPU even when a GPU is present")
    parser.add_argument("--all", action="store_true",
                        help=f"replay four bundled traces ({', '.join(DEMO_TRACES)}), not only gpt2_train")
    parser.add_argument("--no-min-cap", action="store_true",
                        help="skip the budget comparison (the smallest-budget searches; saves a few seconds)")
    parser.add_argument("--json", action="store_true",
                        help="print the replay figures as JSON lines (the budget replays have a nonzero limit)")

    demo_train.add_arguments(parser.add_argument_group(
        "GPU training (used when a GPU is present; without one, or with --replay, these are ignored)"))


def gib(nbytes):
    return f"{nbytes / GIB:,.3f}"


def driver_calls(result, steady=False):
    """All calls to the driver that get or give back memory (events and syncs are not counted)."""
    if steady:
        return result.steady_driver_calls
    kinds = ("reserve_calls", "create_calls", "map_calls", "unmap_calls", "release_calls",
             "segment_alloc_calls", "segment_free_calls")
    return sum(result.backend_calls.get(kind, 0) for kind in kinds)


LABEL_WIDTH = 29  # the longest row label, so that both tables line up
COLUMN_WIDTH = 10


def format_table(columns, rows, indent="  "):
    """Lines of a table: a label column, then one right-aligned column per policy."""
    label_width = max([LABEL_WIDTH] + [len(label) for label, _ in rows])
    widths = [max([COLUMN_WIDTH, len(column)] + [len(values[i]) for _, values in rows])
              for i, column in enumerate(columns)]
    lines = [indent + " " * label_width + "".join(f"  {c:>{w}}" for c, w in zip(columns, widths))]
    for label, values in rows:
        lines.append(indent + label.ljust(label_width) + "".join(f"  {v:>{w}}" for v, w in zip(values, widths)))
    return lines


def driver_time_row(results, steps, step_ms=None):
    if steps and step_ms:  # with the pipeline each device wait drains (Note [Barrier cost], cli/anchors.py)
        return ("driver time per step (ms)", [
            f"{step_cost_us(r.modeled_backend_us, r.device_barriers, step_ms) / 1000 / steps:.2f}" for r in results])
    if steps:
        return ("driver time per step (ms)", [f"{r.modeled_backend_us / 1000 / steps:.2f}" for r in results])
    return ("driver time in all (ms)", [f"{r.modeled_backend_us / 1000:.2f}" for r in results])


def room_table(results, steps, step_ms=None):
    """Table 1: no budget. Peak reserved, its ratio, driver calls and their modeled time."""
    rows = [
        ("peak reserved (GiB)", [gib(r.peak_reserved) for r in results]),
        ("reserved / requested", [f"{r.ratio:.3f}" for r in results]),
        ("driver calls", [f"{driver_calls(r):,}" for r in results]),
        ("... after warm-up (2nd half)", [f"{driver_calls(r, steady=True):,}" for r in results]),
        driver_time_row(results, steps, step_ms),
    ]
    return format_table([POLICY_LABELS[r.policy] for r in results], rows)


def budget_table(results, capped, steps, step_ms=None):
    """Table 2: every policy under torchmem's min-cap (`capped`), then each one's own min-cap."""
    rows = [
        ("runs the trace", ["yes" if r.ooms == 0 else "no" for r in capped]),
        ("failed allocations", [f"{r.ooms:,}" for r in capped]),
        ("granules stitched", [f"{r.reclaims:,}" if r.policy == "torchmem" else "-" for r in capped]),
        ("driver calls", [f"{driver_calls(r):,}" for r in capped]),
        driver_time_row(capped, steps, step_ms),
        ("its own min-cap (GiB)", [gib(r.min_cap) for r in results]),
        ("min-cap / requested", [f"{r.min_cap_ratio:.3f}" for r in results]),
    ]
    return format_table([POLICY_LABELS[r.policy] for r in results], rows)


def measured_line(trace, by_policy, anchor_rows):
    """How the models compare with what the H200 measured for the workload, without repeating
    a figure the table shows: only a mismatch (at the table's rounding) prints the measurement."""
    measured = []
    if trace.recorded_peak_reserved() is not None and "native" in by_policy:
        measured.append(("native", "native, in the recorded trace", trace.recorded_peak_reserved()))
    expandable = anchor_rows.get("expandable_segments:True")
    if expandable and "expandable" in by_policy:
        measured.append(("expandable", "expandable_segments, in a separate run",
                         int(expandable["peak_reserved_mib"] * (1 << 20))))
    if not measured:
        return None
    same = [label for policy, label, value in measured if gib(value) == gib(by_policy[policy].peak_reserved)]
    differ = [f"{label}: {gib(value)} GiB" for policy, label, value in measured
              if gib(value) != gib(by_policy[policy].peak_reserved)]
    parts = []
    if same:
        parts.append(f"The models' peak reserved equal what the H200 measured ({'; '.join(same)}).")
    if differ:
        parts.append(f"The H200 measured {'; '.join(differ)}.")
    return " ".join(parts)


def _difference(ours, theirs, name):
    delta = theirs - ours
    if gib(abs(delta)) == "0.000":
        return f"the same as {name}"
    word = "less" if delta > 0 else "more"
    share = 100 * abs(delta) / theirs
    return f"{gib(abs(delta))} GiB {word} than {name}" + (f" ({share:.0f}%)" if share >= 1 else "")


def conclusion(name, by_policy, capped, steps, step_ms):
    """A few sentences on one trace: memory with room to spare, the budget result, driver cost."""
    ours = by_policy.get("torchmem")
    if ours is None:
        return None
    others = [p for p in ("native", "expandable") if p in by_policy]
    text = f"{name}: with room to spare torchmem holds " + " and ".join(
        _difference(ours.peak_reserved, by_policy[p].peak_reserved, p) for p in others) + "."
    if capped and ours.min_cap:
        failing = [p for p in others if capped[p].ooms]
        needs = [f"{p} would need {gib(by_policy[p].min_cap - ours.min_cap)} GiB more" for p in others
                 if by_policy[p].min_cap and by_policy[p].min_cap > ours.min_cap]
        text += " In the smallest budget torchmem runs it in, "
        text += (f"{' and '.join(failing)} fail{'s' if len(failing) == 1 else ''}" if failing
                 else "the others run it too")
        text += (f": {needs[0]} to run it{''.join(', and ' + need for need in needs[1:])}." if needs else ".")
    if steps and step_ms:
        def cost(result):
            # driver calls and the pipeline each device wait drains (Note [Barrier cost], cli/anchors.py)
            per_step = step_cost_us(result.modeled_backend_us, result.device_barriers, step_ms) / 1000 / steps
            return f"{per_step:.2f} ms ({100 * per_step / step_ms:.1f}%)"

        text += f" Of a {step_ms:.0f} ms step, torchmem's driver calls and device waits take {cost(ours)} with room to spare"
        text += f", {cost(capped['torchmem'])} at its min-cap." if capped else "."
    return text


def wrap(text, indent="", subsequent=None):
    return textwrap.fill(text, width=WIDTH, initial_indent=indent,
                         subsequent_indent=indent if subsequent is None else subsequent)


def legend_lines():
    label_width = max(len(label) for label, _ in LEGEND)
    lines = ["What the rows mean:"]
    for label, words in LEGEND:
        lines.append(wrap(words, indent="  " + label.ljust(label_width) + "  ",
                          subsequent=" " * (label_width + 4)))
    return lines


def header_lines(names):
    traces = "a real training trace" if len(names) == 1 else f"{len(names)} real traces"
    return [wrap(f"torchmem demo: {traces}, recorded on an H200 with PyTorch 2.11, replayed on this CPU "
                 f"through torchmem's pool (the same code as on the GPU, over a simulated 140 GiB device) "
                 f"and through models of PyTorch's caching allocator: as it is by default (native) and "
                 f"with expandable_segments:True (expandable). Sizes are in GiB."), ""]


def run_replay(args, out=None):
    """The CPU demo: replay the bundled trace(s) and print the comparison."""

    # loads the compiled module at import: the CLI builds every parser first, so a bad build still gets its one-line error
    from torchmem.analysis import replay as replay_api

    out = out or sys.stdout
    anchors = load_anchors()
    names = DEMO_TRACES if args.all else DEMO_TRACES[:1]
    progress = Progress()
    with_budget = not args.no_min_cap
    started = time.perf_counter()
    if not args.json:
        print("\n".join(header_lines(names)), file=out, flush=True)
    conclusions = []
    for index, name in enumerate(names):
        trace = trace_io.load(trace_io.bundled_trace(name))
        results = [replay_api.replay(trace, policy, min_cap=with_budget, progress=progress, name=trace.name)
                   for policy in replay_api.POLICIES]
        by_policy = {r.policy: r for r in results}
        capped = {}
        if with_budget:
            budget = by_policy["torchmem"].min_cap
            capped = {policy: replay_api.replay(trace, policy, limit=budget, progress=progress, name=trace.name)
                      for policy in replay_api.POLICIES}
        progress.done()
        if args.json:
            for r in results + list(capped.values()):
                print(json.dumps(r.as_dict()), file=out, flush=True)
            continue
        anchor_rows = anchors.get(trace.name, {})
        steps, step_ms = step_timing(anchor_rows)
        lines = [] if index == 0 else [""]
        lines.append(wrap(f"{trace.name}: {WORKLOADS.get(trace.name, trace.name)}; {len(trace):,} allocator "
                          f"events; the program's peak requested: {gib(trace.peak_requested())} GiB."))
        lines.append("1. With room to spare (no budget):")
        lines += room_table(results, steps, step_ms)
        measured = measured_line(trace, by_policy, anchor_rows)
        if measured:
            lines.append(wrap(measured, indent="  "))
        if capped:
            lines.append("2. Under a budget: torchmem's min-cap, given to every allocator:")
            lines += budget_table(results, [capped[r.policy] for r in results], steps, step_ms)
        print("\n".join(lines), file=out, flush=True)
        conclusions.append(conclusion(trace.name, by_policy, capped, steps, step_ms))
    if args.json:
        return 0
    print("\n" + "\n".join(legend_lines()), file=out)
    print("\nIn short:", file=out)
    for text in filter(None, conclusions):
        print(wrap(text, indent="  "), file=out)
    print(f"  (replays took {time.perf_counter() - started:.1f} s on this CPU; `--all` for four traces, "
          f"`replay --help` for more)" if not args.all else
          f"  (replays took {time.perf_counter() - started:.1f} s on this CPU)", file=out, flush=True)
    return 0


def run(args):
    if not getattr(args, "replay", False):
        if torch.cuda.is_available():
            return demo_train.main(args)
    return run_replay(args)
