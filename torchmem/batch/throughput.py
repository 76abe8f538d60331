"""ThroughputChooser: how many micro-steps a fixed batch runs fastest in, judged
by measured step times.

The throughput half of BatchSizeController(objective="throughput"). Memory
(batch/policy.py) says how large a micro-batch may be; this says which of the
sizes that fit to run. Pure: no torch, no clock, no collectives. The controller
feeds it step times it measured (batch/timing.py), reduced over ranks, so that
every rank makes the same choice from the same numbers.

Note [Candidates are micro-step counts]
A batch of B samples at micro-batch m runs as k = ceil(B / m) micro-steps. For
one k the balanced split (chunks of ceil(B / k) and floor(B / k)) has the
smallest largest chunk, so the least memory, and no short tail that pays a
micro-step's fixed cost for a few samples: 64 runs as 16x4 or 22+21+21, never
19+19+19+7 (both of the latter are four and three micro-steps; on the H200,
GPT-2's 16x4 stepped in 0.233 s against 0.30-0.34 s for 19+19+19+7). So the
candidates are the counts k, each run at its balanced split, and the
micro-batch reported is ceil(B / k). Memory bounds k from below:
k_min = ceil(B / largest size that fits). Counts whose largest chunk equals a
smaller count's (64 in 9 chunks has chunks of 8, as in 8) are skipped: the
same memory, one more micro-step.

Note [Step-time model]
A micro-step of m samples takes about a + b x m: a is its fixed cost (kernel
launches, the part of a micro-step that does not grow with m, under DDP or
FSDP the hooks), b the cost per sample. A step over the whole batch in k
balanced micro-steps then does forward and backward in W(k) = a x k + b x B:
a line in k whose slope, the cost of a micro-step, is not negative; the time
between steps (optimizer, data) adds the same for every k. So in the model
one micro-step fewer is never slower, and no count beyond the ones measured
is predicted faster than the best of them: the search stops there. What the
model cannot see is the budget's edge: in the last few sizes below the
ceiling the allocator works harder (torchmem's pool remaps, torch's frees its
cache and retries); the H200 ran FSDP2 at 19 in 1.13-1.40 s a step where 17
took 0.47 s. So k_min is measured and so is its neighbour, which lies off the
edge (64 in 3 is 22+21+21, in 4 is 16x4). The line through the two measured
counts farthest from the edge (reduced over ranks: the same everywhere)
predicts the next count for the log.

Note [How the choice is made]
- Order: k_min first, then its neighbour (the next count), tried while fewer
  than two counts are measured: it probes the budget's edge. Once more, when
  the memory line is unmeasured (calibration: any smaller size measures it,
  and the neighbour is the one worth timing anyway). After a restart whose
  memory rose, counts measured before still count.
- Not tried: past `max_sizes` counts since the last restart (torch.compile
  builds a graph per size), or when the one-time cost of its new sizes (their
  first micro-steps, less their warm time: compilation, CUDA-graph recording,
  allocator growth, as measured on earlier new sizes) would not be repaid
  within `payback_steps` steps by a gain of `margin`.
- Measured: each count over `min_steps` steps (2) whose warm time is known.
- Settle: the fastest measured, but the current choice (at first k_min) is
  left only for a count faster by more than `margin` (2%), so noise does not
  decide. The choice then stays until memory moves.
- Restart when k_min changes. When it rose (memory fell: an OOM, a budget
  lowered, a sharing owner claiming back) the step times measured before are
  dropped: the edge moved. When it fell (memory rose, or the memory line was
  learnt), they are kept: more memory does not make a count slower.
"""

import collections
import statistics

__all__ = ["ThroughputChooser", "micro_steps", "largest_chunk", "next_count", "split_label"]


