"""Hugging Face Trainer integration: memory figures in the logs, and a Trainer
mixin whose training_step runs each batch through a BatchSizeController.

transformers is optional: importing this module costs nothing; the classes
are built on first use and raise ImportError with a hint without transformers.

    from transformers import Trainer, TrainingArguments
    from torchmem.integrations.hf import TorchmemTrainerCallback, make_trainer_class

    TorchmemTrainer = make_trainer_class(Trainer)
    args = TrainingArguments(per_device_train_batch_size=64,   # the batch you want per device
                             gradient_accumulation_steps=1,     # the controller accumulates
                             ...)
    trainer = TorchmemTrainer(model=model, args=args, train_dataset=ds,
                              callbacks=[TorchmemTrainerCallback()],
                              torchmem_controller_kwargs={"verbose": True})
    trainer.train()

Note [Trainer and the controller]
A TrainerCallback cannot retry a step (only TrainerControl is mutable and there
is no exception hook), so control lives in `training_step`, which the mixin
overrides: it builds the controller on the first step (global batch =
per-device batch x world size, the Trainer's optimizer and AMP scaler),
splits the batch, computes each micro-batch's mean loss with `compute_loss`,
and calls `accelerator.backward(loss x weight)`. Keep
gradient_accumulation_steps=1: the controller refuses to retry when
gradients from an earlier training_step are still accumulated. With token-level
losses over padded sequences the micro-batch mean weights samples, not
tokens, like the Trainer without num_items_in_batch.

Note [Where the figures go]
Trainer.log appends to state.log_history before it calls on_log, and the
reporting callbacks (wandb, tensorboard) run in list order, before ours. So
the callback writes its figures into both `logs` and the last log_history
entry, and the mixin adds them in `log()` itself, before anyone sees the
dict: use the mixin for the figures to reach every reporter. The controller's
decisions since the last log travel as one text entry, torchmem/decisions
(TensorBoard writes text entries with add_text; MLflow drops them with a
warning), only in the logs where there are new ones: a few per run.
"""

from torchmem.batch import BatchSizeController, batch_size_of
from torchmem.integrations.figures import memory_figures, new_decisions, reset_peaks

__all__ = ["TorchmemTrainerCallback", "TorchmemTrainerMixin", "make_trainer_class"]


def _transformers():
    try:  # transformers is optional: loaded when a class is first built
        import transformers
    except ImportError:
        raise ImportError("torchmem.integrations.hf needs transformers: `pip install transformers`") from None
    return transformers


class TorchmemTrainerMixin:
    """Put before Trainer in the bases (or use make_trainer_class):
    class MyTrainer(TorchmemTrainerMixin, Trainer). Extra constructor keyword:
    torchmem_controller_kwargs (passed to BatchSizeController)."""

    def __init__(self, *args, torchmem_controller_kwargs=None, **kwargs):
        self.torchmem_controller_kwargs = dict(torchmem_controller_kwargs or {})
        self.torchmem_controller = None
        self._torchmem_shown = 0
        super().__init__(*args, **kwargs)

    def _torchmem_build_controller(self, model, batch_size):
        if self.args.gradient_accumulation_steps != 1:
            raise ValueError(
                "TorchmemTrainerMixin: set gradient_accumulation_steps=1 and put the whole per-device batch in "
                "per_device_train_batch_size; the controller does the accumulation"
            )
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        scaler = getattr(self.accelerator, "scaler", None)
        world = max(1, self.args.world_size)
        options = {"verbose": False, **self.torchmem_controller_kwargs}
        # Accelerate's backward applies the scaler itself: the controller only resets its state after OOM
        self.torchmem_controller = BatchSizeController(
            batch_size * world, model=model, optimizer=optimizer, scaler=scaler, **options)
        return self.torchmem_controller

    def training_step(self, model, inputs, num_items_in_batch=None):
        model.train()
        inputs = self._prepare_inputs(inputs)
        controller = self.torchmem_controller
        if controller is None:
            controller = self._torchmem_build_controller(model, batch_size_of(inputs))

        def micro_step(micro_batch, weight):
            with self.compute_loss_context_manager():
                loss = self.compute_loss(model, micro_batch)
            if self.args.n_gpu > 1:
                loss = loss.mean()
            self.accelerator.backward(loss * weight)
            return loss.detach()

        return controller.run(micro_step, inputs, backward=False)

    def log(self, logs, *args, **kwargs):
        logs = dict(logs)
        logs.update(memory_figures(None, self.torchmem_controller))
        lines, self._torchmem_shown = new_decisions(self.torchmem_controller, self._torchmem_shown)
        if lines:
            logs["torchmem/decisions"] = "; ".join(lines)
        return super().log(logs, *args, **kwargs)


def make_trainer_class(base=None):
    """TorchmemTrainerMixin mixed into `base` (transformers.Trainer by default)."""
    base = base if base is not None else _transformers().Trainer
    return type(f"Torchmem{base.__name__}", (TorchmemTrainerMixin, base), {})


def _build_callback_class():
    class TorchmemTrainerCallback(_transformers().TrainerCallback):
        """Resets peak figures at each step's start and adds torchmem's figures
        (peak requested/reserved, ratio; with a controller given here,
        micro-batch, samples/s and whether its choice settled, and its decisions
        since the last log as one text entry, torchmem/decisions) to every log
        (Note [Where the figures go]; the mixin adds the same for its own
        controller)."""

        def __init__(self, controller=None, prefix="torchmem/"):
            self.controller = controller
            self.prefix = prefix
            self._trainer_controller = None
            self._shown = 0

        def on_step_begin(self, args, state, control, **kwargs):
            reset_peaks()

        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs is None:
                return
            figures = memory_figures(None, self.controller, self.prefix)
            lines, self._shown = new_decisions(self.controller, self._shown)
            if lines:
                figures[self.prefix + "decisions"] = "; ".join(lines)
            missing = {k: v for k, v in figures.items() if k not in logs}
            logs.update(missing)
            if state.log_history and state.log_history[-1].get("step") == state.global_step:
                for key, value in missing.items():
                    state.log_history[-1].setdefault(key, value)

    return TorchmemTrainerCallback


_cache = {}


def __getattr__(name):
    if name == "TorchmemTrainerCallback":
        if name not in _cache:
            _cache[name] = _build_callback_class()
        return _cache[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
