"""Allocator traces: read them, write them, and the few figures they carry.

A trace is the sequence of allocator events a program caused: allocations (with
the size the program asked for), frees, and the native allocator's own segment
calls. torchmem replays traces (`python -m torchmem replay`) to compare
allocation policies on a CPU, so this module reads the two forms people have:

- torchmem's trace format (torchmem/data/traces/README.md): gzip or plain JSON,
  ``{"workload", "torch", "device", "actions", "events": [[action, addr, size,
  stream], ...]}``;
- a PyTorch memory snapshot pickle (``torch.cuda.memory._dump_snapshot``), whose
  ``device_traces`` hold the events of each device.

Events are kept as one int64 numpy array of shape (N, 4), rows ``(action, addr,
size, stream)``, which the C++ replay driver reads without copying.

Note [Trace prologue] A snapshot's trace is a ring buffer: it usually starts
after the program allocated its weights. Replaying only the recorded events
would forget those live blocks, and a free of one would refer to nothing. When
reading a pickle we therefore prepend an alloc for every block that was live
when recording began: those freed in the trace before any alloc at their
address (the free carries the requested size), and the live blocks of the
snapshot's segments whose address the trace never mentions. ``Trace.prologue``
counts them.

Note [Safe unpickling] Snapshot pickles hold only dicts, lists, strings and
numbers, so they are read with an unpickler that refuses every class: a pickle
from elsewhere cannot run code here.
"""

import dataclasses
import gzip
import io
import json
import os
import pickle

import numpy as np

# Action codes of the trace format, in the order of its README's table.
ACTIONS = {
    "alloc": 0,
    "free_requested": 1,
    "free_completed": 2,
    "segment_alloc": 3,
    "segment_free": 4,
    "segment_map": 5,
    "segment_unmap": 6,
    "oom": 7,
}
ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP, OOM = range(8)
_ACTION_NAMES = {code: name for name, code in ACTIONS.items()}
# Snapshot actions that change nothing a replay needs.
_IGNORED_SNAPSHOT_ACTIONS = {"snapshot", "user_defined"}


class TraceError(ValueError):
    """A file that is not a readable trace; the message names the file and the problem."""


@dataclasses.dataclass
class Trace:
    """Events of one device: ``events`` is an int64 array of shape (N, 4) with rows
    ``(action, addr, size, stream)``; ``path`` is where it came from (or None)."""

    events: np.ndarray
    path: str = None
    workload: str = None
    torch_version: str = None
    device_name: str = None
    device: int = 0
    # Reserved bytes before the first event (segments that existed when a
    # snapshot's recording began), so recorded_peak_reserved() is absolute.
    initial_reserved: int = 0
    # Allocs prepended for blocks live when recording began (Note [Trace prologue]).
    prologue: int = 0

    def __post_init__(self):
        events = np.ascontiguousarray(self.events, dtype=np.int64)
        if events.size == 0:
            events = events.reshape(0, 4)
        if events.ndim != 2 or events.shape[1] != 4:
            raise TraceError(f"{self.name}: events must have shape (N, 4), got {events.shape}")
        self.events = events

    @property
    def name(self):
        """A short label: the workload, else the file name."""
        if self.workload:
            return self.workload
        return os.path.basename(self.path) if self.path else "trace"

    def __len__(self):
        return len(self.events)

    def counts(self):
        """Number of events of each action, by name."""
        codes = np.bincount(self.events[:, 0].clip(0, len(ACTIONS)), minlength=len(ACTIONS) + 1)
        return {name: int(codes[code]) for name, code in ACTIONS.items()}

    def recorded_peak_reserved(self):
        """Peak bytes the recording allocator held, from its segment events (the
        "native peak reserved" of the trace), or None if the trace has none."""
        actions, sizes = self.events[:, 0], self.events[:, 2]
        grows = np.isin(actions, (SEGMENT_ALLOC, SEGMENT_MAP))
        shrinks = np.isin(actions, (SEGMENT_FREE, SEGMENT_UNMAP))
        if not grows.any():
            return None
        delta = np.where(grows, sizes, 0) - np.where(shrinks, sizes, 0)
        return int(self.initial_reserved + max(0, int(np.cumsum(delta).max())))

    def problems(self):
        """Entries a replay cannot take as recorded, in order: (event index, kind, what is
        wrong) for a negative address or size ("negative"), a free of an address that is
        not live, never allocated or freed twice ("unknown free"), and an alloc at an
        address still live, its free missing ("alloc over live"). Snapshots are checked
        after Note [Trace prologue] is applied."""
        found = []
        live = set()
        for index, (action, addr, size, _) in enumerate(self.events.tolist()):
            if size < 0 or addr < 0:
                what = f"size {size}" if size < 0 else f"address {addr}"
                found.append((index, "negative", f"{_ACTION_NAMES[action]} with a negative {what}"))
            elif action == ALLOC:
                if addr in live:
                    found.append((index, "alloc over live", f"alloc at {addr:#x}, which is still live (its free is missing)"))
                live.add(addr)
            elif action == FREE_REQUESTED:
                if addr not in live:
                    found.append((index, "unknown free",
                                  f"free of {addr:#x}, which is not live (never allocated, or freed twice)"))
                live.discard(addr)
        return found

    def without(self, indices):
        """A copy of this trace without the events at `indices`."""
        keep = np.ones(len(self.events), dtype=bool)
        keep[list(indices)] = False
        return dataclasses.replace(self, events=self.events[keep])

    def peak_requested(self):
        """Peak of live requested bytes (allocs minus frees paired by address)."""
        return peak_requested_at(self.events.tolist())[1]


def peak_requested_at(events):
    """(index, bytes): the first of `events` ((action, addr, size, stream) rows) at which the live
    requested bytes (allocs minus frees paired by address) reach their peak, and that peak."""
    live = {}
    current = peak = at = 0
    for i, (action, addr, size, _) in enumerate(events):
        if action == ALLOC:
            previous = live.pop(addr, None)
            if previous is not None:  # the trace lost a free (a ring buffer wrapped)
                current -= previous
            live[addr] = size
            current += size
            if current > peak:
                peak, at = current, i
        elif action == FREE_REQUESTED:
            current -= live.pop(addr, 0)
    return at, peak


def _open_bytes(path):
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        raise FileNotFoundError(f"trace file not found: {path}") from None
    except IsADirectoryError:
        raise TraceError(f"{path}: is a directory, not a trace file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read it ({exc.strerror or exc})") from None
    if data[:2] == b"\x1f\x8b":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as exc:
            raise TraceError(f"{path}: a gzip file, but it does not decompress ({exc}); is it truncated?") from None
    return data


class _DataOnlyUnpickler(pickle.Unpickler):
    """Refuses every global (Note [Safe unpickling])."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"refusing to load {module}.{name}: a memory snapshot holds only plain data")


def _unpickle(data, path):
    try:
        return _DataOnlyUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any unpickling failure is a bad file
        raise TraceError(f"{path}: looks like a pickle but cannot be read as a memory snapshot ({exc})") from None


def read_snapshot(path):
    """The dict of a memory-snapshot pickle (Note [Safe unpickling]); TraceError if it is not one."""
    path = os.fspath(path)
    data = _open_bytes(path)
    if data[:1] != b"\x80":
        raise TraceError(f"{path}: not a memory-snapshot pickle")
    snapshot = _unpickle(data, path)
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("segments"), list):
        raise TraceError(f"{path}: not a memory snapshot: no 'segments' list")
    return snapshot


def load(path, device=None):
    """Reads a trace: torchmem's JSON trace format (.json or .json.gz) or a PyTorch
    memory snapshot pickle (``_dump_snapshot``). ``device`` picks a snapshot's device
    (default: the one with the most events). Raises FileNotFoundError or TraceError
    (a ValueError) naming the file and the problem."""
    path = os.fspath(path)
    data = _open_bytes(path)
    if not data:
        raise TraceError(f"{path}: the file is empty")
    if data[:1] == b"\x80":
        return from_snapshot(_unpickle(data, path), path=path, device=device)
    if data.lstrip()[:1] in (b"{", b"["):
        try:
            document = json.loads(data)
        except ValueError as exc:
            raise TraceError(f"{path}: not valid JSON ({exc})") from None
        return from_json(document, path=path)
    raise TraceError(
        f"{path}: not a trace: expected torchmem's trace format (.json / .json.gz) or a "
        f"torch.cuda.memory._dump_snapshot pickle"
    )


def from_json(document, path=None):
    """A Trace from a parsed trace-format document (see the module docstring)."""
    where = path or "trace"
    if not isinstance(document, dict) or "events" not in document:
        raise TraceError(f"{where}: not a torchmem trace: expected a JSON object with an 'events' list")
    try:
        events = np.array(document["events"], dtype=np.int64)
    except (TypeError, ValueError, OverflowError):
        raise TraceError(f"{where}: 'events' must be a list of [action, addr, size, stream] integer rows") from None
    if events.size == 0:
        events = events.reshape(0, 4)
    if events.ndim != 2 or events.shape[1] != 4:
        raise TraceError(f"{where}: 'events' must be a list of [action, addr, size, stream] rows, got shape {events.shape}")
    bad = (events[:, 0] < 0) | (events[:, 0] >= len(ACTIONS))
    if bad.any():
        row = int(np.argmax(bad))
        raise TraceError(f"{where}: event {row} has unknown action code {int(events[row, 0])} (known: 0..{len(ACTIONS) - 1})")
    return Trace(
        events=events,
        path=path,
        workload=document.get("workload"),
        torch_version=document.get("torch"),
        device_name=document.get("device"),
    )


def from_snapshot(snapshot, path=None, device=None):
    """A Trace from a PyTorch memory snapshot dict (``torch.cuda.memory._snapshot()``):
    the events of one device, with Note [Trace prologue] applied."""
    where = path or "snapshot"
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise TraceError(
            f"{where}: not a memory snapshot with a trace: no 'device_traces'. Record one with "
            f"torch.cuda.memory._record_memory_history() before torch.cuda.memory._dump_snapshot()"
        )
    traces = snapshot["device_traces"]
    if device is None:
        device = max(range(len(traces)), key=lambda d: len(traces[d] or []), default=0)
    if not 0 <= device < len(traces) or not traces[device]:
        raise TraceError(f"{where}: device {device} has no recorded events (devices with events: "
                         f"{[d for d, t in enumerate(traces) if t] or 'none'})")
    rows = []
    for index, entry in enumerate(traces[device]):
        action = entry.get("action") if isinstance(entry, dict) else None
        if action in _IGNORED_SNAPSHOT_ACTIONS:
            continue
        if action not in ACTIONS:
            raise TraceError(f"{where}: device {device} event {index} has unknown action {action!r}")
        try:
            rows.append((ACTIONS[action], int(entry.get("addr", 0)), int(entry.get("size", 0)), int(entry.get("stream", 0))))
        except (TypeError, ValueError):
            raise TraceError(f"{where}: device {device} event {index} has a non-integer addr, size or stream") from None

    segments = [s for s in snapshot.get("segments", []) if isinstance(s, dict) and s.get("device", device) == device]
    prologue = _live_at_start(rows, segments)
    events = np.array(prologue + rows, dtype=np.int64).reshape(-1, 4)

    reserved_at_end = sum(int(s.get("total_size", 0)) for s in segments)
    delta = 0
    for action, _, size, _ in rows:
        if action in (SEGMENT_ALLOC, SEGMENT_MAP):
            delta += size
        elif action in (SEGMENT_FREE, SEGMENT_UNMAP):
            delta -= size
    settings = snapshot.get("allocator_settings") or {}
    return Trace(
        events=events,
        path=path,
        workload=os.path.splitext(os.path.basename(path))[0] if path else None,
        torch_version=settings.get("torch_version") if isinstance(settings, dict) else None,
        device=device,
        initial_reserved=max(0, reserved_at_end - delta),
        prologue=len(prologue),
    )


def _live_at_start(rows, segments):
    """Alloc rows for the blocks live before the first event (Note [Trace prologue])."""
    seen = set()
    prologue = []
    for action, addr, size, stream in rows:
        if action == ALLOC:
            seen.add(addr)
        elif action == FREE_REQUESTED and addr not in seen:
            seen.add(addr)
            prologue.append((ALLOC, addr, size, stream))
    for segment in segments:
        for block in segment.get("blocks", []):
            addr = int(block.get("address", 0))
            if block.get("state") == "active_allocated" and addr not in seen:
                seen.add(addr)
                size = int(block.get("requested_size") or block.get("size", 0))
                prologue.append((ALLOC, addr, size, int(segment.get("stream", 0))))
    return prologue


def save(trace, path):
    """Writes `trace` in torchmem's trace format; gzip when `path` ends in .gz."""
    path = os.fspath(path)
    document = {
        "workload": trace.workload,
        "torch": trace.torch_version,
        "device": trace.device_name,
        "actions": {str(code): name for name, code in ACTIONS.items()},
        "events": trace.events.tolist(),
    }
    text = json.dumps(document, separators=(",", ":")).encode()
    if path.endswith(".gz"):
        text = gzip.compress(text, compresslevel=6)
    with open(path, "wb") as f:
        f.write(text)
    return path


def _bundled_folder():
    return os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "traces")


def bundled_traces():
    """Paths of the traces shipped with torchmem (torchmem/data/traces), sorted."""
    folder = _bundled_folder()
    return sorted(os.path.join(folder, f) for f in os.listdir(folder) if f.endswith((".json", ".json.gz")))


def bundled_trace_names(path):
    """The names a bundled trace answers to: its file name, without .json.gz, without
    the trace_ prefix (its workload, "gpt2_train"), and without _train ("gpt2")."""
    base = os.path.basename(path)
    stem = base.split(".")[0]
    workload = stem.removeprefix("trace_")
    return [workload, workload.removesuffix("_train"), stem, base]


def bundled_trace(name):
    """The path of a bundled trace by name ("gpt2_train", "gpt2", "llama_ckpt", or a file name)."""
    for path in bundled_traces():
        if name in bundled_trace_names(path):
            return path
    raise ValueError(f"no bundled trace named {name!r}; available: "
                     f"{', '.join(bundled_trace_names(p)[0] for p in bundled_traces())} (in {_bundled_folder()})")
