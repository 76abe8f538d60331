"""Timelines of requested and reserved memory, from a trace or a snapshot, as a PNG.

Reads the shared trace format (gzip JSON, torchmem/data/traces/README.md) or a
PyTorch memory-snapshot pickle (torch.cuda.memory._dump_snapshot or
torchmem.dump_snapshot) through torchmem.analysis.trace, then draws requested bytes (live
bytes the program asked for), the recorded allocator's reserved bytes and the
reserved bytes torchmem's pool would hold for the same requests (replayed); a second panel shows the fragmentation ratio so far
(peak reserved / peak requested up to each event), which ends at the headline
figure. Drawing uses a bare matplotlib Figure (Agg), never pyplot, so calling
it from a notebook does not change the notebook's backend. Legends sit above
the axes, outside them, so that they never cover a curve or a segment.

A snapshot without history (what `replay --snapshot` writes: the layout at one
moment) has no timeline; plot_layout draws its segments and blocks instead.

Note [Peak-preserving decimation]
Traces have hundreds of thousands of events; a plot has ~2000 pixels across.
We keep the maximum of each bucket of events (memory peaks are what matter), so
the drawn curve never hides a peak, and plotting stays fast.
"""

import os

import numpy as np

from torchmem.analysis import trace as trace_io

MAX_POINTS = 4000
_GROWS = (trace_io.SEGMENT_ALLOC, trace_io.SEGMENT_MAP)
_SHRINKS = (trace_io.SEGMENT_FREE, trace_io.SEGMENT_UNMAP)


def is_snapshot_path(path):
    """A pickle (snapshot) rather than the JSON trace format, judged by the file's first byte."""
    with open(path, "rb") as f:
        return f.read(1) == b"\x80"


def load_events(path):
    """(Trace, description) for a trace file or a snapshot pickle (torchmem.analysis.trace.load: a
    snapshot's trace gets a prologue for blocks live before recording began)."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    trace = trace_io.load(path)
    kind = "snapshot" if is_snapshot_path(path) else "trace"
    return trace, f"{trace.name} ({kind})"


def curves(trace):
    """Requested bytes (live, as asked for) and the recorded allocator's reserved bytes after
    each event of `trace` (a torchmem.analysis.trace.Trace)."""
    events = trace.events
    actions, addrs, sizes = events[:, 0], events[:, 1], events[:, 2]
    requested_delta = np.zeros(len(events), dtype=np.int64)
    live = {}
    for i in np.flatnonzero((actions == trace_io.ALLOC) | (actions == trace_io.FREE_REQUESTED)).tolist():
        addr = int(addrs[i])
        if actions[i] == trace_io.ALLOC:
            requested_delta[i] = sizes[i] - live.pop(addr, 0)  # a lost free (wrapped ring) is dropped
            live[addr] = int(sizes[i])
        else:
            requested_delta[i] = -live.pop(addr, 0)
    reserved_delta = np.where(np.isin(actions, _GROWS), sizes, 0) - np.where(np.isin(actions, _SHRINKS), sizes, 0)
    return np.cumsum(requested_delta), trace.initial_reserved + np.cumsum(reserved_delta)


def replayed_reserved(trace):
    """Reserved bytes of torchmem's simulated pool after each event (torchmem.analysis.replay)."""
    # loads the compiled module: plotting a recorded trace alone must not need it
    from torchmem.analysis import replay

    return np.asarray(replay.reserved_timeline(trace, policy="torchmem"), dtype=np.int64)


def _decimate(values, points=MAX_POINTS):
    """(x, y): the maximum of each bucket of events (Note [Peak-preserving decimation])."""
    values = np.asarray(values)
    if len(values) <= points:
        return np.arange(len(values)), values
    edges = np.linspace(0, len(values), points + 1, dtype=np.int64)
    return edges[:-1], np.maximum.reduceat(values, edges[:-1])


def running_ratio(requested, reserved):
    """Peak reserved so far over peak requested so far (0 where nothing was requested yet)."""
    peak_requested = np.maximum.accumulate(requested).astype(np.float64)
    peak_reserved = np.maximum.accumulate(reserved).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(peak_requested > 0, peak_reserved / peak_requested, 0.0)


def _legend_above(axes, handles=None, columns=3):
    """A legend in a row above `axes`, outside the plotting area."""
    kwargs = {"handles": handles} if handles is not None else {}
    return axes.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=columns, frameon=False,
                       borderaxespad=0.0, fontsize=9, **kwargs)


def plot_timeline(path, output, replay=True, title=None):
    """Writes a PNG timeline for the trace or snapshot at `path` to `output`; returns a dict
    of the figures drawn (peaks and final ratios)."""
    figure, summary = timeline_figure(path, replay=replay, title=title)
    figure.savefig(output, format="png", dpi=100)
    return summary


