"""The batch controller's last rung: activation offload when even min_micro
does not fit (BatchSizeController(offload="auto")).

Note [Offload rung]
- On: when a step at the smallest micro-batch runs out of memory, the
  controller asks engage() instead of raising MicroBatchOOMError. The first
  engage turns offload on for every eligible saved activation (the safe
  choice, and the step that measures them: torchmem/host/offload.py Note [What
  moves]). A later OOM while a partial plan is in force goes back to moving
  everything; an OOM while everything moves is final (the controller raises).
- Tuning: after each clean offloaded step, with memory figures, the peak
  without offload is estimated as peak + bytes moved (every saved activation
  is alive at the end of forward). If that fits under the controller's
  target, offload turns off: memory allows. Otherwise the budget of
  activations kept on the device becomes what stayed plus 80% of the headroom
  left, so the next steps move only what they must. An OOM under such a
  partial plan halves the share of headroom used next time (no oscillation
  between a plan that fails and one that fits).
- Off again: without figures (CPU, no probe), offload is tried off after
  `grow_after` clean steps. Each time offload has to come back on after being
  turned off, that wait doubles (hysteresis: an OOM is not risked often).
"""

import contextlib

from torchmem.host.offload import OffloadActivations

__all__ = ["OffloadRung"]

_HEADROOM_USE = 0.8


class OffloadRung:
    """Holds the controller's offload state. mode: None/"off" or "auto"."""

    def __init__(self, mode, *, grow_after=50, offload_factory=None):
        if mode not in (None, "off", "auto"):
            raise ValueError(f"BatchSizeController: offload must be None, 'off' or 'auto', got {mode!r}")
        self.enabled = mode == "auto"
        self.active = False
        self.offload = None
        self.offload_factory = offload_factory or OffloadActivations  # budget -> offloader
        self._off_after = grow_after
        self._clean = 0
        self._was_off = False
        self._headroom_use = _HEADROOM_USE

    def forward(self):
        """The context for a micro-step's forward: the offload hooks when on."""
        return self.offload if self.active else contextlib.nullcontext()

    def engage(self):
        """Called when the smallest micro-batch ran out of memory. Returns why
        offload changed, or None when it has nothing more to give."""
        if not self.enabled:
            return None
        self._clean = 0
        if not self.active:
            if self.offload is None:
                self.offload = self.offload_factory(None)
            else:
                self.offload.set_budget(None)
            if self._was_off:
                self._off_after *= 2
            self.active = True
            return "offload on: saved activations move to pinned host memory"
        if self.offload.budget_bytes is not None:
            self._headroom_use /= 2
            self.offload.set_budget(None)
            return "offload back to every eligible activation"
        return None

    def after_success(self, peak, target):
        """Called after a clean step with offload on; `peak` and `target` are
        the step's peak bytes above its baseline... or None without figures.
        Returns a note when it changed something."""
        self._clean += 1
        step = self.offload.last_step
        if peak is None or target is None or step is None:
            if self._clean >= self._off_after:
                return self._disengage("trying without offload after clean steps")
            return None
        moved = step["offloaded_bytes"]
        headroom = target - peak
        if moved <= headroom:
            return self._disengage(f"memory allows: peak {peak} + moved {moved} <= target {int(target)}")
        if headroom > 0:
            budget = int(step["kept_bytes"] + self._headroom_use * headroom)
            if budget != self.offload.budget_bytes:
                self.offload.set_budget(budget)
                return f"offload budget: keep {budget} bytes of activations on the device"
        return None

    def _disengage(self, why):
        self.active = False
        self._was_off = True
        self._clean = 0
        return "offload off: " + why
