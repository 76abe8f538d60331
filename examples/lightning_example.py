"""Lightning with torchmem: the TorchmemCallback logs memory figures every step,
and a manual-optimization LightningModule lets the BatchSizeController pick the
micro-batch under a memory budget (recovering from the OOM of the first size).

    python examples/lightning_example.py             # H200: GPT-2 small, 24 GiB torchmem budget, 30 steps
    python examples/lightning_example.py --limit 16GiB --steps 50

Prints the controller's decisions and the logged torchmem/* metrics. Without
Lightning or without a GPU it says so and exits 0.
"""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    from tiny_gpt import example_args

    args = example_args(__doc__.split("\n\n")[0], argv, needs=(
        "Needs a CUDA GPU with more memory than --limit (GPT-2 small, 24 GiB by default), torchmem built with "
        "CUDA, and Lightning (pip install lightning). Without them it says so and exits 0."))

    import torch
    try:
        import lightning as L
    except ImportError:
        try:
            import pytorch_lightning as L
        except ImportError:
            print("Lightning is not installed (pip install lightning): nothing to run.")
            return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU: this example trains GPT-2 small on a GPU; nothing to run here.")
        return 0

    import torchmem
    from torchmem.integrations.lightning import TorchmemCallback, controller_for, run_manual_step
    from tiny_gpt import GPT, GPTConfig, synthetic_tokens

    torchmem.install(limit=args.limit)
    cfg = GPTConfig(seq=args.seq)

    class TokenData(torch.utils.data.Dataset):
        def __init__(self, n):
            self.ids = synthetic_tokens(n, cfg, torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return self.ids[i]

    class LitGPT(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False  # the controller owns backward (Note in integrations/lightning.py)
            self.gpt = GPT(cfg)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

        def training_step(self, batch, batch_idx):
            if not hasattr(self, "ctl"):
                self.ctl = controller_for(self, global_batch=args.global_batch, verbose=True)
            loss = run_manual_step(self, self.ctl, self.gpt.loss, batch)
            self.log("loss", loss, prog_bar=True)
            return loss

    class PrintMetrics(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step % 5 == 1:
                shown = {k: round(float(v), 3) for k, v in trainer.callback_metrics.items()}
                print(f"step {trainer.global_step}: {shown}")

    loader = torch.utils.data.DataLoader(TokenData(args.global_batch * args.steps), batch_size=args.global_batch)
    module = LitGPT()
    import tempfile
    log_dir = tempfile.mkdtemp(prefix="torchmem_lightning_")
    logger = L.pytorch.loggers.CSVLogger(log_dir) if hasattr(L, "pytorch") else L.loggers.CSVLogger(log_dir)
    trainer = L.Trainer(max_steps=args.steps, accelerator="gpu", devices=1, precision="bf16-mixed",
                        callbacks=[TorchmemCallback(), PrintMetrics()], logger=logger, log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(module, loader)
    ctl = module.ctl
    print(f"\nsummary: OOMs survived {ctl.ooms}, final micro-batch {ctl.micro_batch} x {ctl.accumulation_steps}, "
          f"decisions {[(e['step'], e['event'], e['from'], e['to']) for e in ctl.events]}")
    print(f"logged torchmem metrics: {sorted(k for k in trainer.callback_metrics if k.startswith('torchmem/'))} "
          f"(CSV in {logger.log_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