def timeline_figure(path, replay=True, title=None):
    """(matplotlib Figure, figures drawn) of plot_timeline, unsaved."""
    # A Figure without pyplot renders with Agg and leaves the process's backend alone.
    from matplotlib.figure import Figure

    trace, description = load_events(path)
    if len(trace) == 0:
        raise ValueError(f"{path}: no allocator events to plot (record history before dumping the snapshot)")
    requested, reserved = curves(trace)
    series = [("requested (live)", requested, "tab:blue")]
    if trace.recorded_peak_reserved() is not None:
        series.append(("reserved (recorded allocator)", reserved, "tab:red"))
    torchmem_reserved = replayed_reserved(trace) if replay else None
    if torchmem_reserved is not None:
        series.append(("reserved (torchmem, replayed)", torchmem_reserved, "tab:green"))

    fig = Figure(figsize=(11, 6.5), layout="constrained")
    top, bottom = fig.subplots(2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    gib = float(1 << 30)
    summary = {"events": int(len(trace)), "peak_requested": int(requested.max())}
    for label, values, color in series:
        x, y = _decimate(values)
        top.plot(x, y / gib, label=label, color=color, linewidth=1)
        ratio = running_ratio(requested, values)
        bx, by = _decimate(ratio)
        if values is not requested:
            bottom.plot(bx, by, label=label, color=color, linewidth=1)
            key = "torchmem" if values is torchmem_reserved else "recorded"
            summary[f"peak_reserved_{key}"] = int(values.max())
            summary[f"ratio_{key}"] = float(ratio[-1])
    top.set_ylabel("GiB")
    fig.suptitle(title or f"memory timeline: {description}")
    _legend_above(top)
    top.grid(alpha=0.3)
    bottom.set_ylabel("peak reserved /\npeak requested")
    bottom.set_xlabel("allocator event")
    bottom.grid(alpha=0.3)
    finite = [v for k, v in summary.items() if k.startswith("ratio_") and v > 0]
    if finite:
        bottom.set_ylim(0.95, max(finite) * 1.15)
    return fig, summary


def has_history(path):
    """Whether the snapshot pickle at `path` recorded allocator events (a timeline to draw)."""
    snapshot = trace_io.read_snapshot(path)
    return any(snapshot.get("device_traces") or [])


# Block states of a snapshot, in drawing order, with their colours.
_STATE_COLORS = (("active_allocated", "tab:blue"), ("active_pending_free", "tab:orange"), ("inactive", "0.85"))


def plot_layout(path, output, title=None):
    """Writes a PNG of a snapshot's layout at one moment to `output`: one bar per segment,
    its blocks coloured by state (allocated, pending free, free). Returns the figures drawn."""
    # matplotlib is optional (the plot extra) and slow to import
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    snapshot = trace_io.read_snapshot(path)
    segments = sorted(snapshot["segments"], key=lambda seg: seg["address"])
    if not segments:
        raise ValueError(f"{path}: the snapshot holds no segments: nothing to draw")
    mib = float(1 << 20)
    fig = Figure(figsize=(11, min(2 + 0.3 * len(segments), 30)), layout="constrained")
    axes = fig.subplots()
    totals = dict.fromkeys((state for state, _ in _STATE_COLORS), 0)
    for row, segment in enumerate(segments):
        for state, color in _STATE_COLORS:
            spans = [((block["address"] - segment["address"]) / mib, block["size"] / mib)
                     for block in segment["blocks"] if block["state"] == state]
            totals[state] += sum(block["size"] for block in segment["blocks"] if block["state"] == state)
            if spans:
                axes.broken_barh(spans, (row - 0.4, 0.8), facecolors=color)
    axes.set_yticks(range(len(segments)))
    axes.set_yticklabels([f"{seg['segment_type']} {seg['total_size'] / mib:,.0f} MiB" for seg in segments],
                         fontsize=7)
    axes.invert_yaxis()
    axes.set_xlabel("offset in segment (MiB)")
    reserved = sum(seg["total_size"] for seg in segments)
    settings = snapshot.get("allocator_settings") or {}
    where = f" ({settings['replayed_policy']}, event {settings['replayed_event']:,})" if "replayed_event" in settings else ""
    fig.suptitle(title or f"memory layout: {os.path.basename(path)}{where}: {reserved / mib:,.0f} MiB reserved "
                          f"in {len(segments)} segments, {totals['active_allocated'] / mib:,.0f} MiB allocated")
    _legend_above(axes, [Patch(color=color, label=state.replace("_", " ")) for state, color in _STATE_COLORS])
    fig.savefig(output, format="png", dpi=100)
    return {"segments": len(segments), "reserved": int(reserved),
            **{f"{state}_bytes": int(total) for state, total in totals.items()}}
