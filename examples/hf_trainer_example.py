"""Hugging Face Trainer with torchmem: TorchmemTrainerCallback adds memory
figures to the logs, and a Trainer built with make_trainer_class runs each
batch through the BatchSizeController under a memory budget.

    python examples/hf_trainer_example.py            # H200: GPT-2 small from config (no download), 24 GiB budget
    python examples/hf_trainer_example.py --limit 16GiB --steps 40

Prints the controller's decisions and the log entries with torchmem/* figures.
Without transformers or without a GPU it says so and exits 0.
"""

import os
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main(argv=None):
    from tiny_gpt import example_args

    args = example_args(__doc__.split("\n\n")[0], argv, needs=(
        "Needs a CUDA GPU with more memory than --limit (GPT-2 small, 24 GiB by default), torchmem built with "
        "CUDA, and transformers (pip install transformers accelerate). Without them it says so and exits 0."))

    import torch
    try:
        import transformers
    except ImportError:
        print("transformers is not installed (pip install transformers): nothing to run.")
        return 0
    if not torch.cuda.is_available():
        print("No CUDA GPU: this example trains GPT-2 small on a GPU; nothing to run here.")
        return 0

    import torchmem
    from torchmem.integrations.hf import TorchmemTrainerCallback, make_trainer_class
    from tiny_gpt import GPTConfig, synthetic_tokens

    torchmem.install(limit=args.limit)
    config = transformers.GPT2Config(n_positions=args.seq, n_embd=768, n_layer=12, n_head=12)
    model = transformers.GPT2LMHeadModel(config)
    ids = synthetic_tokens(args.global_batch * args.steps, GPTConfig(seq=args.seq - 1, vocab=config.vocab_size),
                           torch.Generator().manual_seed(0))

    class TokenData(torch.utils.data.Dataset):
        def __len__(self):
            return len(ids)

        def __getitem__(self, i):
            return {"input_ids": ids[i], "labels": ids[i]}

    training_args = transformers.TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="torchmem_hf_"), per_device_train_batch_size=args.global_batch,
        gradient_accumulation_steps=1, max_steps=args.steps, logging_steps=5, learning_rate=3e-4,
        bf16=True, report_to=[], save_strategy="no", dataloader_num_workers=0)
    TorchmemTrainer = make_trainer_class(transformers.Trainer)
    trainer = TorchmemTrainer(model=model, args=training_args, train_dataset=TokenData(),
                              callbacks=[TorchmemTrainerCallback()],
                              torchmem_controller_kwargs={"verbose": True})
    trainer.train()
    ctl = trainer.torchmem_controller
    for entry in trainer.state.log_history:
        print({k: (round(v, 3) if isinstance(v, float) else v) for k, v in entry.items()})
    print(f"\nsummary: OOMs survived {ctl.ooms}, final micro-batch {ctl.micro_batch} x {ctl.accumulation_steps}, "
          f"decisions {[(e['step'], e['event'], e['from'], e['to']) for e in ctl.events]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
