"""SizingPolicy: which micro-batch the next step runs, from what earlier steps showed.

The arithmetic half of BatchSizeController (batch/controller.py), kept apart
from running micro-steps so it can be read and tested alone: no torch, no
I/O, no collectives. The controller feeds it what happened (an OOM at a size,
a clean step's peak above its baseline, the budget) and asks for sizes; the
notes on how sizes move (Note [Moving the micro-batch], Note [Probing without
figures], Note [Calibration step]) are in controller.py's banner.
"""

from torchmem.batch.model import LinearMemoryModel

_BUDGET_RISE = 1.02  # a budget this much above the one at the last OOM counts as "rose"
# Without figures, each probe that OOMs multiplies the clean steps before the next one
# by this, up to _PROBE_BACKOFF ** _PROBE_BACKOFF_MAX (Note [Probing without figures]).
_PROBE_BACKOFF = 4
_PROBE_BACKOFF_MAX = 3


class SizingPolicy:
    """Sizes on a grid (multiples of `quantum`, powers of two below it, at least
    `min_micro`), a fitted memory line, a ceiling from OOMs and upward probes.
    `record(kind, before, after, reason)` is told of ceiling changes."""

    def __init__(self, *, quantum, min_micro, margin, grow_after, window, record):
        self.quantum = quantum
        self.min_micro = min_micro
        self.margin = margin
        self.grow_after = grow_after
        self.memory_model = LinearMemoryModel(window)
        self._record = record
        self.ceiling = None          # smallest size that OOMed since memory last changed
        self.ceiling_budget = None   # the budget when it did
        self.baseline = None         # bytes in use when the last attempt began
        self.probe_size = None       # a size tried by probe_up, until it runs or OOMs,
        self.probe_from = None       # and the size that held before it
        self.failed_probes = 0       # probes that OOMed since one last held
        self.clean_steps = 0
        self.last_reason = ""

    def quantize(self, size, cap):
        """The largest allowed size <= `size` (Note [Moving the micro-batch])."""
        size = int(size)
        if size >= cap:
            return cap
        if size >= self.quantum:
            size = size // self.quantum * self.quantum
        else:
            size = 1 << (max(1, size).bit_length() - 1)
        return max(size, min(self.min_micro, cap))

    def target(self, budget):
        """Bytes a step may add above its baseline: budget x (1 - margin) - baseline."""
        if budget is None:
            return None
        return budget * (1.0 - self.margin) - (self.baseline or 0)

    # ------------------------------------------------------------ after an OOM
    def shrink_target(self, micro, budget, cap):
        """The size to retry at after an OOM at `micro` (always < micro; 0 below 1)."""
        best = self.memory_model.largest_under(self.target(budget))
        if self.probe_size is not None and self.probe_from < self.probe_size <= micro:
            size = self.probe_from  # a probe up failed: back to the size that held
        elif best is not None and best < micro:
            size = best
        elif self.memory_model.ready:
            size = micro * 3 // 4
        else:
            size = micro // 2
        return self.quantize(min(size, micro - 1), cap) if micro > 1 else 0

    def fitting_below(self, micro, budget, cap):
        """The size the model says fits `budget` when `micro` no longer does, or None (it
        still fits, the model is not ready, or nothing allowed fits: an OOM will tell)."""
        fit = self.memory_model.largest_under(self.target(budget))
        if fit is None or fit >= micro or micro <= 1:
            return None
        size = self.quantize(min(fit, micro - 1), cap)
        return size if 1 <= size < micro else None

    def note_oom(self, micro, budget, oom_here):
        """An attempt at `micro` failed (here, or on another rank)."""
        if oom_here:
            self.ceiling = micro if self.ceiling is None else min(self.ceiling, micro)
            self.ceiling_budget = budget
            if self.probe_size is not None and micro >= self.probe_size:
                self.failed_probes += 1
        self.probe_size = None
        self.clean_steps = 0

    # ------------------------------------------------------- after a clean step
    def note_success(self, micro, peak_above_baseline):
        """A step at `micro` ran; its peak above the baseline, or None without figures."""
        self.clean_steps += 1
        if self.probe_size is not None and micro >= self.probe_size:
            self.failed_probes = 0  # the probe held: memory is no tighter than it was
            self.probe_size = None
        if peak_above_baseline is not None:
            self.memory_model.observe(micro, peak_above_baseline)

    def grow_or_keep(self, micro, peak, budget, cap):
        """The size to propose for the next step after a clean one at `micro`."""
        if (self.ceiling is not None and budget is not None and self.ceiling_budget is not None
                and budget > self.ceiling_budget * _BUDGET_RISE):
            self._record("ceiling", self.ceiling, None, f"budget rose to {budget} bytes")
            self.ceiling = None
        target = self.target(budget)
        best = self.memory_model.largest_under(target)
        if best is None:
            return self.probe_up(micro, cap)
        candidate = self.quantize(best, cap)
        if self.ceiling is not None and candidate >= self.ceiling:
            predicted = self.memory_model.predict(self.ceiling)
            if self.clean_steps >= self.grow_after and predicted is not None and predicted <= target:
                self._record("ceiling", self.ceiling, None,
                             f"{self.clean_steps} clean steps and the model says it fits now")
                self.ceiling = None
            else:
                candidate = min(candidate, self.quantize(self.ceiling - 1, cap))
        if candidate > micro:
            self.last_reason = (f"model: peak ~ {self.baseline or 0} + {self.memory_model.fixed:.0f} + "
                                f"{self.memory_model.slope:.0f} x micro")
            return candidate
        calibration = self.calibration_size(micro, cap)
        if calibration is not None:
            self.last_reason = ("calibration: one size measured, the cold-start bound allows no growth; "
                                "a smaller step measures the memory line")
            return calibration
        if candidate < micro and peak is not None and budget is not None and peak > budget * (1 - self.margin):
            self.last_reason = f"peak {peak} above budget x (1 - margin) = {budget * (1 - self.margin):.0f}"
            return max(1, candidate)
        return micro

    def returnable(self, micro, owned, seconds_per_sample, max_step_s, cap):
        """`micro`, or the largest size whose micro-step lasts <= max_step_s when `micro`
        needs more than `owned` bytes (borrowed memory: Note [Borrowed memory comes back
        fast] in controller.py). Sizes that fit `owned` are never capped. Before a pace is
        measured (`seconds_per_sample` None) no size beyond `owned` is allowed: how long its
        micro-step would hold borrowed memory is unknown. Without a guarantee or a ready
        model, `micro` stands."""
        if owned is None or micro <= 1:
            return micro
        fits_owned = self.memory_model.largest_under(self.target(owned))
        if fits_owned is None or micro <= fits_owned:
            return micro
        if seconds_per_sample is None:
            allowed = min(micro, self.quantize(max(1, fits_owned), cap))
            if allowed < micro:
                self.last_reason = "borrowed memory: no pace measured yet, so no size beyond the guarantee"
            return allowed
        quick = self.quantize(max(1, int(max_step_s / seconds_per_sample)), cap)
        allowed = max(quick, self.quantize(max(1, fits_owned), cap))
        if allowed >= micro:
            return micro
        self.last_reason = (f"borrowed memory: a micro-step of {micro} takes ~{micro * seconds_per_sample:.2f} s, "
                            f"over {max_step_s} s")
        return allowed

    def probe_up(self, micro, cap):
        """Without memory figures: a size above `micro` to try after enough clean steps, else
        `micro` (Note [Probing without figures])."""
        wait = self.grow_after * _PROBE_BACKOFF ** min(self.failed_probes, _PROBE_BACKOFF_MAX)
        if self.clean_steps < wait or micro >= cap:
            return micro
        upper = self.ceiling if self.ceiling is not None else min(cap, 2 * micro)
        candidate = self.quantize((micro + upper) // 2, cap)
        if candidate <= micro:  # no grid size between: try the upper end itself
            candidate = self.quantize(upper, cap)
        if candidate <= micro:
            return micro
        if self.ceiling is not None and candidate >= self.ceiling:
            self._record("ceiling", self.ceiling, None, f"{self.clean_steps} clean steps: trying it again")
            self.ceiling = None
        self.clean_steps = 0
        self.probe_size, self.probe_from = candidate, micro
        self.last_reason = f"probing up after {wait} clean steps"
        return candidate

    def calibration_size(self, micro, cap):
        """Half of `micro` when a calibration step is due (Note [Calibration step]), else None."""
        if self.memory_model.measured or micro >= cap:
            return None
        next_up = self.quantize(micro + self.quantum if micro >= self.quantum else 2 * micro, cap)
        if next_up <= micro or (self.ceiling is not None and next_up >= self.ceiling):
            return None
        smaller = self.quantize(micro // 2, cap)
        return smaller if max(1, self.min_micro) <= smaller < micro else None

    # ------------------------------------------------------------------ state
    def state_dict(self):
        return {"ceiling": self.ceiling, "ceiling_budget": self.ceiling_budget, "baseline": self.baseline,
                "clean_steps": self.clean_steps, "failed_probes": self.failed_probes,
                "memory_model": self.memory_model.state_dict()}

    def load_state_dict(self, state):
        self.ceiling = state["ceiling"]
        self.ceiling_budget = state["ceiling_budget"]
        self.baseline = state.get("baseline")
        self.clean_steps = int(state["clean_steps"])
        self.failed_probes = int(state.get("failed_probes", 0))
        self.memory_model.load_state_dict(state["memory_model"])
