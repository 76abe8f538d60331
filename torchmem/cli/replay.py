"""`python -m torchmem replay`: replay allocator traces under torchmem and a model
of PyTorch's native allocator, and compare what each would have held.

TRACE is a bundled trace's name (`--list` shows them), a file in torchmem's trace
format (.json / .json.gz, see torchmem/data/traces) or a
torch.cuda.memory._dump_snapshot pickle. A trace with entries a replay cannot take
as recorded (negative sizes, frees of addresses that are not live, ...) is refused
with the first such entry named; --lenient skips them and says what it skipped.
Under a budget the trace does not fit, the table says how many allocations
failed and gives no ratio (peak figures then cover only what succeeded).
--repeat-last-step N runs a trace whose last step repeats the one before it N
steps longer, so that a recording of a few steps shows in its second half how a
long run behaves once warm. Every option and every trace is checked before the
first replay runs (--limit, --config and --snapshot by the rules of
torchmem/cli/options.py), so a typo costs no minute.
Without --json it prints one
side-by-side table per trace (with the recording allocator's own figures where
the trace has them); with --json, one JSON object per line per (trace, policy).
Progress goes to stderr, so stdout stays clean for --json.
"""

import dataclasses
import json
import os
import pickle
import sys

import numpy as np

from torchmem.analysis import trace as trace_io
from torchmem.runtime.snapshot_format import to_torch_snapshot
from torchmem.cli.anchors import load_anchors, step_cost_us, step_timing
from torchmem.cli.options import (GRANULE, LIMIT_HELP, CliError, limit_bytes, parse_config, parse_limit,
                                  parse_size, resolve_trace)

HELP = "replay allocator traces under torchmem and PyTorch's native allocator (model), side by side"

# Traces shorter than this replay in well under a second: no progress shown.
PROGRESS_MIN_EVENTS = 50_000


def add_arguments(parser):
    parser.add_argument("traces", nargs="*", metavar="TRACE",
                        help="a bundled trace's name (see --list), a torchmem trace file (.json/.json.gz) "
                             "or a torch memory snapshot pickle")
    parser.add_argument("--list", action="store_true", help="list the bundled traces (names and paths) and exit")
    parser.add_argument("--lenient", action="store_true",
                        help="skip trace entries a replay cannot take (negative sizes, frees of addresses that "
                             "are not live, allocs over live ones) instead of refusing the trace; says what it skipped")
    parser.add_argument("--policy", choices=("torchmem", "native", "expandable", "all"), default="all",
                        help="allocation policy to replay under: torchmem, a model of PyTorch's native allocator, "
                             "or of PyTorch's with expandable_segments:True (default: all three)")
    parser.add_argument("--limit", metavar="BUDGET", default=None,
                        help=LIMIT_HELP.replace("%", "%%").replace("the device", "the simulated device")
                        + "; or a multiple of each trace's own peak request, such as 1.05x")
    parser.add_argument("--min-cap", action="store_true",
                        help="also find the smallest budget with no OOM (bisection to 2 MiB)")
    parser.add_argument("--min-device", action="store_true",
                        help="also find the smallest simulated device the trace fits on with no budget set "
                             "(bisection to 2 MiB): the largest model or batch a card takes, where --min-cap "
                             "is the tightest limit")
    parser.add_argument("--json", action="store_true", help="one JSON object per line per (trace, policy)")
    parser.add_argument("--snapshot", metavar="OUT.pickle", default=None,
                        help="write the layout at peak reserved in PyTorch's memory-snapshot format "
                             "(torchmem's policy, or native with --policy native; the expandable model "
                             "keeps no layout); one trace only")
    parser.add_argument("--config", metavar="KEY=VALUE,...", default="",
                        help="torchmem options for the replay (the TORCHMEM_CONF syntax), e.g. reclaim_slack=0.01; "
                             "applied over TORCHMEM_CONF; a limit= here reads as --limit does")
    parser.add_argument("--capacity", metavar="BYTES", default=None,
                        help="simulated device memory (default: 140GiB, an H200)")
    parser.add_argument("--event-delay", type=int, default=0, metavar="POLLS",
                        help="model a GPU running behind the host: a stream event stays pending for this "
                             "many polls (default 0: events complete at once; ~10 matches an H200's lag)")
    parser.add_argument("--device", type=int, default=None,
                        help="which device's events to take from a snapshot pickle (default: the busiest)")
    parser.add_argument("--repeat-last-step", type=int, default=0, metavar="N",
                        help="run the trace N steps longer by repeating its last step, which must repeat the "
                             "one before it (shapes that stay the same): a recording of a few steps then shows "
                             "a long run's steady state in its second half (\"after warm-up\"); the recorded "
                             "allocator's column is left out, as it never ran those steps")
    parser.add_argument("--costs", metavar="PROBE.json", default=None,
                        help="price the driver calls at a GPU's own figures: the JSON of `python bench/gpu_probe.py "
                             "--out PROBE.json` on that GPU (default: the simulator's, measured on an H200)")
    parser.add_argument("--costs-cold", metavar="LIVE,MIB", default=None,
                        help="with --costs: price the first call of each kind in a burst (a growth: Note [Call "
                             "bursts]) at the probe's run with LIVE granules mapped and MIB of host memory walked "
                             "before each call (gpu_probe.py --live-granules, --evict-mib; e.g. 5000,64), the rest "
                             "at its idle run: the model that matched the GPU's warm-ups")


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


