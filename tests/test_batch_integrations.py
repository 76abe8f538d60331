"""Lightning/HF integrations without the frameworks: lazy imports fail clearly,
and the HF Trainer mixin's training_step (over a stand-in Trainer) splits the
batch and produces full-batch gradients."""

import sys
import types

import pytest
import torch

from torchmem.batch import SyntheticMemory
from torchmem.integrations.figures import memory_figures


def _hide_modules(monkeypatch, *names):
    """Make `import name` fail as if the package were not installed (a None
    entry in sys.modules raises ImportError), whether or not it is."""
    for name in names:
        for loaded in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            monkeypatch.delitem(sys.modules, loaded)
        monkeypatch.setitem(sys.modules, name, None)


def test_lightning_callback_without_lightning_says_how_to_install(monkeypatch):
    import torchmem.integrations.lightning as integration
    _hide_modules(monkeypatch, "lightning", "pytorch_lightning")
    monkeypatch.setattr(integration, "_cache", {})
    with pytest.raises(ImportError, match="pip install lightning"):
        integration.TorchmemCallback


def test_hf_callback_without_transformers_says_how_to_install(monkeypatch):
    import torchmem.integrations.hf as integration
    _hide_modules(monkeypatch, "transformers")
    monkeypatch.setattr(integration, "_cache", {})
    with pytest.raises(ImportError, match="pip install transformers"):
        integration.TorchmemTrainerCallback


class FakeTrainer:
    """The parts of transformers.Trainer that the mixin uses."""

    def __init__(self, model, optimizer):
        self.model = model
        self.optimizer = optimizer
        self.args = types.SimpleNamespace(gradient_accumulation_steps=1, world_size=1, n_gpu=1)
        self.accelerator = types.SimpleNamespace(backward=lambda loss: loss.backward(), scaler=None)
        self.logged = []

    def _prepare_inputs(self, inputs):
        return inputs

    def compute_loss_context_manager(self):
        import contextlib
        return contextlib.nullcontext()

    def compute_loss(self, model, inputs):
        return torch.nn.functional.mse_loss(model(inputs["x"]), inputs["labels"])

    def log(self, logs):
        self.logged.append(logs)


def test_hf_mixin_training_step_splits_and_matches_full_batch_gradients():
    from torchmem.integrations.hf import make_trainer_class
    torch.manual_seed(0)
    inputs = {"x": torch.randn(24, 4, dtype=torch.double), "labels": torch.randn(24, 1, dtype=torch.double)}
    reference = torch.nn.Linear(4, 1).double()
    model = torch.nn.Linear(4, 1).double()
    model.load_state_dict(reference.state_dict())
    torch.nn.functional.mse_loss(reference(inputs["x"]), inputs["labels"]).backward()

    memory = SyntheticMemory(0, 1, 10)
    trainer_class = make_trainer_class(FakeTrainer)
    trainer = trainer_class(model, torch.optim.SGD(model.parameters(), lr=0.1),
                            torchmem_controller_kwargs={"probe": memory, "margin": 0.0, "objective": "largest"})
    original = trainer.compute_loss

    def compute_loss(model, batch):
        memory.use(batch["x"].shape[0])
        return original(model, batch)

    trainer.compute_loss = compute_loss
    loss = trainer.training_step(model, inputs)
    # the batch of 24 OOMed whole, then ran as three micro-batches of 8
    assert trainer.torchmem_controller.ooms >= 1 and memory.sizes_tried[-3:] == [8, 8, 8]
    assert torch.allclose(model.weight.grad, reference.weight.grad, atol=1e-12)
    assert abs(loss.item() - torch.nn.functional.mse_loss(reference(inputs["x"]), inputs["labels"]).item()) < 1e-9
    trainer.log({"loss": 1.0})
    logged = trainer.logged[-1]
    assert logged["torchmem/micro_batch"] == trainer.torchmem_controller.micro_batch and logged["loss"] == 1.0


