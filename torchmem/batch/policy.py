"""SizingPolicy: which micro-batch the next step runs, from what earlier steps showed.

The arithmetic half of BatchSizeController (batch/controller.py), kept apart
from running micro-steps so it can be read and tested alone: no torch, no
I/O, no collectives. The controller feeds it what happened (an OOM at a size,
a clean step's peak above its baseline, the budget) and asks for sizes.

Note [Moving the micro-batch]
- Down: on OOM at size m the controller records m as a ceiling and retries at
  the model's prediction (below m), or at m/2 while it has no model (cold
  start), or at 3m/4 when the model said m fits (it was wrong: fragmentation,
  memory outside the probe's view). It also shrinks without an OOM when a
  clean step peaked above budget x (1 - margin): the budget fell.
- Up: to the model's prediction at once, but never to or past the ceiling.
  The ceiling lifts when the budget rises (then the jump is immediate) or
  after `grow_after` clean steps if the model says the ceiling size now fits
  (hysteresis: an OOM is not risked again until memory looks different).
  Without figures (CPU, no probe): Note [Probing without figures].
- Note [Probing without figures] With no memory figures only OOMs say what
  fits, and memory may have freed since the last one. After `grow_after`
  clean steps the controller tries a larger size: half way to the ceiling,
  or the ceiling itself when no grid size lies between (8 -> 16 with
  quantum 8); with no ceiling, half way to twice the size, or the whole
  batch. A probe that OOMs puts the ceiling back, the same batch is retried
  at the size that held before, and the wait before the next probe grows 4x
  (hysteresis: at most one OOM per wait, fewer and fewer while memory stays
  tight); a probe that holds resets the wait to `grow_after`.
- Note [Calibration step] From a cold start the slope is an upper bound
  (batch/model.py Note [Cold start]); when a step's fixed bytes are large it
  predicts that nothing above the size in use fits, and a model that only ever
  sees one size never learns better (seen on the H200: GPT-2 settled at 16
  where 24 fit). So once, while the line is unmeasured and the next size up is
  below the ceiling, the next step runs at half the size: a size that surely
  fits, and the second point that turns the bound into the line.
- Sizes: under objective="largest", multiples of `quantum` (8 by default),
  powers of two below it, or the whole local batch, so torch.compile sees few
  distinct shapes; under "throughput", the largest chunks of balanced splits
  (64: 64, 32, 22, 16, 13, ...), and max_sizes bounds how many are tried.
  There the calibration step runs the next smaller count instead of half the
  size (batch/throughput.py): any smaller size measures the line, and that
  one is worth timing anyway.

Note [Shrinking inside a step]
A budget can fall in the middle of a step: a sharing owner claims its
memory back (share/agent.py), or the user lowers the limit. Without
a look between micro-steps the next one runs out of memory, and the
whole batch runs again, its finished micro-steps thrown away; a borrower
also holds the owner's memory until then. So before each micro-step
after the first (one process only: ranks must keep their micro-step
counts in step) the controller reads the budget, and when it fell
below what the model predicts the current size needs, the samples not
yet run are split again at the size that fits. Each micro-batch keeps
the weight of its share of the batch, so the gradient is the same.
The size comes from fitting_below; the re-split is the controller's.

Note [Borrowed memory comes back fast]
A process that shares its GPU (docs/sharing.md) gives borrowed live memory
back between micro-steps, so an owner that claims its share waits for the
borrower's current micro-step to end. On the H200 a borrower that grew to
micro-batch 224 ran ~2 s micro-steps and an owner waited 3.1 s, against the
1 s the sharing promise allows; with this rule the owner's wait was 1.0 s
(BENCHMARKS.md, Sharing and monitoring). So a size that needs
borrowed memory (more than the model says fits the guarantee, probe.owned_bytes)
is allowed only while one micro-step of it lasts at most
controller.py's _BORROWED_MICRO_STEP_S, judged by the seconds per sample of recent steps
(the time between the ends of consecutive clean steps, which in steady state
is the GPU's pace), and not at all before a pace is measured: on the H200 a
borrower that grew before its second step ended reached micro-batch 224.
Sizes that fit the guarantee are never capped. A step of
a big batch then runs as more, shorter micro-steps: on a busy GPU a larger
micro-batch buys little speed, and the owner's wait is bounded.
"""

