"""Lightning integration: a Callback that logs memory figures, and a helper for
micro-batch control inside a manual-optimization training_step.

Lightning is optional: importing this module costs nothing; `TorchmemCallback`
is built on first use and raises ImportError with a hint when neither
`lightning` nor `pytorch_lightning` is installed.

Note [Why control lives in training_step]
Lightning's on_exception hook is terminal (the exception has already left
fit()), so an OOM cannot be retried from a callback. The retry has to wrap the
forward/backward itself: with `automatic_optimization = False`, training_step
owns backward and the optimizer step, which is exactly what the controller needs.

    class Model(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            ...
        def training_step(self, batch, batch_idx):
            if not hasattr(self, "ctl"):
                self.ctl = controller_for(self, global_batch=64)
            loss = run_manual_step(self, self.ctl, lambda mb: self.loss_of(mb), batch)
            self.log("loss", loss)

    trainer = L.Trainer(callbacks=[TorchmemCallback()], ...)

`run_manual_step` splits the batch, calls `self.manual_backward(loss x weight)`
per micro-batch (so Lightning's precision plugin scales it), recovers from
OOM, then steps and zeroes the optimizer.
"""

from torchmem.batch import BatchSizeController
from torchmem.integrations.figures import memory_figures, new_decisions, reset_peaks

__all__ = ["TorchmemCallback", "controller_for", "run_manual_step"]


def _callback_base():
    try:  # Lightning is optional: loaded when a callback is first built
        from lightning.pytorch import Callback
    except ImportError:
        try:
            from pytorch_lightning import Callback
        except ImportError:
            raise ImportError(
                "torchmem.integrations.lightning needs Lightning: `pip install lightning`"
            ) from None
    return Callback


def _build_callback_class():
    class TorchmemCallback(_callback_base()):
        """Logs torchmem's memory figures every `every_n_steps` training steps:
        torchmem/peak_requested_gib, peak_reserved_gib, reserved_over_requested,
        and with a controller (given here or found as `pl_module.ctl`)
        micro_batch, accumulation_steps, ooms, samples_per_s (measured, once
        known) and batch_settled. Each of the controller's decisions (a
        micro-batch tried, the count of micro-steps it settled on, and why) is
        printed on rank 0 and kept in `decisions`. Saves the controller's state
        in checkpoints."""

        def __init__(self, controller=None, every_n_steps=1, prefix="torchmem/"):
            super().__init__()
            self.controller = controller
            self.every_n_steps = max(1, int(every_n_steps))
            self.prefix = prefix
            self.decisions = []
            self._shown = 0
            self._pending_state = None

        def _controller(self, pl_module):
            return self.controller if self.controller is not None else getattr(pl_module, "ctl", None)

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            reset_peaks(pl_module.device if pl_module.device.type == "cuda" else None)
            controller = self._controller(pl_module)
            if self._pending_state is not None and controller is not None:
                controller.load_state_dict(self._pending_state)
                self._pending_state = None

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            controller = self._controller(pl_module)
            lines, self._shown = new_decisions(controller, self._shown)
            self.decisions.extend(lines)
            if lines and trainer.is_global_zero:
                print("\n".join("torchmem batch: " + line for line in lines), flush=True)
            if trainer.global_step % self.every_n_steps:
                return
            device = pl_module.device if pl_module.device.type == "cuda" else None
            figures = memory_figures(device, controller, self.prefix)
            if figures:
                pl_module.log_dict(figures, on_step=True, on_epoch=False, logger=True, prog_bar=False)

        def on_save_checkpoint(self, trainer, pl_module, checkpoint):
            controller = self._controller(pl_module)
            if controller is not None:
                checkpoint["torchmem_batch_controller"] = controller.state_dict()

        def on_load_checkpoint(self, trainer, pl_module, checkpoint):
            self._pending_state = checkpoint.get("torchmem_batch_controller")

    return TorchmemCallback


_cache = {}


def __getattr__(name):
    if name == "TorchmemCallback":
        if name not in _cache:
            _cache[name] = _build_callback_class()
        return _cache[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _raw_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # LightningOptimizer wraps the torch one


def controller_for(pl_module, global_batch, **kwargs):
    """A BatchSizeController for a manual-optimization LightningModule: its
    (first) optimizer, the strategy's wrapped model (DDP under a DDP strategy),
    and the controller's own gradient averaging across ranks."""
    optimizers = pl_module.optimizers()
    optimizer = optimizers[0] if isinstance(optimizers, (list, tuple)) else optimizers
    model = getattr(pl_module.trainer.strategy, "model", None) or pl_module
    return BatchSizeController(global_batch, model=model, optimizer=_raw_optimizer(optimizer), **kwargs)


def run_manual_step(pl_module, controller, loss_fn, batch):
    """One optimizer step over `batch` inside a manual-optimization training_step:
    the controller splits it, `loss_fn(micro_batch)` returns the micro-batch's
    mean loss, Lightning's manual_backward runs on loss x weight; then the
    optimizer steps and zeroes its gradients. Returns the batch's loss."""
    optimizers = pl_module.optimizers()
    optimizer = optimizers[0] if isinstance(optimizers, (list, tuple)) else optimizers

    def micro_step(micro_batch, weight):
        loss = loss_fn(micro_batch)
        pl_module.manual_backward(loss * weight)
        return loss

    loss = controller.run(micro_step, batch, backward=False)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss
