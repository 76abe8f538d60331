"""Snapshots of the allocator in PyTorch's format, and allocation history with Python stacks.

`snapshot()` returns the dict torch.cuda.memory._snapshot() would, built from
the core's own snapshot (snapshot_format.to_torch_snapshot), so PyTorch's
memory_viz tools read it. `dump_snapshot(path)` pickles it with protocol 4,
the newest the memory_viz page can read. `record_history()` turns on the
core's trace ring and, with stacks="python" or "all", a context provider that
the allocator calls before each allocation: it captures the stack and returns
an integer id that the core stores with the block and the trace entry;
snapshots turn ids back into frames (torchmem/runtime/stacks.py).

Note [Live trace ring]
record_history() works at any time, as torch's _record_memory_history does:
the core resizes a live pool's trace ring (Pool::set_trace_capacity), keeping
the newest entries that fit, and turning history off empties the ring.
torch's modes map onto two switches, the ring (trace events) and the context
provider (stacks): enabled='all' turns on both, enabled='state' only the
stacks of live blocks (no events), enabled=None neither; context=None records
no stacks. stacks='all' records Python, TorchScript and C++ frames (torch's
CapturedTraceback, Note [C++ stacks] in stacks.py), stacks='python' Python
frames only; compile_context=True tags events with their torch.compile region.
torch's context picks which events show stacks, as in torch: 'state' none
(live blocks only), 'alloc' allocations and the segments they map, 'all' frees
and empty_cache as well (the allocator then asks the provider at each free:
runtime_set_free_context). skip_actions drops those actions from the
snapshot's events ('segment_alloc' / 'segment_free' name torchmem's
'segment_map' / 'segment_unmap' too). _set_memory_metadata's string is kept
with the pool's operation counter when it is set, and each event shows the
string in force when it happened (per process, where torch keeps one per
thread).
"""

import bisect
import pickle
import sys
import threading
import warnings

from torchmem.runtime import stacks as _stacks
from torchmem.runtime import stats as _stats
from torchmem.runtime.snapshot_format import to_torch_snapshot
from torchmem.runtime.stacks import capture_stack, stack_frames  # noqa: F401 (the public names)

# The trace ring is capped: torch's default max_entries (sys.maxsize) would ask the core
# for an unbounded ring. ~100 bytes per entry: the cap costs at most ~100 MB.
MAX_TRACE_ENTRIES = 1 << 20
PICKLE_PROTOCOL = 4  # the memory_viz page's unpickler reads protocols 2-4 only

_recording = {"enabled": False, "stacks": None, "max_entries": 0, "context": "alloc", "skip_actions": (),
              "compile_context": False}
_CONTEXTS = ("state", "alloc", "all")
_metadata_lock = threading.Lock()
_metadata = {"current": "", "marks": {}}  # marks: device -> [(pool sequence, metadata), ...]


def _is_vmm(raw):
    """Whether the pool maps granules (vmm, sim) rather than allocating segments (cuda_malloc)."""
    if str(raw.get("backend_name", "")) == "cuda_malloc":
        return False
    backend = raw.get("backend") or {}
    # A simulated cuda_malloc device (SimBackend(vmm=False)) shows itself by its segment calls.
    return not any(v for k, v in backend.items() if "segment" in k and isinstance(v, int))


def snapshot(device=None, pool=None, include_traces=True):
    """The allocator's state in PyTorch's memory-snapshot format: {"segments", "device_traces",
    "allocator_settings"}. Reads the installed allocator (device=None = current device) or a
    torchmem._C.Pool given as `pool`. Python stacks appear when record_history(stacks="python")
    was on when the blocks were allocated."""
    if pool is not None:
        core = pool.snapshot()
        raw = pool.stats()
        device_id = 0
    else:
        runtime = _stats._runtime()
        device_id = _stats.device_index(device)
        core = runtime.runtime_snapshot(device_id)
        raw = runtime.runtime_stats(device_id)
    expandable = _is_vmm(raw)
    if not include_traces:
        core = dict(core, trace=[])
    settings = {"torchmem_backend": str(raw.get("backend_name", "")), "limit_bytes": int(raw.get("limit_bytes", 0)),
                "granularity": int(raw.get("granularity", 0))}
    _stacks.symbolize(_stacks.context_ids(core))  # C++ stacks in one batch (Note [C++ stacks])
    result = to_torch_snapshot(core, device=device_id, frames=stack_frames, expandable=expandable,
                               allocator_settings=settings, compile_contexts=_stacks.compile_context)
    return result if pool is not None else _shape_history(result, core, device_id)


