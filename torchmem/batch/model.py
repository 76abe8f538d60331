"""The controller's memory model: peak bytes = fixed + per_sample x micro-batch.

Activations grow linearly with the micro-batch at a fixed sequence length;
parameters, gradients, optimizer state and workspaces do not. So two steps at
two sizes determine the line, and the largest size under a budget is one
division away: the controller jumps there instead of halving and doubling
(Accelerate, Lightning, Composer), which costs log2 steps and as many OOMs.

Note [Fitting a drifting line]
The fixed part drifts: Adam allocates its state during the first optimizer
step, caches warm up, a user keeps a tensor alive. So the slope comes from a
least-squares fit over a short window of recent steps (it needs two distinct
sizes; until then the last slope is kept), while the intercept is anchored at
the most recent observation: fixed = last_peak - slope x last_micro. The
prediction is then exact at the size in use and errs on the side of caution
further out when the slope is over-estimated, e.g. when the window mixes
steps from before and after Adam's state appeared.

Note [Cold start]
With one observation the split between fixed and per-sample bytes is unknown.
The bytes in use at the start of the step (parameters, optimizer state: no
activations, gradients set to None) are a lower bound on the fixed part, so
(peak - baseline) / micro is an upper bound on per-sample bytes: a safe slope
for a first jump. The second size then yields the real line.
"""

import collections

__all__ = ["LinearMemoryModel"]


class LinearMemoryModel:
    """Observations of (micro-batch, peak bytes) and the line through them."""

    def __init__(self, window=8):
        if window < 2:
            raise ValueError(f"LinearMemoryModel: window must be >= 2, got {window}")
        self.window = window
        self.observations = collections.deque(maxlen=window)
        self.slope = None
        self.fixed = None

    def observe(self, micro, peak, baseline=None):
        """Records a clean step over `micro` samples that peaked at `peak` bytes;
        `baseline` is the bytes in use when the step began (optional)."""
        if micro < 1 or peak is None:
            return
        self.observations.append((int(micro), int(peak)))
        slope = self._least_squares_slope()
        if slope is None and self.slope is None and baseline is not None and peak > baseline:
            slope = (peak - baseline) / micro
        if slope is not None and slope > 0:
            self.slope = slope
        if self.slope is not None:
            self.fixed = peak - self.slope * micro

    def _least_squares_slope(self):
        sizes = [m for m, _ in self.observations]
        if len(set(sizes)) < 2:
            return None
        n = len(self.observations)
        mean_m = sum(sizes) / n
        mean_p = sum(p for _, p in self.observations) / n
        cov = sum((m - mean_m) * (p - mean_p) for m, p in self.observations)
        var = sum((m - mean_m) ** 2 for m in sizes)
        return cov / var if var > 0 else None

    @property
    def ready(self):
        """True once the model can predict (a slope and an intercept)."""
        return self.slope is not None and self.fixed is not None

    def predict(self, micro):
        """Predicted peak bytes at `micro`, or None before the model is ready."""
        return None if not self.ready else self.fixed + self.slope * micro

    def largest_under(self, target_bytes):
        """The largest (real-valued) micro-batch whose predicted peak stays under
        `target_bytes`, or None before the model is ready."""
        if not self.ready or target_bytes is None:
            return None
        return max(0.0, (target_bytes - self.fixed) / self.slope)

    def state_dict(self):
        return {"window": self.window, "observations": list(self.observations),
                "slope": self.slope, "fixed": self.fixed}

    def load_state_dict(self, state):
        self.window = int(state["window"])
        self.observations = collections.deque((tuple(o) for o in state["observations"]), maxlen=self.window)
        self.slope = state["slope"]
        self.fixed = state["fixed"]
