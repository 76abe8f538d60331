"""`python -m torchmem stats FILE`: a memory table for a snapshot or a trace.

A snapshot pickle (torchmem.dump_snapshot or torch.cuda.memory._dump_snapshot)
gives a per-pool table of its segments and blocks; a trace (.json.gz, or a
bundled trace's name) gives its peak requested and recorded reserved bytes.

A one-shot CLI process has no live allocator to report on (torchmem is installed
in the training process, not in this one), so without FILE it says where live
figures are: `python -m torchmem top` for every torchmem process on the node, or
torchmem.memory_summary() inside the program. Run from a Python process that has
torchmem installed (stats.run via the CLI's main), it prints that process's table.
"""

import json

from torchmem._loader import is_installed
from torchmem.analysis import plot
from torchmem.analysis.trace import _DataOnlyUnpickler
from torchmem.cli.options import CliError, resolve_trace
from torchmem.runtime import stats
from torchmem.runtime.stats import format_bytes

HELP = "print a memory table for a snapshot pickle or a trace (a file or a bundled trace's name)"
NO_FILE = ("no FILE given, and this one-shot CLI process has no torchmem allocator of its own to report on. "
           "Give a snapshot pickle (torchmem.dump_snapshot) or a trace (a .json.gz or a bundled name: "
           "`replay --list`); for live processes run `python -m torchmem top`, or call "
           "torchmem.memory_summary() in your program")


def add_arguments(parser):
    parser.add_argument("file", nargs="?", metavar="FILE",
                        help="memory-snapshot pickle, trace .json.gz or a bundled trace's name (`replay --list`); "
                             "for live processes use `python -m torchmem top`")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")


def snapshot_figures(snapshot):
    """Totals of a torch-format snapshot, overall and by pool (small/large)."""
    figures = {}
    for kind in ("all", "small", "large"):
        segments = [s for s in snapshot["segments"] if kind == "all" or s.get("segment_type") == kind]
        blocks = [b for s in segments for b in s["blocks"]]
        free = [b["size"] for b in blocks if b["state"] == "inactive"]
        figures[kind] = {
            "segments": len(segments),
            "reserved_bytes": sum(s["total_size"] for s in segments),
            "allocated_bytes": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
            "active_bytes": sum(b["size"] for b in blocks if b["state"] != "inactive"),
            "requested_bytes": sum(b.get("requested_size", b["size"]) for b in blocks if b["state"] != "inactive"),
            "free_bytes": sum(free),
            "largest_free_block": max(free, default=0),
            "blocks_live": sum(1 for b in blocks if b["state"] != "inactive"),
            "blocks_free": len(free),
        }
    traces = snapshot.get("device_traces") or []
    figures["trace_entries"] = sum(len(t) for t in traces)
    requested = figures["all"]["requested_bytes"]
    figures["reserved_over_requested"] = figures["all"]["reserved_bytes"] / requested if requested else 0.0
    return figures


def _print_snapshot_table(path, figures):
    print(f"snapshot {path}: {figures['all']['segments']} segments, {figures['trace_entries']} trace entries")
    rows = ("reserved_bytes", "allocated_bytes", "active_bytes", "requested_bytes", "free_bytes", "largest_free_block")
    print(f"{'':24}{'all':>14}{'large':>14}{'small':>14}")
    for row in rows:
        print(f"{row:24}" + "".join(f"{format_bytes(figures[k][row]):>14}" for k in ("all", "large", "small")))
    for row in ("segments", "blocks_live", "blocks_free"):
        print(f"{row:24}" + "".join(f"{figures[k][row]:>14}" for k in ("all", "large", "small")))
    print(f"reserved / requested now: {figures['reserved_over_requested']:.4f}")


def _trace_figures(path):
    trace, description = plot.load_events(path)
    peak_requested = trace.peak_requested()
    peak_reserved = trace.recorded_peak_reserved() or 0
    return {"trace": description, "events": int(len(trace)), "peak_requested": peak_requested,
            "peak_reserved_recorded": peak_reserved,
            "ratio_recorded": peak_reserved / peak_requested if peak_requested else 0.0}


def run(args):
    if args.file is None:
        if not is_installed():
            raise CliError(NO_FILE)
        print(json.dumps(stats.memory_stats(), indent=1) if args.json else stats.memory_summary(), end="")
        return 0

    args.file = resolve_trace(args.file, "FILE")
    if plot.is_snapshot_path(args.file):
        try:
            with open(args.file, "rb") as f:
                snapshot = _DataOnlyUnpickler(f).load()
        except Exception as exc:  # any unpickling failure is a bad file
            raise ValueError(f"FILE: {args.file} is not a memory-snapshot pickle ({exc})") from None
        if isinstance(snapshot, list):  # torch.cuda.memory_snapshot() dumps: segments only
            snapshot = {"segments": snapshot}
        if not isinstance(snapshot, dict) or "segments" not in snapshot:
            raise ValueError(f"FILE: {args.file} is not a memory snapshot (no 'segments')")
        figures = snapshot_figures(snapshot)
        if args.json:
            print(json.dumps(figures))
        else:
            _print_snapshot_table(args.file, figures)
        return 0
    figures = _trace_figures(args.file)
    if args.json:
        print(json.dumps(figures))
    else:
        print(f"trace {figures['trace']}: {figures['events']} events")
        print(f"peak requested           {format_bytes(figures['peak_requested'])}")
        print(f"peak reserved (recorded) {format_bytes(figures['peak_reserved_recorded'])}")
        print(f"ratio (recorded)         {figures['ratio_recorded']:.4f}")
    return 0