def dump_snapshot(path="dump_snapshot.pickle", device=None, pool=None, snapshot_dict=None):
    """Writes snapshot() (or `snapshot_dict`) to `path` as a pickle of protocol 4, ready for
    `python -m torch.cuda._memory_viz` and pytorch.org/memory_viz. Returns the path."""
    data = snapshot_dict if snapshot_dict is not None else snapshot(device=device, pool=pool)
    with open(path, "wb") as f:
        pickle.dump(data, f, protocol=PICKLE_PROTOCOL)
    return path


def record_history(enabled=True, stacks="python", max_entries=100_000, trace=True, clear_history=False,
                   context="alloc", skip_actions=None, compile_context=False):
    """Turns allocation history on or off for the installed allocator: the last `max_entries`
    events (alloc, free, segment map/unmap, oom) go to snapshot()["device_traces"]. With
    stacks="python", each allocation also records its Python stack (see docs/observability.md
    for the cost per allocation); stacks="all" adds TorchScript and C++ frames, as torch's
    default does; stacks=None records events only. trace=False keeps stacks
    for live blocks without recording events (torch's enabled="state"); clear_history=True
    drops the events recorded so far. context ('state', 'alloc' or 'all') picks which events show
    stacks and skip_actions which actions snapshots leave out, and compile_context=True tags
    events with their torch.compile region, as torch's _record_memory_history does. Works at
    any time (Note [Live trace ring])."""
    if context not in _CONTEXTS:
        raise ValueError(f"torchmem.record_history: context must be one of {_CONTEXTS}, got {context!r}")
    if skip_actions is None:
        skip_actions = ()
    if isinstance(skip_actions, str) or not all(isinstance(a, str) for a in skip_actions):
        raise ValueError(f"torchmem.record_history: skip_actions must be a list of action names, got {skip_actions!r}")
    if stacks not in ("python", "all", None):
        raise ValueError(f"torchmem.record_history: stacks must be 'python', 'all' or None, got {stacks!r}")
    if not isinstance(max_entries, int) or isinstance(max_entries, bool) or max_entries < 1:
        raise ValueError(f"torchmem.record_history: max_entries must be an int >= 1, got {max_entries!r}")
    if max_entries > MAX_TRACE_ENTRIES:
        if max_entries != sys.maxsize:
            warnings.warn(f"torchmem.record_history: max_entries {max_entries} capped at {MAX_TRACE_ENTRIES}")
        max_entries = MAX_TRACE_ENTRIES
    runtime = _stats._runtime()
    entries = max_entries if (enabled and trace) else 0
    runtime.runtime_set_trace_capacity(entries)
    if clear_history:
        runtime.runtime_clear_trace()
    with_stacks = bool(enabled) and stacks is not None
    with_compile_context = bool(enabled) and bool(compile_context)
    _stacks.record_compile_contexts(with_compile_context, runtime)
    free_stacks = (with_stacks or with_compile_context) and context == "all"
    if with_stacks:
        # gathered in C++, as torch's allocator does (Note [Torch's recorder], stacks.py); a
        # Python-level walk missed TorchScript frames (PyTorch's test_memory_snapshot_script)
        runtime.runtime_record_torch_stacks(True, free_stacks, with_compile_context, stacks == "all")
    else:
        runtime.runtime_record_torch_stacks(False, False, False)
        runtime.runtime_set_context_provider(_stacks.capture_compile_context if with_compile_context else None)
        runtime.runtime_set_free_context(free_stacks)
    _recording.update(enabled=bool(enabled), stacks=stacks if enabled else None, max_entries=entries,
                      context=context, skip_actions=tuple(skip_actions), compile_context=with_compile_context)


