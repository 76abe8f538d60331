"""`python -m torchmem replay`: replay allocator traces under torchmem and a model
of PyTorch's native allocator, and compare what each would have held.

TRACE is torchmem's trace format (.json / .json.gz, see torchmem/data/traces) or
a torch.cuda.memory._dump_snapshot pickle. Without --json it prints one
side-by-side table per trace (with the recording allocator's own figures where
the trace has them); with --json, one JSON object per line per (trace, policy).
Progress goes to stderr, so stdout stays clean for --json.
"""

import json
import os
import pickle
import sys

from torchmem.config import parse_bytes, parse_conf_string

HELP = "replay allocator traces under torchmem and PyTorch's native allocator (model), side by side"

# Traces shorter than this replay in well under a second: no progress shown.
PROGRESS_MIN_EVENTS = 50_000


def add_arguments(parser):
    parser.add_argument("traces", nargs="+", metavar="TRACE",
                        help="trace file: torchmem trace (.json/.json.gz) or a torch memory snapshot pickle")
    parser.add_argument("--policy", choices=("torchmem", "native", "all"), default="all",
                        help="allocation policy to replay under (default: all = both)")
    parser.add_argument("--limit", metavar="BYTES", default=None,
                        help="memory budget for the replay, e.g. 20GiB (default: the device capacity)")
    parser.add_argument("--min-cap", action="store_true",
                        help="also find the smallest budget with no OOM (bisection to 2 MiB)")
    parser.add_argument("--json", action="store_true", help="one JSON object per line per (trace, policy)")
    parser.add_argument("--snapshot", metavar="OUT.pickle", default=None,
                        help="write the layout at peak reserved in PyTorch's memory-snapshot format "
                             "(torchmem's policy, or native with --policy native); one trace only")
    parser.add_argument("--config", metavar="KEY=VALUE,...", default="",
                        help="torchmem options for the replay (the TORCHMEM_CONF syntax), e.g. reclaim_slack=0.01")
    parser.add_argument("--capacity", metavar="BYTES", default=None,
                        help="simulated device memory (default: 140GiB, an H200)")
    parser.add_argument("--event-delay", type=int, default=0, metavar="POLLS",
                        help="model a GPU running behind the host: a stream event stays pending for this "
                             "many polls (default 0: events complete at once; ~10 matches an H200's lag)")
    parser.add_argument("--device", type=int, default=None,
                        help="which device's events to take from a snapshot pickle (default: the busiest)")


class Progress:
    """Progress on stderr: a line updated in place on a terminal, else one line per stage."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = hasattr(self.stream, "isatty") and self.stream.isatty()
        self.stage = None

    def __call__(self, stage, done, total):
        if self.tty:
            percent = 100 * done // max(total, 1)
            self.stream.write(f"\r  {stage}: {percent:3d}% ")
            self.stream.flush()
        elif stage != self.stage:
            self.stream.write(f"  {stage} ...\n")
            self.stream.flush()
        self.stage = stage

    def done(self):
        if self.tty and self.stage is not None:
            self.stream.write("\r" + " " * 72 + "\r")
            self.stream.flush()
        self.stage = None


def _mib(value):
    return "-" if value is None else f"{value / (1 << 20):,.0f} MiB"


def _ratio(value):
    return "-" if value is None else f"{value:.3f}"


def format_table(trace, results):
    """A side-by-side table of one trace's ReplayResults (a column per policy, plus
    the recording allocator's own peak where the trace has segment events)."""
    columns = [r.policy for r in results]
    recorded = results[0].recorded_peak_reserved if results else None
    has_recorded = recorded is not None
    if has_recorded:
        columns.append("recorded")
    rows = []

    def row(label, values, recorded_value=""):
        rows.append([label] + list(values) + ([recorded_value] if has_recorded else []))

    peak_requested = results[0].peak_requested if results else 0
    row("peak requested", [_mib(r.peak_requested) for r in results], "")
    row("peak reserved", [_mib(r.peak_reserved) for r in results], _mib(recorded))
    row("ratio", [_ratio(r.ratio) for r in results],
        _ratio(recorded / peak_requested) if has_recorded and peak_requested else "")
    if any(r.min_cap is not None for r in results):
        row("min-cap", [_mib(r.min_cap) for r in results])
        row("min-cap ratio", [_ratio(r.min_cap_ratio) for r in results])
    if any(r.limit for r in results):
        row("budget", [_mib(r.limit) if r.limit else "device" for r in results])
    row("OOMs", [f"{r.ooms:,}" for r in results])
    kinds = [k for k in results[0].backend_calls if any(r.backend_calls.get(k) for r in results)] if results else []
    for kind in kinds:
        row(f"{kind.replace('_calls', '')} calls", [f"{r.backend_calls.get(kind, 0):,}" for r in results])
    row("stitched granules", [f"{r.reclaims:,}" if r.policy == "torchmem" else "-" for r in results])
    row("modeled backend time", [f"{r.modeled_backend_us / 1000:,.1f} ms" for r in results])
    row("replay wall time", [f"{r.seconds:.2f} s" for r in results])

    header = [""] + columns
    widths = [max(len(str(line[i])) for line in [header] + rows) for i in range(len(header))]
    events = results[0].events if results else 0
    lines = [f"{trace}: {events:,} events"]
    lines.append("  ".join(str(h).ljust(widths[0]) if i == 0 else str(h).rjust(widths[i]) for i, h in enumerate(header)))
    for line in rows:
        lines.append("  ".join(str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(line)))
    return "\n".join(lines)


