"""GradSync: how a micro-step syncs gradients under the parallel wrappers the
batch controller meets (DDP, FSDP2's fully_shard), and how a failed attempt
leaves them clean for the retry.

Note [Where the agreement happens]
Each attempt has exactly one agreement collective (batch/distributed.py) when
more than one rank runs. By default (grad_sync="controller", also for a
DDP-wrapped model) every micro-step runs under no_sync() when the model has it,
the agreement comes after every backward, and the controller averages the
gradients itself: an OOM anywhere in forward or backward on any subset of
ranks is recoverable. DDP's own reducer cannot be used across an aborted
attempt: once a synchronized forward has run, DDP expects its backward, and a
later no_sync() backward would launch a gradient all-reduce on that rank alone
(seen with gloo as a collective mismatch). grad_sync="ddp" keeps DDP's
reducer (overlap of communication with backward) and agrees just before the
final micro-step: OOMs in earlier micro-steps are recovered, an OOM in the
final one raises MicroBatchOOMError (the other ranks fail in the all-reduce).

Note [Gradient sync per wrapper]
- No wrapper, one process: nothing to sync.
- DDP: grad_sync="controller" (the default) runs every micro-step under
  no_sync() and averages gradients itself after the agreement;
  grad_sync="ddp" lets DDP's reducer sync the final micro-step
  (Note [Where the agreement happens], controller.py).
- FSDP2 (fully_shard): set_requires_gradient_sync(False) on every micro-step
  but the final one, so the unsharded gradients accumulate locally and only
  the final backward reduce-scatters them; reshard_after_forward and the
  rest stay as the user set them. The controller cannot average sharded
  gradients itself, so under FSDP2 grad_sync is "fsdp", and the agreement
  comes after every backward, as under "controller". FSDP all-gathers in
  every forward, so only an OOM that every rank hits at the same point (the
  same sizes under the same budget: the usual case) is recovered, in any
  micro-step, the final one included: every rank breaks off there and meets
  the others in the agreement. An OOM on some ranks only is not: the others
  wait in FSDP's next all-gather or reduce-scatter, and it times out as any
  collective mismatch does. On one rank every OOM is recovered.
- After an OOM under FSDP2: reset_iter_state() on the root where torch has it
  (it waits for in-flight collectives, reshards, and resets FSDP's
  per-iteration state: without that a forward cut short leaves a state that
  hangs or asserts in the next one); where it lacks it, the same by hand on
  the attributes it resets, each only if present. Then the unsharded
  gradients that earlier micro-steps of the failed attempt accumulated are
  dropped, or the retry would count them twice.
"""

import contextlib
import warnings

__all__ = ["GradSync", "fsdp_roots", "resolve_grad_sync", "is_compiled"]


def _fsdp_module_class():
    try:  # torch.distributed pieces load only for a job that uses them (and may be absent)
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return None
    return FSDPModule


def fsdp_roots(model):
    """The outermost fully_shard modules in `model` (empty without FSDP2)."""
    cls = _fsdp_module_class()
    if model is None or cls is None:
        return []
    roots, covered = [], set()
    for module in model.modules():
        if isinstance(module, cls) and id(module) not in covered:
            roots.append(module)
            covered.update(id(m) for m in module.modules())
    return roots


def is_compiled(model):
    """True when `model` or a submodule went through torch.compile (the wrapper or
    nn.Module.compile()): each new micro-batch size is then a new graph."""
    if model is None:
        return False
    return any(hasattr(m, "_orig_mod") or getattr(m, "_compiled_call_impl", None) is not None
               for m in model.modules())