def format_table(trace, results, requested=None, steps=None, step_ms=None):
    """A side-by-side table of one trace's ReplayResults (a column per policy, plus
    the recording allocator's own peak where the trace has segment events), followed
    by a line per policy that hit OOMs. `requested`: the trace's own peak requested
    bytes (what the recorded ratio divides by; default: the first result's).
    `steps` and `step_ms` (the trace's training steps and one step's time, when
    known) turn the modeled backend time into time per step and share of a step."""
    columns = [r.policy for r in results]
    recorded = results[0].recorded_peak_reserved if results else None
    has_recorded = recorded is not None
    if has_recorded:
        columns.append("recorded")
    rows = []

    def row(label, values, recorded_value=""):
        rows.append([label] + list(values) + ([recorded_value] if has_recorded else []))

    if requested is None and results:
        requested = results[0].peak_requested
    row("peak requested", [_mib(r.peak_requested) for r in results], _mib(requested) if has_recorded else "")
    row("peak reserved", [_mib(r.peak_reserved) for r in results], _mib(recorded))
    # Under OOMs the peaks cover only the allocations that succeeded: a ratio would mislead.
    row("ratio", ["OOM" if r.ooms else _ratio(r.ratio) for r in results],
        _ratio(recorded / requested) if has_recorded and requested else "")
    if any(r.min_cap is not None for r in results):
        row("min-cap", [_mib(r.min_cap) for r in results])
        row("min-cap ratio", [_ratio(r.min_cap_ratio) for r in results])
    if any(r.min_device is not None for r in results):
        row("min device (no limit)", [_mib(r.min_device) for r in results])
        row("min device ratio", [_ratio(r.min_device_ratio) for r in results])
    if any(r.limit for r in results):
        row("budget", [_mib(r.limit) if r.limit else "device" for r in results])
    row("OOMs", [f"{r.ooms:,}" for r in results])
    kinds = [k for k in results[0].backend_calls if any(r.backend_calls.get(k) for r in results)] if results else []
    for kind in kinds:
        row(f"{kind.replace('_calls', '')} calls", [f"{r.backend_calls.get(kind, 0):,}" for r in results])
    row("stitched granules", [f"{r.reclaims:,}" if r.policy == "torchmem" else "-" for r in results])
    if steps and step_ms:
        row("driver time/step (share)", [_per_step(step_cost_us(r.modeled_backend_us, r.device_barriers, step_ms),
                                                   steps, step_ms) for r in results])
        row("  after warm-up (2nd half)", [_per_step(step_cost_us(r.steady_backend_us, r.steady_barriers, step_ms),
                                                     steps / 2, step_ms) for r in results])
    else:
        row("driver time in all", [f"{r.modeled_backend_us / 1000:,.1f} ms" for r in results])
        row("  after warm-up (2nd half)", [f"{r.steady_backend_us / 1000:,.1f} ms" for r in results])
    row("driver calls after warm-up", [f"{r.steady_driver_calls:,}" for r in results])
    # waits for the whole device: torchmem's barriers; the models' cached-memory releases (cudaFree)
    row("device waits after warm-up", [f"{r.steady_barriers:,}" for r in results])
    if steps:
        row("  per step after warm-up", [f"{r.steady_driver_calls / (steps / 2):,.1f} calls, "
                                         f"{r.steady_barriers / (steps / 2):,.2f} waits" for r in results])
    if any(r.after_peak_driver_calls is not None for r in results):
        row("after the peak request", [f"{r.after_peak_driver_calls:,} calls, {r.after_peak_barriers:,} waits"
                                       for r in results])
    if any(r.plans for r in results):
        row("step plans (placed / missed)", [f"{r.plans} ({r.plan_hits:,} / {r.plan_misses:,})"
                                             if r.policy == "torchmem" else "-" for r in results])
    if any(r.plan_passes for r in results):
        # Host time on this machine, not in the driver time above (Note [Planning pass cost]).
        row("planning passes (host)", [f"{r.plan_passes} ({r.plan_pass_us / 1000:,.0f} ms)"
                                       if r.policy == "torchmem" else "-" for r in results])
    row("replay wall time", [f"{r.seconds:.2f} s" for r in results])

    header = [""] + columns
    widths = [max(len(str(line[i])) for line in [header] + rows) for i in range(len(header))]
    events = results[0].events if results else 0
    lines = [f"{trace}: {events:,} events"]
    lines.append("  ".join(str(h).ljust(widths[0]) if i == 0 else str(h).rjust(widths[i]) for i, h in enumerate(header)))
    for line in rows:
        lines.append("  ".join(str(c).ljust(widths[0]) if i == 0 else str(c).rjust(widths[i]) for i, c in enumerate(line)))
    for r in results:
        if r.ooms:
            budget = _mib(r.limit) if r.limit else "the device's memory"
            lines.append(f"{r.policy}: OUT OF MEMORY: {r.ooms:,} of {r.allocs + r.ooms:,} allocations failed under "
                         f"a budget of {budget}; the trace does not fit, so no ratio is given (its peaks count only "
                         f"the allocations that succeeded). --min-cap finds the smallest budget that fits.")
    return "\n".join(lines)