from torchmem.batch.model import LinearMemoryModel

_BUDGET_RISE = 1.02  # a budget this much above the one at the last OOM counts as "rose"
# Without figures, each probe that OOMs multiplies the clean steps before the next one
# by this, up to _PROBE_BACKOFF ** _PROBE_BACKOFF_MAX (Note [Probing without figures]).
_PROBE_BACKOFF = 4
_PROBE_BACKOFF_MAX = 3


class SizingPolicy:
    """Sizes on a grid, a fitted memory line, a ceiling from OOMs and upward
    probes. The grid: multiples of `quantum` (powers of two below it, at least
    `min_micro`), or with grid="balanced" the largest chunks of balanced splits
    of the batch (64: 64, 32, 22, 16, 13, 11, ...; Note [Candidates are
    micro-step counts] in batch/throughput.py). `record(kind, before, after,
    reason)` is told of ceiling changes; `last_kind` says what the last
    grow_or_keep did ("grow", "keep", "shrink", "calibrate", "probe",
    "borrowed")."""

    def __init__(self, *, quantum, min_micro, margin, grow_after, window, record, grid="quantum"):
        if grid not in ("quantum", "balanced"):
            raise ValueError(f"SizingPolicy: grid must be 'quantum' or 'balanced', got {grid!r}")
        self.grid = grid
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
        self.last_kind = "keep"

    def quantize(self, size, cap):
        """The largest allowed size <= `size` (Note [Moving the micro-batch])."""
        size = int(size)
        if size >= cap:
            return cap
        if self.grid == "balanced":  # `cap` is the batch: the largest chunk of its fewest chunks of <= size
            size = -(-cap // -(-cap // max(1, size)))
        elif size >= self.quantum:
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
        self.last_kind = "keep"
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
            self.last_kind = "grow"
            return candidate
        calibration = self.calibration_size(micro, cap)
        if calibration is not None:
            self.last_reason = ("calibration: one size measured, the cold-start bound allows no growth; "
                                "a smaller step measures the memory line")
            self.last_kind = "calibrate"
            return calibration
        if candidate < micro and peak is not None and budget is not None and peak > budget * (1 - self.margin):
            self.last_reason = f"peak {peak} above budget x (1 - margin) = {budget * (1 - self.margin):.0f}"
            self.last_kind = "shrink"
            return max(1, candidate)
        return micro

    def returnable(self, micro, owned, seconds_per_sample, max_step_s, cap):
        """`micro`, or the largest size whose micro-step lasts <= max_step_s when `micro`
        needs more than `owned` bytes (borrowed memory: Note [Borrowed memory comes back
        fast]). Sizes that fit `owned` are never capped. Before a pace is
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
                self.last_kind = "borrowed"
            return allowed
        quick = self.quantize(max(1, int(max_step_s / seconds_per_sample)), cap)
        allowed = max(quick, self.quantize(max(1, fits_owned), cap))
        if allowed >= micro:
            return micro
        self.last_reason = (f"borrowed memory: a micro-step of {micro} takes ~{micro * seconds_per_sample:.2f} s, "
                            f"over {max_step_s} s")
        self.last_kind = "borrowed"
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
        self.last_kind = "probe"
        return candidate

    def calibration_size(self, micro, cap):
        """Half of `micro` when a calibration step is due (Note [Calibration step]), else None."""
        if self.memory_model.measured or micro >= cap:
            return None
        if self.grid == "balanced":
            count = -(-cap // micro)
            next_up = cap if count <= 1 else -(-cap // (count - 1))
        else:
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