def resolve_grad_sync(grad_sync, model, world):
    """The grad_sync mode in force: "fsdp" for a model with fully_shard modules,
    "none" on one rank, "controller" for "auto" with a model under several."""
    if grad_sync not in ("auto", "ddp", "controller", "fsdp", "none"):
        raise ValueError(f"BatchSizeController: grad_sync must be auto, controller, ddp, fsdp or none, "
                         f"got {grad_sync!r}")
    if fsdp_roots(model):
        if grad_sync in ("auto", "fsdp", "none"):
            return "none" if grad_sync == "none" else "fsdp"
        raise ValueError(f"BatchSizeController: grad_sync={grad_sync!r} with FSDP2 (fully_shard) modules: FSDP "
                         f"reduce-scatters its sharded gradients itself; use grad_sync='auto' (= 'fsdp')")
    if grad_sync == "fsdp":
        raise ValueError("BatchSizeController: grad_sync='fsdp' needs a model with fully_shard modules")
    if world == 1:
        return "none"
    if grad_sync == "auto":
        grad_sync = "controller" if model is not None else "none"
    if grad_sync == "controller" and model is None:
        raise ValueError("BatchSizeController: grad_sync='controller' averages the model's gradients: pass model=...")
    # torch.distributed pieces load only for a job that uses them
    from torch.nn.parallel import DistributedDataParallel
    if (isinstance(model, DistributedDataParallel) and getattr(model, "broadcast_buffers", False)
            and any(True for _ in model.buffers())):
        warnings.warn(
            "torchmem.BatchSizeController: DDP(broadcast_buffers=True) broadcasts buffers in every "
            "forward, a collective that a rank skipping micro-steps after an OOM would miss; "
            "wrap with broadcast_buffers=False",
            RuntimeWarning, stacklevel=4,
        )
    return grad_sync


class GradSync:
    """Per-micro-step gradient sync for `model` under `mode` ("none", "controller",
    "ddp", "fsdp"): context(final) wraps a micro-step; reset_after_oom() cleans up."""

    def __init__(self, model, mode):
        self.model = model
        self.mode = mode
        self.fsdp = fsdp_roots(model) if mode == "fsdp" else []
        self._warned = False

    def context(self, final):
        """no_sync() for micro-steps DDP must not all-reduce (all under "controller",
        the non-final ones under "ddp"); FSDP2's gradient sync on the final one only."""
        if self.mode == "fsdp":
            for root in self.fsdp:
                root.set_requires_gradient_sync(final)
            return contextlib.nullcontext()
        no_sync = getattr(self.model, "no_sync", None)
        if no_sync is None or self.mode == "none" or (final and self.mode == "ddp"):
            return contextlib.nullcontext()
        return no_sync()

    def reset_after_oom(self):
        """FSDP2's state after an attempt cut short (Note [Gradient sync per wrapper])."""
        for root in self.fsdp:
            try:
                if getattr(root._get_fsdp_state(), "_is_root", None) is not None:  # it ran a forward
                    self._reset(root)
                self._drop_accumulated(root)
            except (AttributeError, RuntimeError) as exc:
                self._warn(exc)
            root.set_requires_gradient_sync(True)

    def _reset(self, root):
        reset = getattr(root, "reset_iter_state", None)
        if reset is not None:
            try:
                reset()
                return
            except (AttributeError, RuntimeError):
                pass  # torch's own reset met a state it does not expect: the attributes by hand
        self._reset_by_hand(root)

    def _reset_by_hand(self, root):
        # torch.distributed pieces load only for a job that uses them
        from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

        state = root._get_fsdp_state()
        context = getattr(state, "_state_ctx", None)
        comm = getattr(state, "_comm_ctx", None)
        for each in (getattr(context, "all_states", None) or [state]):
            each._training_state = TrainingState.IDLE
            if hasattr(each, "_modules_to_run_forward"):
                each._modules_to_run_forward.clear()
            for group in each._fsdp_param_groups:
                group._training_state = TrainingState.IDLE
                group.reshard()
        if context is not None:
            context.iter_forward_root = None
            context.post_backward_final_callback_queued = False
        if comm is not None:
            if hasattr(comm, "all_gather_state"):
                comm.all_gather_state = None
            for name in ("reduce_scatter_states", "post_forward_order"):
                if isinstance(getattr(comm, name, None), list):
                    getattr(comm, name).clear()
            if hasattr(comm, "reduce_scatter_state"):
                comm.reduce_scatter_state = None

    @staticmethod
    def _drop_accumulated(root):
        state = root._get_fsdp_state()
        context = getattr(state, "_state_ctx", None)
        for each in (getattr(context, "all_states", None) or [state]):
            for group in each._fsdp_param_groups:
                for param in group.fsdp_params:
                    param.unsharded_accumulated_grad = None
                    unsharded = getattr(param, "_unsharded_param", None)
                    if unsharded is not None:
                        unsharded.grad = None

    def _warn(self, exc):
        if not self._warned:
            self._warned = True
            warnings.warn(f"torchmem.BatchSizeController: could not reset FSDP2's state after an OOM ({exc!r}); "
                          f"the retry may fail or hang. Newer torch has FSDPModule.reset_iter_state.",
                          RuntimeWarning, stacklevel=4)
