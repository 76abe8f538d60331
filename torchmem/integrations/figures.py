"""Per-step memory figures for training-loop callbacks (Lightning, HF Trainer).

One function both callbacks use, so they log the same names: peak requested
and reserved bytes since the last reset, their ratio (fragmentation), the
controller's micro-batch when one is attached (with its measured samples/s and
whether its throughput choice has settled), and under torchmem's allocator
the figures `top` and the Prometheus metrics show (torchmem.monitor.figures:
live, cached, largest free block, limit, OOMs, reclaims, driver calls...).
`new_decisions` gives the controller's choices (with their reasons) that a
callback has not shown yet.
Figures come from torchmem's stats when its allocator is installed, else from torch.cuda.memory_stats
(the native allocator has the same keys), else nothing (CPU).
"""

import torch

import torchmem
from torchmem import monitor
from torchmem._loader import is_installed as _installed
from torchmem.runtime.stats import device_index

__all__ = ["memory_figures", "reset_peaks", "new_decisions"]


def _stats(device):
    if _installed():
        return torchmem.memory_stats(device)
    return torch.cuda.memory_stats(device)


def reset_peaks(device=None):
    """Restarts every peak figure (call at the start of a step)."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return
    if _installed():
        torchmem.reset_peak_memory_stats(device)
    else:
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device=None, controller=None, prefix="torchmem/"):
    """{prefix+name: number}: peak_requested_gib, peak_reserved_gib,
    reserved_over_requested, under torchmem the monitor's figures (live_bytes,
    reserved_bytes, cached_bytes, ..., ooms_total), and with a controller
    micro_batch, accumulation_steps, ooms. Empty without CUDA."""
    figures = {}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        stats = _stats(device)
        requested = stats.get("requested_bytes.all.peak", 0) or stats.get("allocated_bytes.all.peak", 0)
        reserved = stats.get("reserved_bytes.all.peak", 0)
        figures["peak_requested_gib"] = requested / 2**30
        figures["peak_reserved_gib"] = reserved / 2**30
        figures["reserved_over_requested"] = reserved / requested if requested else 0.0
        if _installed():  # live, cached, largest free block, budget, OOMs... (the metrics' names)
            figures.update(monitor.figures(device_index(device)))
    if controller is not None:
        figures["micro_batch"] = controller.micro_batch
        figures["accumulation_steps"] = controller.accumulation_steps
        figures["ooms"] = controller.ooms
        if getattr(controller, "objective", None) == "throughput":
            state = controller.figures()
            if state.get("samples_per_s") is not None:
                figures["samples_per_s"] = state["samples_per_s"]
            figures["batch_settled"] = bool(state.get("settled"))
    return {prefix + name: float(value) for name, value in figures.items()}


def new_decisions(controller, after=0):
    """(lines, last): the controller's decisions numbered above `after`, one line each
    ("step 3: settle 13 -> 16 (fastest within 2%: ...)"), and the number of the last
    one, to pass as `after` next time."""
    if controller is None:
        return [], after
    events = [e for e in controller.events if e.get("seq", 0) > after]
    lines = [f"step {e['step']}: {e['event']} {e['from']} -> {e['to']} ({e['reason']})" for e in events]
    return lines, max([after] + [e["seq"] for e in events])
