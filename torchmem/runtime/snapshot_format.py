"""Converts the core's snapshot dict into PyTorch's memory-snapshot format.

PyTorch's tools (torch.cuda._memory_viz: stats, trace_plot, segment_plot, and
the pytorch.org/memory_viz page) read the dict torch.cuda.memory._snapshot()
returns. The core (_C.Pool.snapshot(), _C.runtime_snapshot()) gives its own,
smaller dict; this module maps one onto the other so torchmem's layout can be
looked at with the tools people already use. It is pure data work, so the same
code serves the installed allocator, simulated pools and trace replays.

Note [Snapshot constraints]
- Blocks must tile their segment contiguously in address order: the viewer
  computes each block's address as the segment's address plus the sizes before
  it. We check that and raise ValueError rather than draw a wrong picture.
- Only dict, list, tuple, str, int, float, bool and None: the browser's
  unpickler knows no other types, and it reads pickle protocols 2-4 only.
- A torchmem "segment" is a maximal mapped run of granules (vmm backend) or one
  cudaMalloc segment (cuda_malloc backend); mapped runs behave like torch's
  expandable segments, so they are marked is_expandable and their trace uses
  segment_map / segment_unmap, as torch's expandable segments do.
- torchmem's trace has no clock: `time_us` carries the pool's operation
  sequence number, which orders events the same way.
"""

_STATES = ("active_allocated", "active_pending_free", "inactive")
_ACTIONS = ("alloc", "free_requested", "free_completed", "segment_map", "segment_unmap", "oom")


def _frames_for(context, frames):
    """Frames for a context id: `frames` is a dict or a callable (id -> list of frame dicts)."""
    if not context or frames is None:
        return []
    found = frames(context) if callable(frames) else frames.get(context)
    return [dict(frame) for frame in found] if found else []


def _convert_block(block, frames):
    state = block["state"]
    if state not in _STATES:
        raise ValueError(f"snapshot block at {block['address']:#x}: unknown state {state!r}; expected one of {_STATES}")
    live = state != "inactive"
    return {
        "address": int(block["address"]),
        "size": int(block["size"]),
        # a free block keeps its last request, as PyTorch's snapshots show (its tests look for it)
        "requested_size": min(int(block.get("requested_size", 0)), int(block["size"])),
        "state": state,
        "frames": _frames_for(block.get("context", 0), frames) if live else [],
    }


def _merge_free_neighbours(blocks):
    """One block for each run of adjacent inactive blocks, as torch's allocator never leaves
    two free neighbours apart. The core merges its free blocks itself; what it reports apart
    is a block parked for a private pool's graphs (Note [Parked blocks in snapshots]), free to
    torch but live to the core: torch's graph-tree checks compare segment layouts block by
    block (TestBlockStateAbsorption)."""
    merged = []
    for block in blocks:
        if merged and block["state"] == "inactive" and merged[-1]["state"] == "inactive":
            merged[-1]["size"] += block["size"]
        else:
            merged.append(block)
    return merged


def _convert_segment(segment, device, frames, expandable):
    address = int(segment["address"])
    total = int(segment["total_size"])
    blocks = [_convert_block(b, frames) for b in sorted(segment["blocks"], key=lambda b: b["address"])]
    cursor = address
    for block in blocks:
        if block["address"] != cursor:
            raise ValueError(
                f"snapshot segment at {address:#x} (size {total}): its blocks do not tile it "
                f"(expected a block at {cursor:#x}, found one at {block['address']:#x})"
            )
        cursor += block["size"]
    if cursor != address + total:
        raise ValueError(
            f"snapshot segment at {address:#x}: blocks cover {cursor - address} bytes of its {total}"
        )
    blocks = _merge_free_neighbours(blocks)
    allocated = [b for b in blocks if b["state"] == "active_allocated"]
    active = [b for b in blocks if b["state"] != "inactive"]
    pool = int(segment.get("pool", 0))
    return {
        "device": device,
        "address": address,
        "total_size": total,
        "allocated_size": sum(b["size"] for b in allocated),
        "active_size": sum(b["size"] for b in active),
        "requested_size": sum(b["requested_size"] for b in active),
        "stream": int(segment.get("stream", 0)),
        "segment_type": "small" if segment.get("small_heap") else "large",
        # torch's own key of a private pool in use (runtime snapshots); else the core's id.
        "segment_pool_id": tuple(segment["pool_key"]) if "pool_key" in segment else (0, pool),
        # a MemPool(allocator=X)'s segments are X's plain allocations, not mapped granules
        "is_expandable": bool(expandable) and not segment.get("plain", False),
        "frames": [],
        "blocks": blocks,
    }


def _convert_trace_entry(entry, frames, compile_contexts):
    action = entry["action"]
    if action not in _ACTIONS:
        raise ValueError(f"snapshot trace entry: unknown action {action!r}; expected one of {_ACTIONS}")
    converted = {
        "action": action,
        "addr": int(entry.get("addr", 0)),
        "size": int(entry.get("size", 0)),
        "stream": int(entry.get("stream", 0)),
        "time_us": int(entry.get("time_us", entry.get("sequence", 0))),  # Note [Snapshot constraints]
        "frames": _frames_for(entry.get("context", 0), frames),
        "user_metadata": str(entry.get("user_metadata", "")),
        # torch's tag of the torch.compile region an event ran in ("N/A": none)
        "compile_context": compile_contexts(entry.get("context", 0)) if compile_contexts else "N/A",
    }
    if action == "oom":
        converted["device_free"] = int(entry.get("device_free", 0))
    return converted


def to_torch_snapshot(core_snapshot, device=0, frames=None, expandable=True, allocator_settings=None,
                      compile_contexts=None):
    """Returns `core_snapshot` (the dict of _C.Pool.snapshot() / _C.runtime_snapshot()) in
    PyTorch's memory-snapshot format: {"segments": [...], "device_traces": [[...] per device],
    "allocator_settings": {...}}. `frames` maps a context id (what record_history's stack
    capture returned) to a list of {filename, line, name}: a dict or a callable. `expandable`:
    whether segments are mapped runs of granules (vmm backend) rather than cudaMalloc segments.
    `compile_contexts` maps a context id to its torch.compile region (a callable; "N/A" if none)."""
    if not isinstance(core_snapshot, dict) or "segments" not in core_snapshot:
        raise ValueError("to_torch_snapshot: expected the core's snapshot dict with a 'segments' list")
    if not isinstance(device, int) or device < 0:
        raise ValueError(f"to_torch_snapshot: device must be an int >= 0, got {device!r}")
    segments = [_convert_segment(s, device, frames, expandable) for s in core_snapshot["segments"]]
    segments.sort(key=lambda s: s["address"])
    traces = [[] for _ in range(device + 1)]
    traces[device] = [_convert_trace_entry(e, frames, compile_contexts) for e in core_snapshot.get("trace", [])]
    settings = {"backend": "torchmem", "expandable_segments": bool(expandable)}
    settings.update(allocator_settings or {})
    return {"segments": segments, "device_traces": traces, "allocator_settings": settings}
