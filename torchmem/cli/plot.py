"""`python -m torchmem plot FILE -o out.png`: a PNG timeline of requested and reserved memory.

FILE is a trace (.json.gz) or a memory-snapshot pickle. A snapshot with history
is drawn as a timeline; one without (what `replay --snapshot` writes: the layout
at one moment) as its segments and blocks. For a trace, torchmem's policy is
also replayed (unless --no-replay) and its reserved curve drawn beside the
recorded allocator's.
The drawing itself is torchmem.plot (plot_timeline, plot_layout).
"""

import json
import os

HELP = ("write a PNG timeline of requested bytes, reserved bytes and their ratio from a trace or snapshot, "
        "or a snapshot's layout")


def add_arguments(parser):
    parser.add_argument("file", metavar="FILE", help="trace (.json.gz) or memory-snapshot pickle")
    parser.add_argument("-o", "--output", default="memory_timeline.png", help="PNG to write (default: %(default)s)")
    parser.add_argument("--no-replay", action="store_true", help="do not replay torchmem's policy on a trace")
    parser.add_argument("--title", help="plot title")


def run(args):
    if not args.output.lower().endswith(".png"):
        raise ValueError(f"--output: expected a .png path, got {args.output!r}")
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise ValueError(f"--output: directory {out_dir} does not exist")
    if not os.path.exists(args.file):
        raise FileNotFoundError(f"FILE: no such file: {args.file}")
    from torchmem import plot

    if plot.is_snapshot_path(args.file) and not plot.has_history(args.file):
        summary = plot.plot_layout(args.file, args.output, title=args.title)
    else:
        summary = plot.plot_timeline(args.file, args.output, replay=not args.no_replay, title=args.title)
    print(json.dumps(dict(summary, output=args.output)))
    return 0
