"""`python -m torchmem convert IN OUT`: PyTorch snapshot pickle <-> torchmem trace (.json.gz).

snapshot -> trace: the snapshot's device trace becomes the shared trace format
(torchmem/data/traces/README.md), ready for `python -m torchmem replay`
(torchmem.analysis.trace reads it, adding allocs for blocks live before recording began).
trace -> snapshot: the trace becomes a snapshot's device_traces, and the
state at its end (segments still allocated, tiled by the allocations still
live and free gaps) becomes its segments, so PyTorch's memory_viz tools can
draw it. The direction follows IN's content (a pickle or not). IN is read before
OUT's name is judged, so a file that is neither is blamed, not the output path.
"""

import os
import pickle

from torchmem.analysis import plot
from torchmem.analysis import trace as trace_io
from torchmem.cli.options import CliError, resolve_trace
from torchmem.runtime.snapshots import PICKLE_PROTOCOL

HELP = "convert a PyTorch memory-snapshot pickle to a trace (.json.gz) or back"
_ROUND = 512


def add_arguments(parser):
    parser.add_argument("input", metavar="IN",
                        help="memory-snapshot pickle, trace (.json.gz / .json) or a bundled trace's name")
    parser.add_argument("output", metavar="OUT", help="trace (.json.gz / .json) or snapshot (.pickle / .pkl)")
    parser.add_argument("--device", type=int, default=None,
                        help="snapshot device whose trace to convert (default: the one with the most entries)")


def trace_to_snapshot(trace, device=0):
    """A torch-format snapshot from a torchmem.analysis.trace.Trace: its events as device_traces, its
    end state as segments."""

    names = {code: name for name, code in trace_io.ACTIONS.items()}
    grows = (trace_io.SEGMENT_ALLOC, trace_io.SEGMENT_MAP)
    shrinks = (trace_io.SEGMENT_FREE, trace_io.SEGMENT_UNMAP)
    entries, segments, live = [], {}, {}
    for sequence, (action, addr, size, stream) in enumerate(trace.events.tolist()):
        entry = {"action": names[action], "addr": addr, "size": size, "stream": stream, "time_us": sequence,
                 "frames": []}
        if action == trace_io.OOM:
            entry["device_free"] = 0
        entries.append(entry)
        if action == trace_io.ALLOC:
            live[addr] = (size, stream)
        elif action == trace_io.FREE_REQUESTED:
            live.pop(addr, None)
        elif action in grows:
            segments[addr] = (size, stream)
        elif action in shrinks:
            segments.pop(addr, None)
    out_segments = []
    starts = sorted(segments)
    owned = sorted(live)
    index = 0
    for start in starts:
        size, stream = segments[start]
        end, cursor, blocks = start + size, start, []
        while index < len(owned) and owned[index] < start:
            index += 1
        while index < len(owned) and owned[index] < end:
            addr = owned[index]
            requested = live[addr][0]
            block = min(-(-max(requested, 1) // _ROUND) * _ROUND, end - addr)
            if addr > cursor:
                blocks.append({"address": cursor, "size": addr - cursor, "requested_size": 0,
                               "state": "inactive", "frames": []})
            if addr >= cursor:
                blocks.append({"address": addr, "size": block, "requested_size": requested,
                               "state": "active_allocated", "frames": []})
                cursor = addr + block
            index += 1
        if cursor < end:
            blocks.append({"address": cursor, "size": end - cursor, "requested_size": 0,
                           "state": "inactive", "frames": []})
        active = [b for b in blocks if b["state"] != "inactive"]
        out_segments.append({
            "device": device, "address": start, "total_size": size,
            "allocated_size": sum(b["size"] for b in active), "active_size": sum(b["size"] for b in active),
            "requested_size": sum(b["requested_size"] for b in active), "stream": stream,
            "segment_type": "small" if size <= 2 << 20 else "large", "segment_pool_id": (0, 0),
            "is_expandable": False, "frames": [], "blocks": blocks,
        })
    traces = [[] for _ in range(device + 1)]
    traces[device] = entries
    return {"segments": out_segments, "device_traces": traces,
            "allocator_settings": {"converted_from": str(trace.name)}}


def _is_trace_path(path):
    return path.endswith(".json.gz") or path.endswith(".json")


def run(args):
    out_dir = os.path.dirname(os.path.abspath(args.output))
    if not os.path.isdir(out_dir):
        raise CliError(f"OUT {args.output}: folder {out_dir} does not exist")
    path = resolve_trace(args.input, "IN")
    try:
        trace = trace_io.load(path, device=args.device)
    except trace_io.TraceError as exc:
        raise CliError(f"IN: {exc}") from None
    if plot.is_snapshot_path(path):
        if not _is_trace_path(args.output):
            raise CliError(f"OUT: IN is a memory snapshot, so the output is a trace; expected a .json.gz or .json "
                           f"path, got {args.output!r}")
        trace_io.save(trace, args.output)
        extra = f", {trace.prologue} allocations live before recording began" if trace.prologue else ""
        print(f"wrote {args.output}: {len(trace)} events (device {trace.device}{extra})")
        return 0
    if not args.output.endswith((".pickle", ".pkl")):
        raise CliError(f"OUT: IN is a trace, so the output is a memory snapshot; expected a .pickle or .pkl path, "
                       f"got {args.output!r}")
    snapshot = trace_to_snapshot(trace, device=args.device or 0)
    with open(args.output, "wb") as f:
        pickle.dump(snapshot, f, protocol=PICKLE_PROTOCOL)
    print(f"wrote {args.output}: {len(snapshot['segments'])} segments, {len(trace)} trace entries")
    return 0
