"""Timelines of requested and reserved memory, from a trace or a snapshot, as a PNG.

Reads the shared trace format (gzip JSON, torchmem/data/traces/README.md) or a
PyTorch memory-snapshot pickle (torch.cuda.memory._dump_snapshot or
torchmem.dump_snapshot) into one event array of [action, addr, size, stream]
rows with the trace format's action codes, then draws requested bytes (live
bytes the program asked for), the recorded allocator's reserved bytes and, when
torchmem.replay is available, the reserved bytes torchmem's pool would hold for
the same requests; a second panel shows the fragmentation ratio so far
(peak reserved / peak requested up to each event), which ends at the headline figure.

Note [Peak-preserving decimation]
Traces have hundreds of thousands of events; a plot has ~2000 pixels across.
We keep the maximum of each bucket of events (memory peaks are what matter), so
the drawn curve never hides a peak, and plotting stays fast.
"""

import gzip
import json
import os
import pickle

import numpy as np

ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE = 0, 1, 2, 3, 4
ACTION_NAMES = {ALLOC: "alloc", FREE_REQUESTED: "free_requested", FREE_COMPLETED: "free_completed",
                SEGMENT_ALLOC: "segment_alloc", SEGMENT_FREE: "segment_free"}
# torch snapshot action -> trace code (segment_map/unmap are expandable segments growing/shrinking)
_SNAPSHOT_ACTIONS = {"alloc": ALLOC, "free_requested": FREE_REQUESTED, "free_completed": FREE_COMPLETED,
                     "segment_alloc": SEGMENT_ALLOC, "segment_map": SEGMENT_ALLOC,
                     "segment_free": SEGMENT_FREE, "segment_unmap": SEGMENT_FREE}
MAX_POINTS = 4000


def is_snapshot_path(path):
    """A pickle (snapshot) rather than the JSON trace format, judged by the file's first bytes."""
    with open(path, "rb") as f:
        head = f.read(2)
    return head[:1] == b"\x80"


def read_trace(path):
    """The trace format's dict ({"workload", "events": [[action, addr, size, stream], ...], ...})."""
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt") as f:
            data = json.load(f)
    except (OSError, ValueError, EOFError) as exc:
        raise ValueError(f"{path}: not a trace file (gzip JSON with an 'events' list): {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("events"), list):
        raise ValueError(f"{path}: not a trace file: expected a JSON object with an 'events' list")
    return data


def read_snapshot(path):
    """A PyTorch memory-snapshot dict from a pickle file."""
    try:
        with open(path, "rb") as f:
            data = pickle.load(f)
    except (OSError, pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise ValueError(f"{path}: not a memory-snapshot pickle: {exc}") from None
    if isinstance(data, list):  # torch.cuda.memory_snapshot() dumps: segments only
        data = {"segments": data, "device_traces": []}
    if not isinstance(data, dict) or "segments" not in data:
        raise ValueError(f"{path}: not a memory snapshot: expected a dict with 'segments' (torch.cuda.memory._snapshot())")
    return data


def snapshot_events(snapshot, device=None):
    """The snapshot's device trace as an (N, 4) int64 array in trace codes, and the device used
    (the one with the most entries when `device` is None). Actions without a code (oom,
    snapshot, annotate) are dropped."""
    traces = snapshot.get("device_traces") or []
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d]), default=0)
    entries = traces[device] if device < len(traces) else []
    rows = [(_SNAPSHOT_ACTIONS[e["action"]], e["addr"], e["size"], e.get("stream", 0))
            for e in entries if e["action"] in _SNAPSHOT_ACTIONS]
    return np.array(rows, dtype=np.int64).reshape(-1, 4), device


def load_events(path):
    """(events array (N, 4), description, snapshot-or-None) for a trace or a snapshot file."""
    if not os.path.exists(path):
        raise FileNotFoundError(f"no such file: {path}")
    if is_snapshot_path(path):
        snapshot = read_snapshot(path)
        events, device = snapshot_events(snapshot)
        return events, f"{os.path.basename(path)} (snapshot, device {device})", snapshot
    data = read_trace(path)
    events = np.array(data["events"], dtype=np.int64).reshape(-1, 4)
    return events, f"{data.get('workload', os.path.basename(path))} (trace)", None


def curves(events, snapshot=None):
    """Requested and reserved bytes after each event. For a snapshot, whose trace is a window
    of a longer run, the starting levels are inferred from its final state."""
    actions, addrs, sizes = events[:, 0], events[:, 1], events[:, 2]
    requested_delta = np.zeros(len(events), dtype=np.int64)
    live = {}
    for i in np.flatnonzero((actions == ALLOC) | (actions == FREE_REQUESTED)):
        if actions[i] == ALLOC:
            live[int(addrs[i])] = int(sizes[i])
            requested_delta[i] = sizes[i]
        else:
            requested_delta[i] = -live.pop(int(addrs[i]), int(sizes[i]))
    reserved_delta = np.where(actions == SEGMENT_ALLOC, sizes, 0) - np.where(actions == SEGMENT_FREE, sizes, 0)
    requested = np.cumsum(requested_delta)
    reserved = np.cumsum(reserved_delta)
    if snapshot is not None and len(events):
        final_reserved = sum(s["total_size"] for s in snapshot["segments"])
        final_requested = sum(b.get("requested_size", b["size"]) for s in snapshot["segments"]
                              for b in s["blocks"] if b["state"] != "inactive")
        reserved += final_reserved - reserved[-1]
        requested += final_requested - requested[-1]
    return requested, reserved


def replayed_reserved(events):
    """Reserved bytes of torchmem's simulated pool after each event, from torchmem.replay, or
    None when the replay module (or its per-event curve) is not available."""
    try:
        from torchmem import replay
    except ImportError:
        return None
    timeline = getattr(replay, "reserved_timeline", None)
    if timeline is None:
        return None
    return np.asarray(timeline(events, policy="torchmem"), dtype=np.int64)


def _decimate(values, points=MAX_POINTS):
    """(x, y): the maximum of each bucket (Note [Peak-preserving decimation])."""
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


def plot_timeline(path, output, replay=True, title=None):
    """Writes a PNG timeline for the trace or snapshot at `path` to `output`; returns a dict
    of the figures drawn (peaks and final ratios)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    events, description, snapshot = load_events(path)
    if len(events) == 0:
        raise ValueError(f"{path}: no allocator events to plot (record history before dumping the snapshot)")
    requested, reserved = curves(events, snapshot)
    series = [("requested (live)", requested, "tab:blue"), ("reserved (recorded allocator)", reserved, "tab:red")]
    torchmem_reserved = replayed_reserved(events) if replay and snapshot is None else None
    if torchmem_reserved is not None:
        series.append(("reserved (torchmem, replayed)", torchmem_reserved, "tab:green"))

    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, 6.5), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    gib = float(1 << 30)
    summary = {"events": int(len(events)), "peak_requested": int(requested.max())}
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
    top.set_title(title or f"memory timeline: {description}")
    top.legend(loc="upper left")
    top.grid(alpha=0.3)
    bottom.set_ylabel("peak reserved /\npeak requested")
    bottom.set_xlabel("allocator event")
    bottom.grid(alpha=0.3)
    finite = [v for k, v in summary.items() if k.startswith("ratio_") and v > 0]
    if finite:
        bottom.set_ylim(0.95, max(finite) * 1.15)
    fig.tight_layout()
    fig.savefig(output, format="png", dpi=100)
    plt.close(fig)
    return summary