def micro_steps(batch, micro):
    """k = ceil(batch / micro): the micro-steps a batch takes at chunks of <= micro."""
    return -(-batch // max(1, micro))


def largest_chunk(batch, count):
    """ceil(batch / count): the largest chunk of the balanced split in `count`."""
    return -(-batch // count)


def next_count(batch, count):
    """The next candidate after `count`: the fewest micro-steps whose largest chunk
    is smaller (None when the chunks are single samples already)."""
    size = largest_chunk(batch, count)
    return None if size <= 1 else micro_steps(batch, size - 1)


def chunk_sizes(batch, count):
    """The distinct chunk sizes of the balanced split of `batch` in `count`."""
    return {largest_chunk(batch, count), batch // count} - {0}


def split_label(batch, count):
    """'4 x 16' or '3 x 22/21' for the log."""
    big, small = largest_chunk(batch, count), batch // count
    return f"{count} x {big}" if big == small else f"{count} x {big}/{small}"


class ThroughputChooser:
    """Which count of micro-steps to run (Note [How the choice is made]).

    plan(batch, bound, calibrate) -> the micro-batch (largest chunk) to run next;
    observe(batch, count, work_s, gap_s) records a measured step; note_new_sizes(sizes,
    cost_s) what new sizes cost. `record(kind, before, after, reason)` logs choices."""

    def __init__(self, *, margin=0.02, min_steps=2, max_sizes=4, payback_steps=200, record=None):
        if not (isinstance(margin, (int, float)) and 0.0 <= margin < 1.0):
            raise ValueError(f"throughput_margin must be a number in [0, 1), got {margin!r}")
        if not isinstance(max_sizes, int) or max_sizes < 1:
            raise ValueError(f"max_sizes must be an int >= 1, got {max_sizes!r}")
        if not isinstance(min_steps, int) or min_steps < 1:
            raise ValueError(f"min_steps must be an int >= 1, got {min_steps!r}")
        self.margin = float(margin)
        self.min_steps = min_steps
        self.max_sizes = max_sizes
        self.payback_steps = payback_steps
        self._record = record or (lambda *event: None)
        self.batch = None
        self.k_min = None
        self.choice = None           # the count run when settled (the incumbent while measuring)
        self.running = None          # the count planned for the next step
        self.settled = False
        self.work = {}               # count -> forward/backward seconds of its measured steps
        self.gaps = collections.deque(maxlen=16)   # seconds between steps (optimizer, data), any count
        self.tried = set()           # counts run since the last restart (max_sizes)
        self.seen_sizes = set()      # chunk sizes that ran at least once (their first-run cost is paid)
        self.new_size_costs = collections.deque(maxlen=8)
        self.unmeasured_plans = 0    # plans in a row that got no measurement (then settle without)
        self.last_reason = ""

    # ------------------------------------------------------------ figures
    def _gap(self):
        return statistics.median(self.gaps) if self.gaps else 0.0

    def measured(self, count):
        return len(self.work.get(count, ())) >= self.min_steps

    def step_time(self, count):
        """Mean measured seconds of a step at `count` (work + the median gap), or None."""
        if not self.measured(count):
            return None
        return statistics.fmean(self.work[count][-2 * self.min_steps:]) + self._gap()

    def rate(self, count):
        """Samples per second of the local batch at `count`, or None before it is measured."""
        seconds = self.step_time(count)
        return None if not seconds else self.batch / seconds

    def predict(self, count):
        """The step-time line's seconds at `count` (Note [Step-time model]), or None
        with fewer than two measured counts. The line runs through the two measured
        counts farthest from the budget's edge (the most micro-steps), its slope, a
        micro-step's cost, no less than 0."""
        points = sorted((k, statistics.fmean(w[-2 * self.min_steps:])) for k, w in self.work.items()
                        if k >= (self.k_min or 1) and len(w) >= self.min_steps)[-2:]
        if len(points) < 2:
            return None
        (k0, w0), (k1, w1) = points
        return w1 + max(0.0, (w1 - w0) / (k1 - k0)) * (count - k1) + self._gap()

    def _label_rate(self, count):
        rate = self.rate(count)
        return split_label(self.batch, count) + ("" if rate is None else f" at {rate:.1f} samples/s")

    # ------------------------------------------------------------- inputs
    def observe(self, batch, count, work_s, gap_s=None):
        """A step of `batch` samples in `count` micro-steps did forward/backward in
        `work_s` seconds, `gap_s` after the previous step ended (None: unknown)."""
        if batch != self.batch:
            self._new_batch(batch)
        if work_s is None or count < (self.k_min or 1):
            return
        self.work.setdefault(count, []).append(float(work_s))
        del self.work[count][:-4 * self.min_steps]
        if gap_s is not None:
            self.gaps.append(float(gap_s))
        self.unmeasured_plans = 0

    def note_new_sizes(self, sizes, cost_s=None):
        """Chunk sizes that ran, and what the first run of a new one cost (seconds beyond
        its warm time), when measured."""
        self.seen_sizes.update(sizes)
        if cost_s is not None:
            self.new_size_costs.append(max(0.0, float(cost_s)))

    # ----------------------------------------------------------- decision
    def plan(self, batch, bound, calibrate=False):
        """The micro-batch to run next for a batch of `batch` samples when memory allows
        chunks of up to `bound`. `calibrate`: the memory line is unmeasured and a smaller
        size would measure it."""
        bound = max(1, min(int(bound), batch))
        k_min = micro_steps(batch, bound)
        if batch != self.batch:
            self._new_batch(batch)
        if k_min != self.k_min:
            self._restart(k_min)
        if self.settled:
            return self._go(self.choice)
        self.unmeasured_plans += 1
        if self.unmeasured_plans > self.min_steps + 3:  # no measurements come (no timer, odd batches)
            return self._settle(stalled=True)
        if calibrate:
            count = next_count(batch, k_min)
            if count is not None and not self.work.get(count) and self._room_for(count):
                return self._go(count, "try", "calibration: the memory line is unmeasured; a smaller size "
                                              "measures it and is the next candidate anyway")
        for count in self._chain():
            have = len(self.work.get(count, ()))
            if have >= self.min_steps:
                continue
            why = "the fewest micro-steps memory allows" if count == k_min else self._admit(count)
            if why is None:  # a count measured once on the way (calibration) is finished only if worth it
                break
            return self._go(count, "try", why if have == 0 else f"measuring {split_label(batch, count)} "
                                                                  f"({have} of {self.min_steps} steps)")
        return self._settle()

    def _new_batch(self, batch):
        self.batch, self.k_min, self.work, self.choice, self.running, self.settled = batch, None, {}, None, None, False
        self.gaps.clear()

    def _restart(self, k_min):
        before = self.k_min
        self.k_min = k_min
        if before is not None and k_min > before:
            self.work.clear()  # less memory: the edge moved, the times measured with more are stale
            self.gaps.clear()
        self.tried = {k for k in self.work if k >= k_min}
        self.settled = False
        self.unmeasured_plans = 0
        if self.choice is None or self.choice < k_min:
            self.choice = k_min
        what = "memory allows" if before is None else ("memory rose: allows" if k_min < before else
                                                       "memory fell: allows")
        self._record("explore", None if before is None else largest_chunk(self.batch, before),
                     largest_chunk(self.batch, k_min),
                     f"{what} {split_label(self.batch, k_min)} at the fewest; measuring the candidates")

    def _chain(self):
        count = self.k_min
        while count is not None:
            yield count
            count = next_count(self.batch, count)

    def _room_for(self, count):
        return count in self.tried or len(self.tried) < self.max_sizes

    def _admit(self, count):
        """Why `count` is worth a try, or None (Note [How the choice is made])."""
        if not self._room_for(count):
            return None
        measured = [k for k in self.work if k >= self.k_min and self.measured(k)]
        if len(measured) >= 2:  # beyond, the line predicts nothing faster (Note [Step-time model])
            return None
        best = min((self.step_time(k) for k in measured), default=None)
        why = "the neighbour: off the budget's edge, and the step-time line's second point"
        new = chunk_sizes(self.batch, count) - self.seen_sizes
        if new and self.new_size_costs and best is not None and self.payback_steps is not None:
            cost = len(new) * statistics.median(self.new_size_costs)
            if cost > self.margin * best * self.payback_steps:
                return None
        return why

    def _settle(self, stalled=False):
        measured = self._chain_measured()
        why = "step times stopped coming (no timer, odd-sized batches); " if stalled else ""
        if not measured:
            choice = self.k_min
            why += "nothing measured: the fewest micro-steps"
        else:
            best = min(measured, key=self.step_time)
            incumbent = self.choice if self.choice in measured else (self.k_min if self.k_min in measured else best)
            choice = incumbent
            if self.step_time(incumbent) > self.step_time(best) * (1 + self.margin):
                choice = best
            others = ", ".join(self._label_rate(k) for k in sorted(measured) if k != choice)
            after = next_count(self.batch, max(measured))
            predicted = None if after is None else self.predict(after)
            why += (f"fastest within {self.margin:.0%}: {self._label_rate(choice)}"
                    + (f" (also measured: {others})" if others else "")
                    + ("" if predicted is None else f"; the line predicts {split_label(self.batch, after)} at "
                                                    f"{self.batch / predicted:.1f} samples/s"))
        before = largest_chunk(self.batch, self.running) if self.running else None
        self.choice = choice
        self.settled = True
        self._record("settle", before, largest_chunk(self.batch, choice), why)
        return self._go(choice)

    def _chain_measured(self):
        return [k for k in sorted(self.work) if k >= self.k_min and self.measured(k)]

    def _go(self, count, kind=None, why=None):
        if kind is not None and count != self.running:
            before = largest_chunk(self.batch, self.running) if self.running else None
            self._record(kind, before, largest_chunk(self.batch, count), why)
        if kind is not None:
            self.last_reason = why
        self.running = count
        self.tried.add(count)
        return largest_chunk(self.batch, count)

    # -------------------------------------------------------------- state
    def state_dict(self):
        return {"batch": self.batch, "k_min": self.k_min, "choice": self.choice, "running": self.running,
                "settled": self.settled, "work": {int(k): list(v) for k, v in self.work.items()},
                "gaps": list(self.gaps), "tried": sorted(self.tried), "seen_sizes": sorted(self.seen_sizes),
                "new_size_costs": list(self.new_size_costs)}

    def load_state_dict(self, state):
        self.batch, self.k_min, self.choice = state["batch"], state["k_min"], state["choice"]
        self.running, self.settled = state["running"], bool(state["settled"])
        self.work = {int(k): list(v) for k, v in state["work"].items()}
        self.gaps = collections.deque(state["gaps"], maxlen=16)
        self.tried = set(state["tried"])
        self.seen_sizes = set(state["seen_sizes"])
        self.new_size_costs = collections.deque(state["new_size_costs"], maxlen=8)