def _json_line(result, with_min_cap):
    record = result.as_dict()
    if not with_min_cap:
        for key in ("min_cap", "min_cap_ratio", "min_cap_replays"):
            record.pop(key, None)
    return json.dumps(record, sort_keys=False)


def _parse_config(text):
    from torchmem.config import Config

    return Config(**parse_conf_string(text or ""))


def run(args):
    from torchmem import replay as replay_api
    from torchmem import trace as trace_io

    policies = replay_api.POLICIES if args.policy == "all" else (args.policy,)
    limit = parse_bytes("--limit", args.limit) if args.limit is not None else 0
    capacity = parse_bytes("--capacity", args.capacity) if args.capacity is not None else replay_api.DEFAULT_CAPACITY
    if capacity <= 0:
        raise ValueError("--capacity must be > 0 bytes")
    config = _parse_config(args.config)
    if args.event_delay < 0:
        raise ValueError(f"--event-delay must be >= 0 polls, got {args.event_delay}")
    if args.snapshot and len(args.traces) != 1:
        raise ValueError(f"--snapshot writes one file: give one TRACE, not {len(args.traces)}")

    progress = Progress()
    first = True
    for path in args.traces:
        trace = trace_io.load(path, device=args.device)
        show = progress if len(trace) >= PROGRESS_MIN_EVENTS else None
        results = []
        for policy in policies:
            result = replay_api.replay(trace, policy, limit=limit, config=config, capacity=capacity,
                                       min_cap=args.min_cap, progress=show, name=path,
                                       event_delay=args.event_delay)
            results.append(result)
        progress.done()
        if args.json:
            for result in results:
                print(_json_line(result, args.min_cap), flush=True)
        else:
            if not first:
                print()
            print(format_table(path, results), flush=True)
        first = False
        if args.snapshot:
            _write_snapshot(args.snapshot, trace, results, limit, config, capacity)
    return 0


def _write_snapshot(out, trace, results, limit, config, capacity):
    """Writes the layout at the peak of torchmem's run (or native's, if it alone ran)."""
    from torchmem import replay as replay_api
    from torchmem.snapshot_format import to_torch_snapshot

    result = next((r for r in results if r.policy == "torchmem"), results[0])
    event = max(result.peak_reserved_event, 0)
    core = replay_api.snapshot_at(trace, event, result.policy, limit=limit, config=config, capacity=capacity)
    settings = {"replayed_policy": result.policy, "replayed_event": event, "replayed_trace": result.trace}
    snapshot = to_torch_snapshot(core, device=0, expandable=(result.policy == "torchmem"), allocator_settings=settings)
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"--snapshot: directory does not exist: {directory}")
    with open(out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)  # memory_viz reads protocols 2-4
    print(f"wrote {result.policy}'s layout at event {event:,} (peak reserved {_mib(result.peak_reserved)}) "
          f"to {out}", file=sys.stderr)
