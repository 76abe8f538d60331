"""`python -m torchmem plot FILE -o out.png`: a PNG timeline of requested and reserved memory.

FILE is a trace (.json.gz, or a bundled trace's name) or a memory-snapshot
pickle. A snapshot with history is drawn as a timeline; one without (what
`replay --snapshot` writes: the layout at one moment) as its segments and
blocks. For a trace, torchmem's policy is also replayed (unless --no-replay)
and its reserved curve drawn beside the recorded allocator's.
The drawing itself is torchmem.analysis.plot (plot_timeline, plot_layout); it needs
matplotlib, which torchmem does not require, so its absence is one line.
It prints what it drew in words (--json: as one JSON object).
"""

import json
import os

from torchmem.analysis import plot
from torchmem.cli.options import CliError, resolve_trace

HELP = ("write a PNG timeline of requested bytes, reserved bytes and their ratio from a trace or snapshot, "
        "or a snapshot's layout (needs matplotlib)")


def add_arguments(parser):
    parser.add_argument("file", metavar="FILE",
                        help="trace (.json.gz), a bundled trace's name (`replay --list`) or a memory-snapshot pickle")
    parser.add_argument("-o", "--output", default="memory_timeline.png", help="PNG to write (default: %(default)s)")
    parser.add_argument("--no-replay", action="store_true", help="do not replay torchmem's policy on a trace")
    parser.add_argument("--title", help="plot title")
    parser.add_argument("--json", action="store_true", help="print the figures drawn as one JSON object")


def _gib(nbytes):
    return f"{nbytes / (1 << 30):,.3f} GiB"


def describe(summary):
    """The figures drawn, in words: one line."""
    output = summary["output"]
    if "segments" in summary:
        return (f"wrote {output}: the layout of {summary['segments']} segments, {_gib(summary['reserved'])} "
                f"reserved, {_gib(summary['active_allocated_bytes'])} allocated")
    parts = [f"peak requested {_gib(summary['peak_requested'])}"]
    for key, label in (("recorded", "recorded allocator"), ("torchmem", "torchmem (replayed)")):
        if f"peak_reserved_{key}" in summary:
            parts.append(f"{label} peak reserved {_gib(summary[f'peak_reserved_{key}'])} "
                         f"(ratio {summary[f'ratio_{key}']:.3f})")
    return f"wrote {output}: timeline of {summary['events']:,} events; " + "; ".join(parts)


def run(args):
    if not args.output.lower().endswith(".png"):
        raise CliError(f"--output: expected a .png path, got {args.output!r}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"--output: directory {out_dir} does not exist")
    path = resolve_trace(args.file, "FILE")
    try:  # matplotlib is optional (the plot extra): say so in one line
        import matplotlib  # noqa: F401
    except ImportError:
        raise CliError("plot draws with matplotlib, which is not installed: pip install matplotlib") from None

    if plot.is_snapshot_path(path) and not plot.has_history(path):
        summary = plot.plot_layout(path, args.output, title=args.title)
    else:
        summary = plot.plot_timeline(path, args.output, replay=not args.no_replay, title=args.title)
    summary = dict(summary, output=args.output)
    print(json.dumps(summary) if args.json else describe(summary))
    return 0