def count_after_peak(trace, at, results, limit, config, capacity, event_delay):
    """Under a budget, each result's driver calls and device waits from event `at`, where the
    trace's live requested bytes peak: the second half of a trace whose peak comes late still
    holds growth, which no allocator can avoid; after the peak no step needs more memory than
    one already run (tests/test_shapes_that_vary.py holds torchmem there to the expandable
    model)."""
    from torchmem.analysis import replay as replay_api  # the compiled module, as run() loads it

    for result in results:
        kinds, barriers, _ = replay_api.calls_after(trace, at, result.policy, limit=limit, config=config,
                                                    capacity=capacity, event_delay=event_delay, whole=result)
        result.after_peak_driver_calls = sum(kinds.values())
        result.after_peak_barriers = barriers


def _per_step(total_us, steps, step_ms):
    per_step_ms = total_us / 1000 / steps
    return f"{per_step_ms:,.2f} ms ({100 * per_step_ms / step_ms:.1f}%)"


def _json_line(result, with_min_cap, with_min_device=False):
    record = result.as_dict()
    searches = (("min_cap", with_min_cap), ("min_device", with_min_device))
    for prefix, wanted in searches:
        if not wanted:
            for key in (prefix, f"{prefix}_ratio", f"{prefix}_replays"):
                record.pop(key, None)
    return json.dumps(record, sort_keys=False)


def _source(args, key):
    """Where a config option the user set came from, as they typed it."""
    given_here = any(item.partition("=")[0].strip() == key for item in (args.config or "").split(","))
    return f"--config {key}" if given_here else f"TORCHMEM_CONF {key}"


def parse_peak_multiple(text):
    """--limit Nx: N times each trace's own peak request (N > 0), or None for any other form."""
    if text is None or not str(text).strip().lower().endswith("x"):
        return None
    try:
        factor = float(str(text).strip()[:-1])
    except ValueError:
        raise CliError(f"--limit {text!r}: a multiple of the peak request is a number and an x, such as 1.05x") from None
    if factor <= 0:
        raise CliError(f"--limit {text}: a multiple of the peak request must be above 0 (1.05x: 5% above it)")
    return factor