def test_hf_mixin_logs_the_throughput_choice_and_its_reasons():
    from torchmem.integrations.hf import make_trainer_class
    model = torch.nn.Linear(4, 1).double()
    memory = SyntheticMemory(0, 1, 20)
    trainer = make_trainer_class(FakeTrainer)(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                              torchmem_controller_kwargs={"probe": memory, "margin": 0.0})
    clock = {"now": 0.0}
    original = trainer.compute_loss

    def compute_loss(model, batch):
        memory.use(batch["x"].shape[0])
        clock["now"] += 0.01 + 0.001 * batch["x"].shape[0]
        return original(model, batch)

    trainer.compute_loss = compute_loss
    inputs = {"x": torch.randn(64, 4, dtype=torch.double), "labels": torch.randn(64, 1, dtype=torch.double)}
    trainer._torchmem_build_controller(model, 64).timer.clock = lambda: clock["now"]
    for _ in range(8):
        trainer.training_step(model, inputs)
        model.zero_grad(set_to_none=True)
        clock["now"] += 0.02
        trainer.log({"loss": 1.0})
    ctl = trainer.torchmem_controller
    assert ctl.chooser.settled and ctl.micro_batch == 16
    decisions = " ".join(entry.get("torchmem/decisions", "") for entry in trainer.logged)
    assert "settle" in decisions and "fastest within 2%" in decisions
    assert "torchmem/decisions" not in trainer.logged[-1]  # nothing new since the previous log
    assert trainer.logged[-1]["torchmem/batch_settled"] == 1.0 and trainer.logged[-1]["torchmem/samples_per_s"] > 0


def test_hf_mixin_refuses_trainer_side_accumulation():
    from torchmem.integrations.hf import make_trainer_class
    model = torch.nn.Linear(4, 1)
    trainer = make_trainer_class(FakeTrainer)(model, torch.optim.SGD(model.parameters(), lr=0.1))
    trainer.args.gradient_accumulation_steps = 4
    with pytest.raises(ValueError, match="gradient_accumulation_steps=1"):
        trainer.training_step(model, {"x": torch.randn(8, 4), "labels": torch.randn(8, 1)})


def test_memory_figures_without_cuda_report_the_controller():
    from torchmem.batch import BatchSizeController, NullProbe
    ctl = BatchSizeController(32, model=torch.nn.Linear(2, 1), probe=NullProbe(), micro_batch=8)
    figures = memory_figures(controller=ctl)
    assert figures["torchmem/micro_batch"] == 8.0 and figures["torchmem/accumulation_steps"] == 4.0
    if not torch.cuda.is_available():
        assert "torchmem/peak_reserved_gib" not in figures


def test_lightning_manual_optimization_with_the_controller_and_callback():
    L = pytest.importorskip("lightning")
    from torchmem.integrations.lightning import TorchmemCallback, controller_for, run_manual_step
    memory = SyntheticMemory(0, 1, 10)

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = torch.nn.Linear(4, 1)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

        def training_step(self, batch, batch_idx):
            if not hasattr(self, "ctl"):
                self.ctl = controller_for(self, global_batch=32, probe=memory, margin=0.0, objective="largest")

            def loss_fn(mb):
                memory.use(mb[0].shape[0])
                return torch.nn.functional.mse_loss(self.net(mb[0]), mb[1])

            loss = run_manual_step(self, self.ctl, loss_fn, batch)
            self.log("loss", loss)
            return loss

    data = torch.utils.data.TensorDataset(torch.randn(192, 4), torch.randn(192, 1))
    module = Module()
    callback = TorchmemCallback()
    trainer = L.Trainer(max_steps=4, accelerator="cpu", logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[callback])
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=32))
    assert module.ctl.micro_batch == 8 and module.ctl.ooms == 2
    assert float(trainer.callback_metrics["torchmem/micro_batch"]) == 8.0
    assert [line.split(":")[1].split()[0] for line in callback.decisions] == ["shrink", "shrink"]


def test_hf_trainer_with_the_mixin_and_callback_logs_figures():
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import tempfile
    from torchmem.integrations.hf import TorchmemTrainerCallback, make_trainer_class
    memory = SyntheticMemory(0, 1, 10)
    config = transformers.GPT2Config(n_positions=16, n_embd=16, n_layer=1, n_head=2, vocab_size=64)
    model = transformers.GPT2LMHeadModel(config)
    model.register_forward_pre_hook(lambda m, args, kwargs: memory.use(kwargs["input_ids"].shape[0]),
                                    with_kwargs=True)
    ids = torch.randint(0, 64, (32 * 4, 16))

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    args = transformers.TrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=32,
                                          max_steps=4, logging_steps=2, report_to=[], save_strategy="no",
                                          use_cpu=True, disable_tqdm=True)
    trainer = make_trainer_class(transformers.Trainer)(
        model=model, args=args, train_dataset=Data(), callbacks=[TorchmemTrainerCallback()],
        torchmem_controller_kwargs={"probe": memory, "margin": 0.0, "objective": "largest"})
    trainer.train()
    assert trainer.torchmem_controller.micro_batch == 8 and trainer.torchmem_controller.ooms == 2
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert logged and all(entry["torchmem/micro_batch"] == 8.0 for entry in logged)
