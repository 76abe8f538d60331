"""Leak check: which allocations made inside a block are still alive at its end.

    with torchmem.leak_check() as report:        # raises LeakError on a leak
        for _ in range(10):
            train_step()

At entry the check reads the allocator's snapshot and remembers every live
block; at exit (after a gc.collect(), so garbage in reference cycles does not
count) it reads it again. With history recording (torchmem.record_history), the
trace says exactly which blocks were allocated inside the block and never
freed; without it, live blocks that were not live at entry (by address, size
and requested size) are reported. Blocks the program freed but that wait on
another stream (active_pending_free) are not leaks. Stacks are shown when they
were recorded (record_history(stacks="python")).

Works on the installed allocator (device=...) and on a torchmem._C.Pool (pool=...).

Note [Warm-up allocations]
A first call of some torch functions allocates long-lived workspaces (cuBLAS,
cuDNN) that look exactly like a leak. They are allocations made inside the
block and still alive, so they are reported; run one step before the check, or
set min_bytes to ignore small ones.
"""

import dataclasses
import gc
import logging
import warnings

from torchmem.runtime import stats
from torchmem.runtime.snapshots import stack_frames
from torchmem.runtime.stats import format_bytes

_log = logging.getLogger("torchmem")


class LeakError(RuntimeError):
    """Raised by leak_check(action="raise") when allocations made inside it are still alive."""

    def __init__(self, report):
        super().__init__(report.describe())
        self.report = report


@dataclasses.dataclass(frozen=True)
class LeakedBlock:
    address: int
    size: int            # rounded size held
    requested_size: int  # size the program asked for
    stream: int
    frames: tuple        # ({filename, line, name}, ...), innermost first; () when not recorded


class LeakReport:
    """What leak_check found; filled in when the `with` block exits."""

    def __init__(self):
        self.leaks = []
        self.checked = False
        self.used_trace = False

    @property
    def leaked_bytes(self):
        return sum(block.requested_size for block in self.leaks)

    def __bool__(self):
        return bool(self.leaks)

    def describe(self, limit=10):
        if not self.checked:
            return "leak check not finished"
        if not self.leaks:
            return "no leaks: every allocation made inside leak_check was freed"
        lines = [
            f"{len(self.leaks)} allocation(s), {format_bytes(self.leaked_bytes)} requested, made inside "
            f"torchmem.leak_check() are still alive:"
        ]
        for block in sorted(self.leaks, key=lambda b: -b.size)[:limit]:
            where = ""
            if block.frames:
                top = block.frames[0]
                where = f" allocated at {top['filename']}:{top['line']} in {top['name']}"
            lines.append(f"  {format_bytes(block.requested_size)} at {block.address:#x} (stream {block.stream}){where}")
        if len(self.leaks) > limit:
            lines.append(f"  ... and {len(self.leaks) - limit} more")
        if not any(block.frames for block in self.leaks):
            lines.append("  (call torchmem.record_history(stacks='python') before the check to see where they were allocated)")
        return "\n".join(lines)

    def __str__(self):
        return self.describe()


def _core_snapshot(device, pool):
    if pool is not None:
        return pool.snapshot()

    return stats._runtime().runtime_snapshot(stats.device_index(device))


def _live_blocks(core):
    return {
        block["address"]: (block, segment)
        for segment in core["segments"]
        for block in segment["blocks"]
        if block["state"] == "active_allocated"
    }


def _allocated_inside(core, after_sequence):
    """Addresses allocated after `after_sequence` and not freed since, per the trace; None
    when the trace does not reach back to `after_sequence` (ring overflowed or empty)."""
    trace = core.get("trace") or []
    if after_sequence is None or not trace or trace[0]["sequence"] > after_sequence:
        return None
    inside = set()
    for entry in trace:
        if entry["sequence"] <= after_sequence:
            continue
        if entry["action"] == "alloc":
            inside.add(entry["addr"])
        elif entry["action"] == "free_requested":
            inside.discard(entry["addr"])
    return inside


class leak_check:  # noqa: N801 (used as a context manager, named like a function)
    """Context manager reporting allocations made inside it and still alive at its end.

    action: "raise" (LeakError), "warn" (warnings.warn) or "ignore" (just fill the report).
    min_bytes: ignore leaks whose requested size is below this. collect: gc.collect() first.
    """

    def __init__(self, action="raise", pool=None, device=None, min_bytes=0, collect=True):
        if action not in ("raise", "warn", "ignore"):
            raise ValueError(f"torchmem.leak_check: action must be 'raise', 'warn' or 'ignore', got {action!r}")
        self.action = action
        self.pool = pool
        self.device = device
        self.min_bytes = min_bytes
        self.collect = collect
        self.report = LeakReport()
        self._before = None
        self._sequence = None

    def __enter__(self):
        if self.collect:
            gc.collect()
        core = _core_snapshot(self.device, self.pool)
        self._before = {
            addr: (block["size"], block.get("requested_size"), block.get("context"))
            for addr, (block, _) in _live_blocks(core).items()
        }
        trace = core.get("trace") or []
        self._sequence = trace[-1]["sequence"] if trace else None
        return self.report

    def __exit__(self, exc_type, exc, tb):
        if self.collect:
            gc.collect()
        core = _core_snapshot(self.device, self.pool)
        live = _live_blocks(core)
        inside = _allocated_inside(core, self._sequence)
        self.report.used_trace = inside is not None
        if inside is None:
            inside = {
                addr for addr, (block, _) in live.items()
                if self._before.get(addr) != (block["size"], block.get("requested_size"), block.get("context"))
            }

        for addr in sorted(inside & live.keys()):
            block, segment = live[addr]
            requested = int(block.get("requested_size", block["size"]))
            if requested < self.min_bytes:
                continue
            self.report.leaks.append(LeakedBlock(
                address=int(addr), size=int(block["size"]), requested_size=requested,
                stream=int(block.get("stream", segment.get("stream", 0))),
                frames=tuple(stack_frames(block.get("context", 0))),
            ))
        self.report.checked = True
        if exc_type is not None or not self.report.leaks:
            return False  # never hide the body's own exception behind a leak report
        if self.action == "raise":
            raise LeakError(self.report)
        if self.action == "warn":
            message = self.report.describe()
            _log.warning(message)
            warnings.warn(message, RuntimeWarning, stacklevel=2)
        return False
