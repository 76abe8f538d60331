"""Memory probes: where the batch-size controller reads peak memory and the budget.

The controller needs three things from the memory system: "reset the peak now",
"the peak since then" and "how many bytes may this process hold". A probe is
that interface and nothing more, so the controller runs the same way over
torchmem's allocator, over PyTorch's native caching allocator, over a synthetic
model in CPU tests, or with no figures at all (CPU training: it then learns only
from OOMs).

Note [Which bytes count]
The peak is *allocated* bytes (live blocks as the allocator rounds them), not
reserved bytes: allocated peak is a clean function of the micro-batch, while
reserved peak depends on what earlier, larger steps left cached. Under torchmem
allocated bytes are also what the budget ("torchmem.limit_bytes") is checked
against, so the fit is tight. Under the native allocator fragmentation makes
reserved exceed allocated (1.6x-2x on real traces), which the controller's
margin must absorb: that is the "less precision without torchmem".
"""

import torch

from torchmem._loader import is_installed
from torchmem.runtime import budget, stats

__all__ = ["MemoryProbe", "NullProbe", "TorchProbe", "TorchmemProbe", "SyntheticMemory", "default_probe"]


class MemoryProbe:
    """Interface. Every method may return None when the figure is unknown."""

    name = "abstract"
    # The controller's margin when the user gives none: the share of the budget
    # kept free for what the figures do not show (fragmentation, stray tensors).
    default_margin = 0.05

    def reset(self):
        """Starts a measurement window: the peak restarts from the current usage."""

    def peak_bytes(self):
        """Peak bytes in use since the last reset(), or None."""
        return None

    def current_bytes(self):
        """Bytes in use now, or None."""
        return None

    def budget_bytes(self):
        """Bytes this process may use in all, or None when there is no known limit."""
        return None

    def owned_bytes(self):
        """Bytes this process keeps whatever its neighbours do (its guaranteed share when it
        shares a GPU, docs/sharing.md), or None when it does not share: above this, the budget
        is borrowed and must come back when the owner asks."""
        return None


class NullProbe(MemoryProbe):
    """No figures (CPU, or a backend without stats): the controller learns from OOMs only."""

    name = "none"


def _device_index(device):
    """An int device index, or None for "the current device" (resolved by each
    call, so building a probe does not initialize CUDA)."""
    if device is None or isinstance(device, int):
        return device
    return torch.device(device).index


class TorchProbe(MemoryProbe):
    """PyTorch's native caching allocator (torch.cuda.max_memory_allocated ...).

    The budget is the smaller of set_per_process_memory_fraction x total and what
    this process could still get (free device memory + what it already reserves)."""

    name = "torch"

    def __init__(self, device=None):
        self.device = _device_index(device)

    def reset(self):
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self):
        return int(torch.cuda.max_memory_allocated(self.device))

    def current_bytes(self):
        return int(torch.cuda.memory_allocated(self.device))

    def budget_bytes(self):
        free, total = torch.cuda.mem_get_info(self.device)
        get_fraction = getattr(torch.cuda.memory, "get_per_process_memory_fraction", None)
        fraction = get_fraction(self.device) if get_fraction is not None else 1.0
        reachable = free + int(torch.cuda.memory_reserved(self.device))
        return int(min(fraction * total, reachable))


class TorchmemProbe(MemoryProbe):
    """torchmem's allocator: its stats and its budget ("torchmem.limit_bytes").

    Its margin is 1%: the budget is a hard cap on reserved bytes, and near it
    the pool packs reserved to within 0.2% of requested on four of the six
    bundled traces and 1.2-1.5% on the other two (KV-cache decoding, FSDP2 with
    32 micro-batches; the replay's min-cap; BENCHMARKS.md, Memory), so allocated bytes, which
    these figures read, are what counts; a wrong prediction costs one recovered
    OOM, after which the ceiling holds. Under the native allocator (TorchProbe)
    fragmentation hides up to tens of percent: 5%."""

    name = "torchmem"
    default_margin = 0.01

    def __init__(self, device=None):
        self.device = _device_index(device)

    def _stats(self):
        return stats.memory_stats(self.device)

    def reset(self):
        stats.reset_peak_memory_stats(self.device)

    def peak_bytes(self):
        return int(stats.max_memory_allocated(self.device))

    def current_bytes(self):
        return int(stats.memory_allocated(self.device))

    def budget_bytes(self):
        figures = self._stats()
        limit = int(figures.get("torchmem.limit_bytes", 0) or 0)
        if limit and budget.elastic():  # the arbiter's grant: borrowers give it back on demand (docs/sharing.md)
            return limit
        free, total = torch.cuda.mem_get_info(self.device)
        reachable = free + int(figures.get("reserved_bytes.all.current", 0))
        return min(limit, reachable) if limit else reachable

    def owned_bytes(self):
        return budget.owned_bytes(self.device)


class SyntheticMemory(MemoryProbe):
    """A memory model for tests and docs: a step over `micro` samples needs
    fixed + step_fixed + per_sample * micro bytes and raises
    torch.OutOfMemoryError when that exceeds `budget`. `fixed` is in use
    between steps (parameters, optimizer state); `step_fixed` is what every step
    adds whatever its size (gradients, workspaces). Call `use(micro)` inside the
    step function; change `budget` at any time to simulate a card that frees up
    or fills up."""

    name = "synthetic"

    def __init__(self, fixed, per_sample, budget, step_fixed=0, owned=None):
        self.fixed = int(fixed)
        self.owned = owned  # a sharing process's guarantee (owned_bytes), None when not sharing
        self.step_fixed = int(step_fixed)
        self.per_sample = int(per_sample)
        self.budget = int(budget)
        self._peak = self.fixed
        self.ooms = 0
        self.sizes_tried = []

    def need(self, micro):
        """Bytes a step over `micro` samples needs."""
        return self.fixed + self.step_fixed + self.per_sample * micro

    def largest_fitting(self):
        """The largest micro-batch that does not OOM (0 if none)."""
        return max(0, (self.budget - self.fixed - self.step_fixed) // self.per_sample)

    def use(self, micro):
        """Simulates the memory of one micro-step (raises OOM above the budget)."""
        self.sizes_tried.append(micro)
        need = self.need(micro)
        if need > self.budget:
            self.ooms += 1
            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate {need - self.fixed} bytes (synthetic budget {self.budget})"
            )
        self._peak = max(self._peak, need)

    def reset(self):
        self._peak = self.fixed

    def peak_bytes(self):
        return self._peak

    def current_bytes(self):
        return self.fixed

    def budget_bytes(self):
        return self.budget

    def owned_bytes(self):
        return self.owned


def default_probe(device=None):
    """torchmem's figures when its allocator is installed, else torch's own on
    CUDA, else none (CPU)."""
    if device is not None and torch.device(device).type != "cuda":
        return NullProbe()
    if not torch.cuda.is_available():
        return NullProbe()
    if is_installed():
        return TorchmemProbe(device)
    return TorchProbe(device)
