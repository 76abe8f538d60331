"""BatchSizeController: keep the global batch, run it at the fastest micro-batch that fits.

    ctl = torchmem.BatchSizeController(global_batch=64, model=model, optimizer=opt)
    for batch in loader:
        loss = ctl.run(lambda mb: model(**mb).loss, batch)   # split, weight, backward, recover
        opt.step(); opt.zero_grad(set_to_none=True)

`run` splits the batch into micro-batches, weights each micro-batch's loss by
its share of the batch (so the accumulated gradient is the full-batch
gradient), calls backward, and on OOM cleans up and runs the SAME batch again
split smaller. Between steps it fits peak memory against the micro-batch
(batch/model.py) and knows the largest size under the budget. With
objective="throughput" (the default) the batch runs as balanced micro-steps
(22+21+21, not 19+19+19+7) and the count of micro-steps is the one measured
fastest among those that fit (batch/throughput.py, timed by batch/timing.py);
with objective="largest" the largest quantized size that fits runs.
docs/batch_size.md is the user's guide; this banner records the design. The
sizing arithmetic is SizingPolicy (batch/policy.py: pure, no torch), the
throughput choice ThroughputChooser (pure), the gradient sync under DDP and
FSDP2 GradSync (batch/parallel.py); this file runs the micro-steps, recovers
from OOMs and agrees across ranks.

The notes on how sizes move (Note [Moving the micro-batch], Note [Probing
without figures], Note [Calibration step], Note [Shrinking inside a step])
are in batch/policy.py, with the arithmetic.

Note [Where the agreement happens] is in batch/parallel.py: one agreement
collective per attempt, after every backward (grad_sync="controller", and
"fsdp" under FSDP2), or before the final micro-step (grad_sync="ddp"). Under
objective="throughput" the same collective carries each rank's step times,
reduced with MAX, so every rank chooses from the slowest rank's times.

Note [Borrowed memory comes back fast] is in batch/policy.py (returnable); the
pace it needs is measured here (_note_pace).
"""

import collections
import logging
import math
import time

import torch

from torchmem.batch import distributed
from torchmem.batch.offload_rung import OffloadRung
from torchmem.batch.parallel import GradSync, is_compiled, resolve_grad_sync
from torchmem.batch.policy import SizingPolicy
from torchmem.batch.probe import MemoryProbe, default_probe
from torchmem.batch.recovery import (MicroBatchOOMError, OptimizerStepOOMError, discard_attempt, loss_of,
                                     optimizer_oom_message, optimizer_step)
from torchmem.batch.sampler import LR_RULES
from torchmem.batch.split import balanced_sizes, batch_size_of, split_batch, split_sizes
from torchmem.batch.throughput import ThroughputChooser, micro_steps
from torchmem.batch.timing import StepTimer
from torchmem.batch.retry import is_oom_error
from torchmem.runtime.budget import report_micro_batch

__all__ = ["BatchSizeController", "OptimizerStepOOMError", "MicroBatchOOMError"]

log = logging.getLogger("torchmem.batch")

# Note [Borrowed memory comes back fast]: the longest micro-step a size that
# needs borrowed memory may take (half the 1 s return promise: the publisher's
# tick and the give-back take the rest).
_BORROWED_MICRO_STEP_S = 0.5
# Weight of the newest step in the seconds-per-sample average.
_PACE_WEIGHT = 0.5


