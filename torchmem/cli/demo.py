"""`python -m torchmem demo`: the project's main job in one command.

With a GPU it trains a small GPT-style model with torchmem installed
(torchmem/demo_train.py). Without one (or with --replay) it replays a real
training trace recorded on an H200 (GPT-2, and with --all also a Llama-style
model with gradient checkpointing) on the CPU, under torchmem's pool and under
models of PyTorch's allocator (native, and with expandable segments), and prints
what each would have held,
next to what PyTorch's allocators measured on the H200 for the same workload.
The replay runs the same pool code as the GPU, over a simulated device.
"""

import json
import os
import sys

HELP = "the main demo: train with torchmem on a GPU, or replay a real trace side by side without one"

DEMO_TRACES = ("gpt2", "llama_ckpt")
ANCHOR_CONFS = (("native", "native"), ("expandable_segments:True", "expandable_segments"),
                ("backend:cudaMallocAsync", "cudaMallocAsync"))


def add_arguments(parser):
    parser.add_argument("--replay", action="store_true",
                        help="replay the bundled trace(s) on the CPU even when a GPU is present")
    parser.add_argument("--all", action="store_true", help="replay every bundled trace (gpt2 and llama_ckpt)")
    parser.add_argument("--no-min-cap", action="store_true",
                        help="skip the smallest-budget search (saves a few seconds)")
    parser.add_argument("--json", action="store_true", help="print the replay figures as JSON lines")
    from torchmem import demo_train

    demo_train.add_arguments(parser.add_argument_group("GPU training (used when a GPU is present)"))


def load_anchors(path=None):
    """Rows of torchmem/data/anchors.jsonl: {workload: {conf: row}} (the first row per pair)."""
    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "anchors.jsonl")
    anchors = {}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"torchmem's measured figures are missing: {path} (a broken install? "
                                f"reinstall torchmem)")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                anchors.setdefault(row["workload"], {}).setdefault(row["conf"], row)
    return anchors


def format_anchors(workload, anchors):
    """One line per allocator measured on the H200 for `workload`, or [] if none."""
    rows = anchors.get(workload, {})
    lines = []
    for conf, label in ANCHOR_CONFS:
        row = rows.get(conf)
        if row:
            lines.append(f"  {label:<22} peak reserved {row['peak_reserved_mib']:>9,.0f} MiB   "
                         f"reserved/allocated {row['reserved_over_alloc']:.3f}   "
                         f"median step {row['median_step_s'] * 1000:.0f} ms")
    return lines


def step_timing(anchor_rows):
    """(steps in the trace, median native step in ms) measured on the H200, or (None, None)."""
    native = anchor_rows.get("native")
    if not native or not native.get("n_steps"):
        return None, None
    return native["n_steps"], native["median_step_s"] * 1000


def backend_time_line(result, anchor_rows):
    """torchmem's modeled driver time per training step, next to the H200's step time."""
    steps, step_ms = step_timing(anchor_rows)
    if steps is None:
        return None
    per_step_ms = result.modeled_backend_us / 1000 / steps
    steady_ms = result.steady_backend_us / 1000 / (steps / 2)
    return (f"torchmem's backend calls cost ~{per_step_ms:.1f} ms per step (modeled at H200 driver costs, "
            f"{steps} steps), {100 * per_step_ms / step_ms:.1f}% of a {step_ms:.0f} ms native step; "
            f"after warm-up (the second half) ~{steady_ms:.1f} ms per step, {100 * steady_ms / step_ms:.1f}%.")


def summary_line(results):
    """How much less torchmem holds than the native model, in words."""
    by_policy = {r.policy: r for r in results}
    ours, native = by_policy.get("torchmem"), by_policy.get("native")
    if not ours or not native or not native.peak_reserved or ours.ooms or native.ooms:
        return None
    saved = native.peak_reserved - ours.peak_reserved
    text = (f"torchmem holds {saved / (1 << 30):,.1f} GiB less at peak than PyTorch's native allocator "
            f"({100 * saved / native.peak_reserved:.0f}% of its reserved memory)")
    if ours.min_cap and native.min_cap:
        text += (f"; the smallest budget that runs it without OOM is {ours.min_cap / (1 << 30):,.1f} GiB "
                 f"with torchmem vs {native.min_cap / (1 << 30):,.1f} GiB native")
    return text + "."


def expandable_line(ours, anchor_rows):
    """torchmem's replay against expandable_segments, the one-variable alternative, as the H200
    measured it (the replay's model of it is the table's expandable column)."""
    row = anchor_rows.get("expandable_segments:True")
    if ours is None or not row or ours.ooms:
        return None
    theirs = row["peak_reserved_mib"] * (1 << 20)
    saved = theirs - ours.peak_reserved
    return (f"Against expandable_segments (PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True, the fair "
            f"competitor: one environment variable), MEASURED ON THE H200: "
            f"it held {row['peak_reserved_mib']:,.0f} MiB at peak, {row['reserved_over_alloc']:.3f}x what was "
            f"allocated; torchmem's replay holds {ours.peak_reserved / (1 << 20):,.0f} MiB, {ours.ratio:.3f}x "
            f"({saved / (1 << 30):,.1f} GiB {'less' if saved >= 0 else 'more'}).")


def run_replay(args, out=None):
    """The CPU demo: replay the bundled trace(s) and print the comparison."""
    from torchmem import replay as replay_api
    from torchmem import trace as trace_io
    from torchmem.cli.replay import Progress, format_table

    out = out or sys.stdout
    anchors = load_anchors()
    names = DEMO_TRACES if args.all else DEMO_TRACES[:1]
    progress = Progress()
    if not args.json:
        print("torchmem demo: replaying real training traces recorded on an H200 (torch 2.11), on the CPU,\n"
              "under torchmem's pool (the GPU code over a simulated device) and models of PyTorch's\n"
              "caching allocator, native and with expandable segments. ratio = peak reserved / peak\n"
              "requested (1.000 = no waste).\n", file=out)
    for index, name in enumerate(names):
        path = trace_io.bundled_trace(name)
        trace = trace_io.load(path)
        results = [replay_api.replay(trace, policy, min_cap=not args.no_min_cap, progress=progress,
                                     name=trace.name)
                   for policy in replay_api.POLICIES]
        progress.done()
        if args.json:
            for r in results:
                print(json.dumps(r.as_dict()), file=out, flush=True)
            continue
        if index:
            print(file=out)
        steps, step_ms = step_timing(anchors.get(trace.name, {}))
        print(format_table(trace.name, results, steps=steps, step_ms=step_ms), file=out)
        lines = format_anchors(trace.name, anchors)
        if lines:
            print("measured on the H200 for the same workload, untraced:", file=out)
            for line in lines:
                print(line, file=out)
        summary = summary_line(results)
        if summary:
            print(summary, file=out, flush=True)
        ours = next((r for r in results if r.policy == "torchmem"), None)
        against = expandable_line(ours, anchors.get(trace.name, {}))
        if against:
            print(against, file=out, flush=True)
        timing = backend_time_line(ours, anchors.get(trace.name, {})) if ours else None
        if timing:
            print(timing, file=out, flush=True)
    return 0


def run(args):
    if not getattr(args, "replay", False):
        import torch

        if torch.cuda.is_available():
            from torchmem.demo_train import main

            return main(args)
    return run_replay(args)
