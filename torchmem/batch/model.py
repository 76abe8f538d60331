"""The controller's memory model: a step's extra bytes = fixed + per_sample x micro.

Activations grow linearly with the micro-batch at a fixed sequence length;
gradients and workspaces do not. So two steps at two sizes determine the line,
and the largest size under a budget is one division away: the controller jumps
there instead of halving and doubling (Accelerate, Lightning, Composer), which
costs log2 steps and as many OOMs.

Note [Modelling the increment, not the peak]
What is fitted is the step's increment: peak bytes minus the bytes in use when
the step began (parameters, optimizer state, anything the user keeps). That
baseline drifts (Adam allocates its state during the first optimizer step,
users cache tensors), and measuring it at every step keeps the drift out of
the fit; the prediction for a size is then baseline + increment. The slope
comes from least squares over a short window of recent steps (two distinct
sizes needed; until then the last slope is kept), and the intercept is
anchored at the latest step, so the prediction is exact at the size in use.

Note [Cold start]
With one observation the split between fixed and per-sample bytes is unknown.
The fixed part of the increment is >= 0, so increment / micro is an upper
bound on the per-sample bytes: a safe slope for the first jump. The second
size then yields the real line. When that safe slope allows no jump (a step's
fixed bytes, gradients and workspaces, are large), the controller measures a
smaller size once to learn the line (Note [Calibration step], policy.py).
"""

import collections

__all__ = ["LinearMemoryModel"]


class LinearMemoryModel:
    """Observations of (micro-batch, increment bytes) and the line through them."""

    def __init__(self, window=8):
        if window < 2:
            raise ValueError(f"LinearMemoryModel: window must be >= 2, got {window}")
        self.window = window
        self.observations = collections.deque(maxlen=window)
        self.slope = None
        self.fixed = None
        self.measured = False  # a slope from two distinct sizes was ever fitted

    def observe(self, micro, increment):
        """Records a clean step over `micro` samples that needed `increment`
        bytes above its starting baseline (Note [Modelling the increment])."""
        if micro < 1 or increment is None:
            return
        increment = max(0, int(increment))
        self.observations.append((int(micro), increment))
        slope = self._least_squares_slope()
        if slope is not None and slope > 0:
            self.measured = True
        if slope is None and self.slope is None and increment > 0:
            slope = increment / micro
        if slope is not None and slope > 0:
            self.slope = slope
        if self.slope is not None:
            self.fixed = increment - self.slope * micro

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
        """Predicted increment at `micro`, or None before the model is ready."""
        return None if not self.ready else self.fixed + self.slope * micro

    def largest_under(self, target_bytes):
        """The largest (real-valued) micro-batch whose predicted increment stays
        under `target_bytes`, or None before the model is ready."""
        if not self.ready or target_bytes is None:
            return None
        return max(0.0, (target_bytes - self.fixed) / self.slope)

    def state_dict(self):
        return {"window": self.window, "observations": list(self.observations),
                "slope": self.slope, "fixed": self.fixed, "measured": self.measured}

    def load_state_dict(self, state):
        self.window = int(state["window"])
        self.observations = collections.deque((tuple(o) for o in state["observations"]), maxlen=self.window)
        self.slope = state["slope"]
        self.fixed = state["fixed"]
        self.measured = bool(state.get("measured", len({m for m, _ in self.observations}) > 1))