class BatchSizeController:
    """Chooses the micro-batch for a fixed global batch and recovers from OOM.

    Arguments (all but global_batch are keywords):
      global_batch   samples per optimizer step over all ranks (the local batch
                     is global_batch / world size).
      model          the module trained (DDP-wrapped or not): its grads are set
                     to None after an OOM; its no_sync() skips gradient
                     all-reduce on non-final micro-batches.
      optimizer      its grads are set to None after an OOM; an OOM inside its
                     step() raises OptimizerStepOOMError.
      scaler         a torch.amp.GradScaler: losses are scaled for backward and
                     its per-optimizer state is reset after an OOM.
      micro_batch    the first size tried (default: the whole local batch).
      objective      "throughput" (default): run the batch in balanced micro-steps,
                     as many as measured fastest among the counts that fit
                     (batch/throughput.py); "largest": the largest size that
                     fits, on the quantum grid.
      quantum        under "largest", sizes are multiples of this (8); 1
                     disables quantization.
      margin         keep predicted peak under budget x (1 - margin); default:
                     the probe's (0.01 with torchmem's allocator, whose budget
                     is exact; 0.05 under torch's own, whose fragmentation
                     the figures do not show).
      grow_after     clean steps before growing to or past a size that OOMed,
                     or probing up without memory figures (50).
      min_micro      never go below this (1).
      max_retries    OOMs tolerated within one run() call (12).
      probe          a batch.probe.MemoryProbe (default: torchmem's figures
                     if installed, torch's on CUDA, none on CPU).
      process_group  the torch.distributed group to agree over (default world).
      grad_sync      how gradients are averaged over ranks (Note [Where the
                     agreement happens]): "auto" (= "controller" when a model
                     is given, else "none"), "controller", "ddp", "none" (you
                     average them yourself).
      reduction      "mean" (the step function returns a mean over its samples:
                     weight = share of the batch) or "sum" (weight 1).
      adapt_global   opt-in: let the global batch follow the micro-batch (no
                     accumulation) between min_global and max_global, and
                     scale the optimizer's learning rates by lr_rule
                     ("linear", "sqrt" or a function of new/base batch ratio).
      split_lists    also split lists of batch-size length (see batch/split.py).
      verbose        print each decision (they are always logged to
                     logging.getLogger("torchmem.batch") and kept in .events).
      offload        "auto": when even min_micro runs out of memory, offload
                     saved activations to pinned host memory instead of raising,
                     and stop when memory allows (batch/offload_rung.py).
      throughput_margin, max_sizes, payback_steps  under "throughput": leave
                     the current choice only for one faster by more than 0.02;
                     measure at most 4 counts of micro-steps after a start or
                     a change of memory; try new sizes only if their one-time
                     cost is repaid within 200 steps (batch/throughput.py).
      warmup         runs of each size not timed as they come (batch/timing.py):
                     2 for a torch.compile'd model, else 1.
    """

    def __init__(self, global_batch, *, model=None, optimizer=None, scaler=None, micro_batch=None,
                 quantum=8, margin=None, grow_after=50, min_micro=1, max_retries=12, probe=None,
                 device=None, process_group=None, grad_sync="auto", reduction="mean",
                 adapt_global=False, lr_rule=None, min_global=None, max_global=None,
                 split_lists=False, window=8, verbose=False, offload=None, objective="throughput",
                 throughput_margin=0.02, max_sizes=4, warmup=None, payback_steps=200):
        if not isinstance(global_batch, int) or global_batch < 1:
            raise ValueError(f"BatchSizeController: global_batch must be a positive int, got {global_batch!r}")
        if not isinstance(quantum, int) or quantum < 1:
            raise ValueError(f"BatchSizeController: quantum must be an int >= 1, got {quantum!r}")
        if margin is not None and not (isinstance(margin, (int, float)) and 0.0 <= margin < 1.0):
            raise ValueError(f"BatchSizeController: margin must be None or a number in [0, 1), got {margin!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"BatchSizeController: reduction must be 'mean' or 'sum', got {reduction!r}")
        if lr_rule is not None and not callable(lr_rule) and lr_rule not in LR_RULES:
            raise ValueError(f"BatchSizeController: lr_rule must be 'linear', 'sqrt', a function or None, got {lr_rule!r}")
        if objective not in ("throughput", "largest"):
            raise ValueError(f"BatchSizeController: objective must be 'throughput' or 'largest', got {objective!r}")
        if probe is not None and not isinstance(probe, MemoryProbe):
            raise TypeError("BatchSizeController: probe must be a torchmem.batch.MemoryProbe")
        self.process_group = process_group
        self.world = distributed.world_size(process_group)
        if global_batch % self.world:
            raise ValueError(
                f"BatchSizeController: global_batch={global_batch} is not divisible by the world size "
                f"{self.world}; choose a multiple so every rank gets the same local batch"
            )
        self.model = model
        self.optimizer = optimizer
        self.scaler = scaler
        self.min_micro = min_micro
        self.max_retries = max_retries
        self.reduction = reduction
        self.split_lists = split_lists
        self.verbose = verbose
        self.probe = probe if probe is not None else default_probe(device)
        # A global batch that follows the micro-batch has no accumulation to balance: largest it is.
        self.objective = "largest" if adapt_global else objective
        # The sizing arithmetic (batch/policy.py); this class runs the micro-steps.
        self.policy = SizingPolicy(quantum=quantum, min_micro=min_micro, grow_after=grow_after, window=window,
                                   margin=float(margin if margin is not None else self.probe.default_margin),
                                   record=self._record,
                                   grid="balanced" if self.objective == "throughput" else "quantum")
        self.grad_sync = resolve_grad_sync(grad_sync, model, self.world)
        self.sync = GradSync(model, self.grad_sync)
        self.offload_rung = OffloadRung(offload, grow_after=grow_after)
        self.chooser = ThroughputChooser(margin=throughput_margin, max_sizes=max_sizes,
                                         payback_steps=payback_steps, record=self._record)
        self.timer = StepTimer(warmup if warmup is not None else (2 if is_compiled(model) else 1))
        self._on_cuda = None

        self.base_global_batch = global_batch
        self.global_batch = global_batch
        self.adapt_global = adapt_global
        self.lr_rule = lr_rule
        self.min_global = min_global or self.world
        self.max_global = max_global or 8 * global_batch
        self.lr_factor = 1.0

        self.steps = 0
        self.ooms = 0
        self.last_peak = None
        self.last_micro_steps = 0
        self.events = collections.deque(maxlen=1000)
        self.decisions = 0
        self._step_budget = None  # the budget at the last look inside a step (Note [Shrinking inside a step])
        self._seconds_per_sample = None  # Note [Borrowed memory comes back fast]
        self._last_clean_end = None
        self._micro = self.policy.quantize(micro_batch or self.local_batch, cap=self._cap())
        self._proposal = self._micro
        self._bound = self._micro      # under "throughput": the largest size memory allows (agreed over ranks)
        self._calibrate = False        # under "throughput": the memory line wants a smaller size measured
        self._pending = None           # (count, StepTiming) of the last timed step, not yet reduced
        self._in_optimizer_step = False
        if optimizer is not None and hasattr(optimizer, "register_step_pre_hook"):
            optimizer.register_step_pre_hook(self._enter_optimizer_step)
            optimizer.register_step_post_hook(self._leave_optimizer_step)

    # ---------------------------------------------------------------- sizes
    @property
    def local_batch(self):
        """Samples per optimizer step on this rank."""
        return self.global_batch // self.world

    @property
    def micro_batch(self):
        """The micro-batch the next run() starts with."""
        return self._micro

    @property
    def margin(self):
        """The share of the budget kept free (the probe's default unless given)."""
        return self.policy.margin

    @property
    def memory_model(self):
        return self.policy.memory_model

    @property
    def clean_steps(self):
        """Steps since the last OOM or upward probe."""
        return self.policy.clean_steps

    @property
    def accumulation_steps(self):
        """Micro-steps per optimizer step at the current sizes."""
        return math.ceil(self.local_batch / self._micro)

    def _cap(self):
        return max(1, self.max_global // self.world) if self.adapt_global else self.local_batch

    def _throughput(self):
        return self.objective == "throughput"

    def _split(self, total, micro):
        return balanced_sizes(total, micro) if self._throughput() else split_sizes(total, micro)

    def _timing_now(self, total):
        """Time this step (Note [Timing a step honestly], batch/timing.py): only while
        choosing by throughput, never once settled."""
        return (self._throughput() and not self.chooser.settled and total == self.local_batch
                and not self.offload_rung.active)

    def _cuda(self):
        if self._on_cuda is None:
            device = next((p.device for p in self._parameters()), None)
            self._on_cuda = (device.type == "cuda" if device is not None
                             else self.probe.name in ("torch", "torchmem") and torch.cuda.is_initialized())
        return self._on_cuda

    # ------------------------------------------------------------ the step
    def run(self, step_fn, batch, *, batch_size=None, backward=True):
        """Runs one optimizer step's worth of forward/backward over `batch`.

        step_fn(micro_batch) returns the micro-batch's loss (a mean over its
        samples with reduction="mean"); the controller weights it, calls
        backward (through the scaler if one was given) and accumulates. With
        backward=False, step_fn(micro_batch, weight) does its own backward of
        loss x weight and returns the loss (or None).

        Returns the batch's loss as a detached 0-d tensor (the weighted sum of
        the micro-batch losses, equal to the full-batch loss). Gradients must
        be None or zero on entry (one run() per optimizer step): an OOM
        discards them."""
        total = batch_size if batch_size is not None else batch_size_of(batch)
        had_grads = any(p.grad is not None for p in self._parameters())
        retries = 0
        while True:
            micro = max(1, min(self._micro, total))
            report_micro_batch(micro, total)  # top/metrics; a sharing borrower yields here
            outcome = self._attempt(step_fn, batch, total, micro, backward)
            if outcome["ok"]:
                self._note_pace(total, clean=retries == 0)
                self._after_success(micro, outcome, total)
                return outcome["loss"]
            retries += 1
            self._discard_attempt(had_grads)
            self._after_oom(micro, outcome, total, retries)

    def _attempt(self, step_fn, batch, total, micro, backward):
        sizes = self._split(total, micro)
        parts = split_batch(batch, sizes, batch_size=total, split_lists=self.split_lists)
        self.probe.reset()
        baseline = self.probe.current_bytes()
        if baseline is not None:
            self.policy.baseline = baseline
        loss_sum = None
        failure = None
        failed_in_optimizer = False
        agreed = None
        agree_before_final = self.grad_sync == "ddp" and self.world > 1
        sent = None  # the step timing this attempt's agreement carries
        self._step_budget = self._budget()
        self.timer.start(self._timing_now(total), self._cuda())
        resized = False
        index = 0
        while index < len(parts):
            if index > 0 and self.world == 1:
                smaller = self._resplit_if_budget_fell(sizes, index, total)
                if smaller is not None:
                    sizes, resized = smaller, True
                    parts = split_batch(batch, sizes, batch_size=total, split_lists=self.split_lists)
            part = parts[index]
            final = index == len(parts) - 1
            weight = sizes[index] / total if self.reduction == "mean" else 1.0
            if final and agree_before_final:  # carries the previous step's times: this one is not done
                sent, self._pending = self._pending, None
                agreed = distributed.agree(self._proposal, False, self.process_group, self._extra(sent))
                if agreed[1]:
                    break  # another rank hit OOM: skip the communicating micro-step
            loss = None
            try:
                with self.sync.context(final):
                    if backward:
                        with self.offload_rung.forward():
                            loss = loss_of(step_fn(part))
                        scaled = loss * weight
                        (self.scaler.scale(scaled) if self.scaler is not None else scaled).backward()
                        del scaled
                    else:
                        with self.offload_rung.forward():
                            loss = step_fn(part, weight)
                        loss = loss_of(loss) if loss is not None else None
                if loss is not None:
                    contribution = loss.detach().to(torch.promote_types(loss.dtype, torch.float32)) * weight
                    loss_sum = contribution if loss_sum is None else loss_sum + contribution
            except Exception as exc:  # noqa: BLE001 - anything but OOM re-raises at once
                if not is_oom_error(exc):
                    raise
                failure = f"{type(exc).__name__}: {exc}"
                failed_in_optimizer = self._in_optimizer_step
            loss = None
            if failure is not None:
                break
            self.timer.lap(sizes[index])
            index += 1
        del parts
        if failed_in_optimizer:
            self._in_optimizer_step = False
            raise OptimizerStepOOMError(optimizer_oom_message(failure))
        if failure is not None and agreed is not None and self.world > 1:
            raise MicroBatchOOMError(
                "torchmem.BatchSizeController: out of memory in the final micro-step of a DDP step "
                "(grad_sync='ddp'), after the ranks agreed; the other ranks are already in DDP's gradient "
                "all-reduce, so this cannot be retried. grad_sync='controller' (the default) recovers from "
                f"any OOM. Error: {failure}"
            )
        oom_here = failure is not None
        timing = None
        if oom_here or resized:
            self.timer.abandon()  # an attempt cut short, or re-split mid-way: its times say nothing
        else:
            timing = self.timer.finish()
        timing = None if timing is None else (len(sizes), timing)
        proposal = self.policy.shrink_target(micro, self._budget(), self._cap()) if oom_here else self._proposal
        if agreed is None:
            sent = timing
            agreed = distributed.agree(proposal, oom_here, self.process_group, self._extra(sent))
        else:
            self._pending = timing
            agreed = (min(agreed[0], proposal), agreed[1], agreed[2])
        next_micro, anyone_oom, extra = agreed
        if anyone_oom or oom_here:
            return {"ok": False, "oom_here": oom_here, "message": failure, "next": next_micro}
        if self.grad_sync == "controller":
            distributed.average_gradients(self._parameters(), self.process_group)
        if loss_sum is None:
            loss_sum = torch.zeros(())
        return {"ok": True, "loss": loss_sum, "peak": self.probe.peak_bytes(), "baseline": baseline,
                "next": next_micro, "micro_steps": len(sizes), "calibrate": extra[0] > 0,
                "timing": self._decode(sent, extra)}

    def _extra(self, sent):
        return distributed.timing_to_ints(self._calibrate, None if sent is None else sent[1].resolve())

    @staticmethod
    def _decode(sent, extra):
        return None if sent is None else {"count": sent[0], **distributed.timing_from_ints(extra)}

    # ----------------------------------------------------------- decisions
    def _resplit_if_budget_fell(self, sizes, index, total):
        """Before each micro-step after the first (Note [Shrinking inside a step],
        batch/policy.py): when the budget fell below what the current size needs, the
        samples not yet run are split again at the size that fits, weights kept.
        Returns the new sizes, or None (nothing to change)."""
        budget = self._budget()
        before, self._step_budget = self._step_budget, budget
        if budget is None or before is None or budget >= before:
            return None
        micro = sizes[index]
        smaller = self.policy.fitting_below(micro, budget, self._cap())
        if smaller is None:
            return None
        rest = total - sum(sizes[:index])
        self._record("shrink", micro, smaller, f"the budget fell to {budget} bytes inside a step; "
                                               f"the {rest} samples left run at {smaller}")
        self._micro = self._proposal = self._bound = smaller
        report_micro_batch(smaller, total)  # a sharing borrower gives back what it holds over its grant now
        return list(sizes[:index]) + self._split(rest, smaller)

    def _budget(self):
        try:
            return self.probe.budget_bytes()
        except RuntimeError:
            return None

    def _after_oom(self, micro, outcome, total, retries):
        if outcome["oom_here"]:
            self.ooms += 1
        self.policy.note_oom(micro, self._budget() if outcome["oom_here"] else None, outcome["oom_here"])
        next_micro = outcome["next"]
        if next_micro >= micro:
            next_micro = self.policy.quantize(micro - 1, cap=self._cap()) if micro > 1 else 0
        if next_micro < max(1, self.min_micro) and retries <= self.max_retries:
            why = self.offload_rung.engage()  # the last rung (batch/offload_rung.py)
            if why is not None:
                self._record("offload", micro, micro, why)
                self._micro = self._proposal = self._bound = micro
                return
        if next_micro < max(1, self.min_micro) or retries > self.max_retries:
            raise MicroBatchOOMError(
                f"torchmem.BatchSizeController: out of memory at micro-batch {micro} "
                f"(min_micro={self.min_micro}, {retries} retries of this batch, max_retries={self.max_retries}); "
                f"the model does not fit even at the smallest size: lower the sequence length, use activation "
                f"checkpointing, or raise the memory budget. Last error: {outcome['message']}"
            )
        reason = "OOM here" if outcome["oom_here"] else "OOM on another rank"
        self._record("shrink", micro, next_micro, f"{reason}; retrying the same batch of {total}")
        self._micro = self._proposal = self._bound = next_micro

    def _after_success(self, micro, outcome, total):
        if self.offload_rung.active:  # micro stays; the model learns nothing (offload hides the peak)
            self.steps += 1
            self.policy.clean_steps += 1
            self.last_peak, self.last_micro_steps = outcome["peak"], outcome["micro_steps"]
            peak = None if outcome["peak"] is None else outcome["peak"] - (outcome["baseline"] or 0)
            note = self.offload_rung.after_success(peak, self.policy.target(self._budget()))
            if note is not None:
                self._record("offload", micro, micro, note)
            return
        self.steps += 1
        self.last_peak = outcome["peak"]
        self.last_micro_steps = outcome["micro_steps"]
        peak = outcome["peak"]
        self.policy.note_success(micro, None if peak is None else peak - (outcome["baseline"] or 0))
        bound = self._bound if self._throughput() else self._micro
        proposal = self.policy.grow_or_keep(bound, peak, self._budget(), self._cap())
        calibrate = self._throughput() and self.policy.last_kind == "calibrate"
        if calibrate:  # the chooser measures the next smaller count instead (batch/throughput.py)
            proposal = bound
        proposal = self.policy.returnable(proposal, self.probe.owned_bytes(), self._seconds_per_sample,
                                          _BORROWED_MICRO_STEP_S, self._cap())  # Note [Borrowed memory comes back fast]
        if self._throughput():
            self._choose(proposal, calibrate, outcome)
            return
        if self.world == 1:
            chosen = proposal
        else:
            chosen = outcome["next"]  # the MIN of every rank's proposal of the previous step
        if chosen != self._micro:
            self._record("grow" if chosen > self._micro else "shrink", self._micro, chosen,
                         "agreed over ranks" if self.world > 1 else self.policy.last_reason)
        self._micro = chosen
        self._proposal = proposal
        if self.adapt_global:
            self._follow_global(chosen)

    def _choose(self, proposal, calibrate, outcome):
        """objective="throughput": the memory bound (agreed over ranks), then the count of
        micro-steps measured fastest under it (batch/throughput.py)."""
        if self.world == 1:
            bound, calibrate_any = proposal, calibrate
        else:  # the MIN of every rank's bound after the previous step; any rank's wish to calibrate
            bound, calibrate_any = outcome["next"], outcome["calibrate"]
        if bound != self._bound:
            self._record("bound", self._bound, bound,
                         "agreed over ranks" if self.world > 1 else self.policy.last_reason)
        timing = outcome["timing"]
        self.chooser.note_new_sizes(self.timer.runs, None if timing is None else timing["cost"])
        if timing is not None:
            self.chooser.observe(self.local_batch, timing["count"], timing["work"], timing["gap"])
        self._bound, self._proposal, self._calibrate = bound, proposal, calibrate
        self._micro = self.chooser.plan(self.local_batch, bound, calibrate_any)

    def _note_pace(self, total, clean):
        """Seconds per sample from the time between the ends of consecutive clean steps."""
        now = time.perf_counter()
        if clean and self._last_clean_end is not None and total > 0:
            pace = (now - self._last_clean_end) / total
            old = self._seconds_per_sample
            self._seconds_per_sample = pace if old is None else _PACE_WEIGHT * pace + (1 - _PACE_WEIGHT) * old
        self._last_clean_end = now if clean else None

    def _follow_global(self, micro):
        new_global = min(self.max_global, max(self.min_global, micro * self.world))
        new_global -= new_global % self.world
        if new_global == self.global_batch:
            return
        self._record("global", self.global_batch, new_global, "adapt_global: global batch follows memory")
        self.global_batch = new_global
        if self.lr_rule is not None:
            rule = self.lr_rule if callable(self.lr_rule) else LR_RULES[self.lr_rule]
            self.set_lr_factor(rule(new_global / self.base_global_batch))

    def set_lr_factor(self, factor):
        """Scales every param group's lr by factor / (the factor applied so far)."""
        if self.optimizer is not None:
            for group in self.optimizer.param_groups:
                group["lr"] = group["lr"] * factor / self.lr_factor
        self.lr_factor = factor

    # ----------------------------------------------------------- recovery
    def _parameters(self):
        seen, params = set(), []
        sources = []
        if self.model is not None:
            sources.append(self.model.parameters())
        if self.optimizer is not None:
            sources.extend(group["params"] for group in self.optimizer.param_groups)
        for source in sources:
            for p in source:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        return params

    def _discard_attempt(self, had_grads):
        """Cleanup after an OOM, outside the except block (retry.py's Note
        [Cleaning up outside except])."""
        discard_attempt(self.model, self.optimizer, self.scaler, self.sync, had_grads)

    def _enter_optimizer_step(self, *args, **kwargs):
        self._in_optimizer_step = True

    def _leave_optimizer_step(self, *args, **kwargs):
        self._in_optimizer_step = False

    def step(self):
        """optimizer.step() (through the scaler when given), then zero_grad(set_to_none=True).
        An OOM here raises OptimizerStepOOMError with advice instead of a bare OOM."""
        if self.optimizer is None:
            raise ValueError("BatchSizeController.step: no optimizer= was given")
        try:
            optimizer_step(self.optimizer, self.scaler)
        finally:
            self._in_optimizer_step = False

    # ---------------------------------------------------------- reporting
    def _record(self, kind, before, after, reason):
        self.decisions += 1  # events are numbered: callbacks show those they have not shown
        event = {"step": self.steps, "event": kind, "from": before, "to": after, "reason": reason,
                 "seq": self.decisions}
        self.events.append(event)
        text = f"torchmem batch: step {self.steps}: {kind} {before} -> {after} ({reason})"
        log.info(text)
        if self.verbose:
            print(text, flush=True)

    def figures(self):
        """The controller's state for logging: micro-batch, accumulation, OOMs, last peak, budget;
        under objective="throughput" also the measured samples/s of the current choice over all
        ranks (None until measured) and whether the choice has settled."""
        figures = {"micro_batch": self._micro, "accumulation_steps": self.accumulation_steps,
                   "global_batch": self.global_batch, "ooms": self.ooms, "peak_bytes": self.last_peak,
                   "budget_bytes": self._budget(), "lr_factor": self.lr_factor, "objective": self.objective}
        if self._throughput():
            rate = self.chooser.rate(micro_steps(self.local_batch, self._micro))
            figures["samples_per_s"] = None if rate is None else rate * self.world
            figures["settled"] = self.chooser.settled
        return figures

    def state_dict(self):
        """Everything needed to resume with the same sizes, memory model and throughput choice."""
        return {"version": 1, "micro": self._micro, "proposal": self._proposal, **self.policy.state_dict(),
                "steps": self.steps, "ooms": self.ooms,
                "global_batch": self.global_batch, "base_global_batch": self.base_global_batch,
                "lr_factor": self.lr_factor, "bound": self._bound, "chooser": self.chooser.state_dict()}

    def load_state_dict(self, state):
        """Restores state_dict() (the optimizer's lrs are already in its own state dict)."""
        if state.get("version") != 1:
            raise ValueError(f"BatchSizeController.load_state_dict: unknown state version {state.get('version')!r}")
        self._micro = int(state["micro"])
        self._proposal = int(state["proposal"])
        self.policy.load_state_dict(state)
        self.steps = int(state["steps"])
        self.ooms = int(state["ooms"])
        self.global_batch = int(state["global_batch"])
        self.base_global_batch = int(state["base_global_batch"])
        self.lr_factor = float(state["lr_factor"])
        self._bound = int(state.get("bound", self._micro))
        if "chooser" in state:
            self.chooser.load_state_dict(state["chooser"])

    def __repr__(self):
        return (f"BatchSizeController(global_batch={self.global_batch}, micro_batch={self._micro}, "
                f"world={self.world}, probe={self.probe.name}, ooms={self.ooms})")
