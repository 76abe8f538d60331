"""A check that a torch-format snapshot's trace and segments agree the way the memory_viz page needs.

The page (torch/utils/viz/MemoryViz.js) draws the allocator's state at any
event by starting from the snapshot's segments and undoing trace events from
the end. If an undone event finds nothing to undo, or a live block lies outside
every segment, the page breaks. torch's wheel does not ship MemoryViz.js, so this
mirrors its walk in Python (annotate_snapshot + simulate_memory).
"""


def undo_like_memory_viz(snap, device=0):
    """Walks the trace backwards from the final state the way the memory_viz page's segment
    view does (MemoryViz.js: annotate_snapshot + simulate_memory) and checks at every step
    that each live block lies inside a segment and each undone event finds what it undoes.
    Returns the number of steps checked."""
    segments = sorted([s["address"], s["total_size"]] for s in snap["segments"] if s["device"] == device)
    blocks = {b["address"]: b["size"] for s in snap["segments"] for b in s["blocks"]
              if b["state"] in ("active_allocated", "active_pending_free")}
    events = []
    for e in snap["device_traces"][device]:  # the page elides free_requested + free_completed into "free"
        if e["action"] == "free_completed" and events and events[-1]["action"] == "free_requested" \
                and events[-1]["addr"] == e["addr"]:
            events[-1] = dict(events[-1], action="free")
        else:
            events.append(e)

    def containing(addr, size):
        for index, (start, length) in enumerate(segments):
            if start <= addr and addr + size <= start + length:
                return index
        return None

    for step, e in enumerate(reversed(events)):
        action, addr, size = e["action"], e["addr"], e["size"]
        if action == "alloc":
            assert blocks.pop(addr, None) is not None, f"undo alloc: no live block at {addr:#x}"
        elif action in ("free", "free_completed"):
            blocks[addr] = size
        elif action == "free_requested":
            assert addr in blocks, f"undo free_requested: no block at {addr:#x}"
        elif action == "segment_map":  # undo: cut the range out of the segment holding it
            index = containing(addr, size)
            assert index is not None, f"undo segment_map: {addr:#x}+{size} is in no segment"
            start, length = segments.pop(index)
            pieces = [[start, addr - start], [addr + size, start + length - addr - size]]
            segments.extend(p for p in pieces if p[1] > 0)
            segments.sort()
        elif action == "segment_unmap":  # undo: map the range back, merging with neighbours
            assert containing(addr, 1) is None, f"undo segment_unmap: {addr:#x} is already mapped"
            segments.append([addr, size])
            segments.sort()
            merged = []
            for start, length in segments:
                if merged and merged[-1][0] + merged[-1][1] == start:
                    merged[-1][1] += length
                else:
                    merged.append([start, length])
            segments = merged
        for block_addr in blocks:
            assert containing(block_addr, 1) is not None, f"block {block_addr:#x} outside every segment at step {step}"
    return len(events)