def budget(args, config, capacity):
    """The replay's budget in bytes (0: the whole device): --limit, else the limit of --config or
    TORCHMEM_CONF, each refused below a granule or above the simulated device, naming its source.
    A pre-reservation (reserve) larger than the budget is refused here too."""
    if args.limit is not None:
        limit = limit_bytes(parse_limit(args.limit), capacity)
    elif config.limit is None:
        limit = 0
    else:
        limit = limit_bytes(config.limit, capacity, _source(args, "limit"))
    if config.reserve > (limit or capacity):
        what = "the budget (--limit)" if args.limit is not None else (
            f"the budget ({_source(args, 'limit')})" if limit else "the simulated device (--capacity)")
        raise CliError(f"{_source(args, 'reserve')}: {config.reserve / (1 << 30):,.2f} GiB is more than "
                       f"{what}, {(limit or capacity) / (1 << 30):,.2f} GiB")
    return limit


def check_snapshot_target(out, policy, traces):
    """Refuses --snapshot before any replay runs: a folder that does not exist, a policy that keeps
    no layout, more than one trace."""
    if len(traces) != 1:
        raise CliError(f"--snapshot writes one file: give one TRACE, not {len(traces)}")
    if policy == "expandable":
        raise CliError("--snapshot: the expandable model keeps no block layout to write; use --policy torchmem, "
                       "native or all (which writes torchmem's)")
    if os.path.isdir(out):
        raise CliError(f"--snapshot {out}: is a folder; give a file name such as {os.path.join(out, 'peak.pickle')}")
    directory = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(directory):
        raise CliError(f"--snapshot {out}: folder {directory} does not exist")


def list_bundled(out=None):
    """Prints the bundled traces: name, events, workload and path."""

    out = out or sys.stdout
    for path in trace_io.bundled_traces():
        names = trace_io.bundled_trace_names(path)
        trace = trace_io.load(path)
        print(f"{names[0]:<16} {len(trace):>9,} events  {trace.device_name or '-'}  {path}", file=out)


def checked(trace, path, lenient):
    """The trace as a replay can take it: refused (ValueError naming the first bad entry)
    unless lenient, which drops the bad entries and says so on stderr."""
    problems = trace.problems()
    if not problems:
        return trace
    index, _, what = problems[0]
    more = f" (and {len(problems) - 1:,} more)" if len(problems) > 1 else ""
    if not lenient:
        raise ValueError(f"{path}: event {index:,}: {what}{more}. The trace is broken: fix it, or pass "
                         f"--lenient to skip such entries.")
    kinds = {}
    for _, kind, _ in problems:
        kinds[kind] = kinds.get(kind, 0) + 1
    summary = ", ".join(f"{kind}: {count:,}" for kind, count in kinds.items())
    print(f"{path}: --lenient: skipped {len(problems):,} entries a replay cannot take ({summary}); the first: "
          f"event {index:,}: {what}", file=sys.stderr)
    return trace.without(index for index, _, _ in problems)


def repeated(trace, path, steps):
    """The trace run `steps` steps longer, its last step appended again and again
    (patterns.repeat_last_step: its alloc and free rows only, so no recorded segments);
    refused, naming the fix, when the last step does not repeat the one before it."""
    from torchmem.analysis import patterns

    try:
        rows, _period = patterns.repeat_last_step(trace.events, steps)
    except ValueError:
        raise CliError(f"--repeat-last-step {steps}: {path}: its last step does not repeat the one before it (its "
                       f"shapes change), so there is no fixed step to repeat; leave the option out for this "
                       f"trace") from None
    return dataclasses.replace(trace, events=np.asarray(rows, dtype=np.int64), initial_reserved=0)


