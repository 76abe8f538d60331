"""StepTimer: how long a step's micro-steps took, for the throughput choice
(batch/throughput.py), without synchronizing the GPU in steady state.

Note [Timing a step honestly]
- What is timed: each micro-step (forward and backward), between marks taken
  before the first and after every micro-step, and the gap from the previous
  step's last mark to this step's first (the optimizer step, zero_grad, the
  data: what the loop does between steps, the same whatever the split).
- On the GPU the marks are CUDA events recorded on the current stream: they
  time the stream, so a micro-step's time is what the GPU spent on it, idle
  waits for the CPU included (a launch-bound model is as slow as its
  launches). Recording an event does not synchronize. Reading one does wait
  for it, so the controller reads a step's events only while it is choosing
  (a few steps after a start or a change of memory), right after the step's
  last backward; once it has settled it records no events at all. On the CPU
  the marks are the wall clock.
- Warm-up: the first `warmup` runs of each micro-batch size are not timed as
  they come: the first run of a shape picks cuBLAS algorithms, grows the
  allocator's pool, and under torch.compile compiles a graph (under
  mode="reduce-overhead" the second run records the CUDA graph: warmup=2).
  Nor is the first micro-step of a step split unlike the step before (or
  retried after an OOM): the allocator's cached blocks were cut for the
  other sizes, and the first micro-step pays for reshaping them.
  A cold micro-step's time is replaced by the warm micro-steps of the same
  step, per sample (same size first, else all), so a step at a new size is
  measured from its first run when it has more than `warmup` micro-steps of
  that size. A step with no warm micro-step gives no time.
- The first run of a size new to this controller, less its warm estimate, is
  what a new size costs (compilation, graph recording, pool growth): the
  chooser weighs it before trying more sizes. The very first size is not
  counted: its first run also pays CUDA's and cuBLAS's lazy start.
"""

import collections
import statistics
import time

import torch

__all__ = ["StepTimer", "StepTiming"]


class StepTiming:
    """The marks of one clean attempt; resolve() turns them into seconds."""

    def __init__(self, cuda, marks, sizes, cold, new, previous_end):
        self.cuda = cuda
        self.marks = marks
        self.sizes = sizes
        self.cold = cold
        self.new = new
        self.previous_end = previous_end
        self._resolved = None

    def _seconds(self, start, end):
        if self.cuda:
            return start.elapsed_time(end) / 1000.0
        return end - start

    def resolve(self):
        """(work_s, gap_s, new_size_cost_s): warm forward/backward seconds of the
        step (None when no micro-step was warm), seconds since the previous step
        ended (None: unknown), and the first-run excess of sizes new to the
        controller (None: none ran). Waits for the step's last event on the GPU."""
        if self._resolved is None:
            if self.cuda:
                self.marks[-1].synchronize()
            durations = [self._seconds(a, b) for a, b in zip(self.marks, self.marks[1:])]
            gap = None if self.previous_end is None else max(0.0, self._seconds(self.previous_end, self.marks[0]))
            work, cost = self._estimate(durations)
            self._resolved = (work, gap, cost)
        return self._resolved

    def _estimate(self, durations):
        warm = [(s, d) for s, d, c in zip(self.sizes, durations, self.cold) if not c]
        if not warm:
            return None, None
        by_size = collections.defaultdict(list)
        for size, seconds in warm:
            by_size[size].append(seconds / size)
        overall = statistics.fmean(seconds / size for size, seconds in warm)
        work, excess = 0.0, []
        for size, seconds, cold, new in zip(self.sizes, durations, self.cold, self.new):
            if not cold:
                work += seconds
                continue
            estimate = size * (statistics.fmean(by_size[size]) if size in by_size else overall)
            work += estimate
            if new:
                excess.append(seconds - estimate)
        return work, (sum(excess) / len(excess) if excess else None)


class StepTimer:
    """Marks micro-steps (Note [Timing a step honestly]); counts every size's runs
    whether timing or not, so warm-up is known when timing resumes."""

    def __init__(self, warmup=1, clock=time.perf_counter):
        if not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"warmup must be an int >= 0, got {warmup!r}")
        self.warmup = warmup
        self.clock = clock
        self.runs = collections.Counter()   # size -> micro-steps run at it
        self.first_size = None
        self._split = []                    # the sizes of the attempt running
        self._last_split = None             # those of the last clean attempt (None: unknown, or an OOM since)
        self._cuda = False
        self._marks = None
        self._previous_end = None           # the last mark of the previous timed clean step

    def _mark(self):
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return self.clock()

    def start(self, timing, cuda):
        """Before an attempt's first micro-step; `timing` False records nothing."""
        self._cuda = bool(cuda)
        self._split = []
        if not timing:
            self._marks = None
            self._previous_end = None
            return
        self._marks = [self._mark()]
        self._sizes, self._cold, self._new = [], [], []

    def lap(self, size):
        """After a micro-step of `size` samples ran (forward and backward)."""
        runs = self.runs[size]
        self._split.append(size)
        if self._marks is not None:
            self._marks.append(self._mark())
            self._sizes.append(size)
            self._cold.append(runs < self.warmup)
            self._new.append(runs == 0 and self.first_size is not None)
        if self.first_size is None:
            self.first_size = size
        self.runs[size] = runs + 1

    def abandon(self):
        """The attempt failed (OOM): its marks mean nothing, and the next gap is unknown."""
        self._marks = None
        self._previous_end = None
        self._last_split = None

    def finish(self):
        """After a clean attempt: its StepTiming, or None when not timing."""
        changed, self._last_split = self._split != self._last_split, self._split
        if self._marks is None:
            return None
        if changed and self._cold:
            self._cold[0] = True
        timing = StepTiming(self._cuda, self._marks, self._sizes, self._cold, self._new, self._previous_end)
        self._previous_end = self._marks[-1]
        self._marks = None
        return timing
