"""What the batch controller does with a failed attempt: its errors, the loss a
step function returned, and the cleanup before the same batch runs again.

Kept apart from batch/controller.py, which decides when to retry and at which
size; this file knows what a retry must undo: the gradients of the micro-steps
that finished (model, optimizer and, under FSDP2, the unsharded accumulation:
batch/parallel.py), the GradScaler's per-optimizer state, and the garbage the
exception's frames held (retry.py's Note [Cleaning up outside except]).
"""

import collections
from collections.abc import Mapping

import torch

from torchmem.batch.retry import cleanup_after_oom, is_oom_error

__all__ = ["OptimizerStepOOMError", "MicroBatchOOMError", "loss_of", "discard_attempt", "optimizer_oom_message",
           "optimizer_step"]


class OptimizerStepOOMError(RuntimeError):
    """OOM inside optimizer.step(): never retried, the update may be half applied."""


class MicroBatchOOMError(RuntimeError):
    """Still out of memory at the smallest micro-batch, or after max_retries."""


def loss_of(output):
    """The loss in what a step function returned: a tensor, a dict or object with
    'loss', or the first element of a tuple."""
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, Mapping) and "loss" in output:
        return output["loss"]
    if hasattr(output, "loss"):
        return output.loss
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise TypeError(
        f"BatchSizeController.run: the step function returned a {type(output).__name__}; return the "
        f"micro-batch's loss (a scalar tensor, or an object/dict with a 'loss')"
    )


def reset_scaler(scaler):
    """Forgets the GradScaler's per-optimizer state (found-inf flags, unscale
    status) of the failed attempt, as a fresh step would have it."""
    try:  # a private torch helper: absent in some torch versions, then there is nothing to reset
        from torch.amp.grad_scaler import _refresh_per_optimizer_state
    except ImportError:
        return
    if hasattr(scaler, "_per_optimizer_states"):
        scaler._per_optimizer_states = collections.defaultdict(_refresh_per_optimizer_state)


def discard_attempt(model, optimizer, scaler, sync, had_grads):
    """Undoes a failed attempt so the same batch can run again. Call it outside the
    except block. Raises MicroBatchOOMError when it cannot: no model or optimizer to
    clear, or gradients from before run() that a retry would lose."""
    if model is None and optimizer is None:
        raise MicroBatchOOMError(
            "torchmem.BatchSizeController: out of memory, and no model= or optimizer= was given, so the "
            "gradients of the failed attempt cannot be discarded before retrying; pass model=... or optimizer=..."
        )
    sync.reset_after_oom()
    if had_grads:
        raise MicroBatchOOMError(
            "torchmem.BatchSizeController: out of memory, but gradients existed before run() (accumulated "
            "over several run() calls?), and retrying would lose them; call run() once per optimizer step "
            "with the whole batch and zero_grad(set_to_none=True) after each step"
        )
    if model is not None:
        model.zero_grad(set_to_none=True)
    if optimizer is not None:
        optimizer.zero_grad(set_to_none=True)
    if scaler is not None:
        reset_scaler(scaler)
    # No OOM hooks here: torchmem's allocator runs them before it raises.
    cleanup_after_oom(run_hooks=False)


def optimizer_oom_message(failure):
    return (
        "torchmem.BatchSizeController: out of memory inside optimizer.step(); not retried, because the "
        "update may be partly applied. Make room for the optimizer state: a lower memory budget margin "
        "(margin=...), a smaller micro_batch, or a lighter optimizer. Error: " + str(failure)
    )


def optimizer_step(optimizer, scaler=None):
    """optimizer.step() (through the scaler when given), then zero_grad(set_to_none=True);
    an OOM raises OptimizerStepOOMError with advice, outside the except block."""
    failure = None
    try:
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()
    except Exception as exc:  # noqa: BLE001 - anything but OOM re-raises at once
        if not is_oom_error(exc):
            raise
        failure = str(exc)
    if failure is not None:
        raise OptimizerStepOOMError(optimizer_oom_message(failure))
    optimizer.zero_grad(set_to_none=True)