def history_settings():
    """{'enabled', 'stacks', 'max_entries'} as record_history last set them (max_entries 0: no events)."""
    return dict(_recording)


_TORCH_ENABLED = (None, "state", "all")
_TORCH_CONTEXT = (None, "state", "alloc", "all")
_TORCH_STACKS = ("python", "all")


def torch_record_memory_history(enabled="all", context="all", stacks="all", max_entries=sys.maxsize,
                                device=None, clear_history=False, *args, **kwargs):
    """torch.cuda.memory._record_memory_history's signature over record_history() (patch.py
    installs it); Note [Live trace ring] says how its modes map. Bad values raise ValueError
    naming the accepted ones, as torch does. `device` is accepted and ignored: one history
    covers every device, as torchmem's trace is per process."""
    skip_actions = kwargs.pop("skip_actions", None)
    compile_context = bool(kwargs.pop("compile_context", False))
    del device, args, kwargs
    if isinstance(enabled, bool):  # the legacy boolean form: True = record events and stacks
        enabled = "all" if enabled else None
    if enabled not in _TORCH_ENABLED:
        raise ValueError(f"_record_memory_history: enabled must be one of {_TORCH_ENABLED}, got {enabled!r}")
    if context not in _TORCH_CONTEXT:
        raise ValueError(f"_record_memory_history: context must be one of {_TORCH_CONTEXT}, got {context!r}")
    if stacks not in _TORCH_STACKS:
        raise ValueError(f"_record_memory_history: stacks must be one of {_TORCH_STACKS}, got {stacks!r}")
    if not isinstance(max_entries, int) or isinstance(max_entries, bool):
        raise ValueError(f"_record_memory_history: max_entries must be an int, got {max_entries!r}")
    record_history(enabled=enabled is not None, stacks=stacks if context is not None else None,
                   max_entries=max(1, max_entries), trace=enabled == "all", clear_history=bool(clear_history),
                   context=context or "alloc", skip_actions=skip_actions, compile_context=compile_context)


def set_memory_metadata(metadata):
    """torch.cuda.memory._set_memory_metadata: history events from now on carry `metadata`
    as their user_metadata (Note [Live trace ring])."""
    if not isinstance(metadata, str):
        raise TypeError(f"_set_memory_metadata: metadata must be a str, got {type(metadata).__name__}")
    runtime = _stats._runtime()
    with _metadata_lock:
        _metadata["current"] = metadata
        for device in runtime.runtime_devices():
            marks = _metadata["marks"].setdefault(device, [])
            if marks and marks[-1][1] == metadata:
                continue  # still in force
            if _recording["max_entries"] == 0:
                marks.clear()  # no events are kept: only the mark in force can ever apply
            marks.append((runtime.runtime_sequence(device), metadata))


def get_memory_metadata():
    """torch.cuda.memory._get_memory_metadata: the string _set_memory_metadata last set."""
    return _metadata["current"]


def _metadata_at(marks, sequence):
    """The metadata in force for an event of `sequence`: the last mark set before it
    (marks ascend by sequence)."""
    i = bisect.bisect_left(marks, (sequence, "")) - 1
    return marks[i][1] if i >= 0 else ""


_SKIP_ALIASES = {"segment_alloc": "segment_map", "segment_free": "segment_unmap"}
_FREE_ACTIONS = ("free_requested", "free_completed", "segment_unmap")


def _shape_history(result, core, device_id):
    """Applies the recording's context, skip_actions and metadata to a snapshot's events."""
    with _metadata_lock:
        marks = list(_metadata["marks"].get(device_id, ()))
    if marks:
        for converted, entry in zip(result["device_traces"][device_id], core.get("trace", [])):
            converted["user_metadata"] = _metadata_at(marks, int(entry.get("sequence", 0)))
    context = _recording["context"]
    skip = set(_recording["skip_actions"])
    skip |= {_SKIP_ALIASES[a] for a in skip if a in _SKIP_ALIASES}
    events = [e for e in result["device_traces"][device_id] if e["action"] not in skip]
    for event in events:
        if context == "state" or (context == "alloc" and event["action"] in _FREE_ACTIONS):
            event["frames"] = []
    result["device_traces"][device_id] = events
    return result