def run(args):
    # loads the compiled module at import: the CLI builds every parser first, so a bad build still gets its one-line error
    from torchmem.analysis import replay as replay_api

    if args.list:
        list_bundled()
        return 0
    if not args.traces:
        raise CliError("give at least one TRACE (a file, or a bundled trace's name: --list shows them)")
    # Every option is checked before the first replay, which can take a minute.
    policies = replay_api.POLICIES if args.policy == "all" else (args.policy,)
    capacity = parse_size(args.capacity, "--capacity") if args.capacity is not None else replay_api.DEFAULT_CAPACITY
    if capacity < GRANULE:
        raise CliError(f"--capacity {args.capacity}: the simulated device needs at least one 2 MiB granule")
    config = parse_config(args.config)
    peak_multiple = parse_peak_multiple(args.limit)
    if peak_multiple is not None:
        args.limit = None  # a multiple of each trace's peak: resolved per trace below
    limit = budget(args, config, capacity)
    if args.event_delay < 0:
        raise CliError(f"--event-delay must be >= 0 polls, got {args.event_delay}")
    if args.repeat_last_step < 0:
        raise CliError(f"--repeat-last-step must be >= 0 steps (0: the trace as recorded), got {args.repeat_last_step}")
    if args.snapshot:
        check_snapshot_target(args.snapshot, args.policy, args.traces)
    costs = cold_costs = None
    if args.costs_cold is not None and args.costs is None:
        raise CliError("--costs-cold picks a run of a GPU probe: give the probe with --costs PROBE.json")
    if args.costs is not None:
        from torchmem.analysis.call_costs import costs_from_probe, parse_conditions

        try:
            cold_run = None if args.costs_cold is None else parse_conditions(args.costs_cold, "--costs-cold")
        except ValueError as e:
            raise CliError(str(e)) from None
        try:
            costs = costs_from_probe(args.costs)
            cold_costs = None if cold_run is None else costs_from_probe(args.costs, *cold_run)
        except ValueError as e:
            raise CliError(f"--costs {args.costs}: {e}") from None
    paths = [resolve_trace(name) for name in args.traces]
    # Loaded, checked and extended before the first replay, so that a trace refused costs no minute.
    traces = [checked(trace_io.load(path, device=args.device), path, args.lenient) for path in paths]
    if args.repeat_last_step:
        traces = [repeated(trace, path, args.repeat_last_step) for trace, path in zip(traces, paths)]

    anchors = load_anchors()
    progress = Progress()
    first = True
    for path, trace in zip(paths, traces):
        peak_at, peak = trace_io.peak_requested_at(trace.events.tolist())  # one walk of the events for all below
        if (args.min_cap or args.min_device) and config.reserve >= peak:
            # The searches try budgets down to the trace's peak requested; none may sit under the reservation.
            raise CliError(f"{_source(args, 'reserve')}: {config.reserve / (1 << 30):,.2f} GiB is at least {path}'s "
                           f"peak requested, and --min-cap/--min-device search budgets below it; leave reserve "
                           f"out for the search")
        show = progress if len(trace) >= PROGRESS_MIN_EVENTS else None
        trace_limit = limit
        if peak_multiple is not None:
            trace_limit = limit_bytes(int(peak_multiple * peak), capacity,
                                      f"--limit {peak_multiple:g}x")
        results = []
        for policy in policies:
            result = replay_api.replay(trace, policy, limit=trace_limit, config=config, capacity=capacity,
                                       min_cap=args.min_cap, min_device=args.min_device, progress=show, name=path,
                                       event_delay=args.event_delay, costs=costs, cold_costs=cold_costs)
            results.append(result)
        if trace_limit:
            count_after_peak(trace, peak_at, results, trace_limit, config, capacity, args.event_delay)
        progress.done()
        if args.json:
            for result in results:
                print(_json_line(result, args.min_cap, args.min_device), flush=True)
        else:
            if not first:
                print()
            steps, step_ms = step_timing(anchors.get(trace.name, {}))
            if steps:
                steps += args.repeat_last_step
            print(format_table(path, results, requested=peak, steps=steps, step_ms=step_ms),
                  flush=True)
        first = False
        if args.snapshot:
            _write_snapshot(args.snapshot, trace, results, limit, config, capacity)
    return 0


def _write_snapshot(out, trace, results, limit, config, capacity):
    """Writes the layout at the peak of torchmem's run (or native's, if it alone ran)."""
    # loads the compiled module at import: the CLI builds every parser first, so a bad build still gets its one-line error
    from torchmem.analysis import replay as replay_api

    result = next((r for r in results if r.policy == "torchmem"), results[0])
    event = max(result.peak_reserved_event, 0)
    core = replay_api.snapshot_at(trace, event, result.policy, limit=limit, config=config, capacity=capacity)
    settings = {"replayed_policy": result.policy, "replayed_event": event, "replayed_trace": result.trace}
    snapshot = to_torch_snapshot(core, device=0, expandable=(result.policy == "torchmem"), allocator_settings=settings)
    with open(out, "wb") as f:
        pickle.dump(snapshot, f, protocol=4)  # memory_viz reads protocols 2-4
    print(f"wrote {result.policy}'s layout at event {event:,} (peak reserved {_mib(result.peak_reserved)}) "
          f"to {out}", file=sys.stderr)
