"""Train a GPT-2-style model under a tight memory budget with torchmem's
BatchSizeController: the first micro-batch (the whole batch) does not fit, the
controller recovers from the OOM, measures the memory each step takes, moves to
the largest size that fits, and keeps the global batch of 64 by accumulation.

    python examples/gpt2_finetune_budget.py                  # H200: GPT-2 small, 24 GiB budget
    python examples/gpt2_finetune_budget.py --limit 16GiB --steps 60
    python examples/gpt2_finetune_budget.py --no-install     # torch's allocator + memory fraction

Prints every decision of the controller (OOMs survived, micro-batch changes), the
loss, and tokens per second. Without a GPU it says so and runs a tiny CPU
version against a synthetic memory budget (torchmem.batch.SyntheticMemory),
where it says what the controller does there: halve on each OOM, then keep the
last size that held (CPU_STORY).
"""

import argparse
import os
import sys
import textwrap
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

NEEDS = ("Needs a CUDA GPU with more memory than --limit (GPT-2 small, 24 GiB by default: an H200, A100-40GB "
         "or larger) and torchmem built with CUDA. Without a GPU it runs a tiny CPU version instead.")
# What the controller does in the CPU version, as it happens there: with a budget of 12
# samples and sizes that are multiples of 8, 32 and 16 fail and 8 is the largest that holds;
# then it times the split next to it and keeps the faster.
CPU_STORY = ("No CUDA GPU: running a tiny CPU version against a synthetic memory budget that fits 12 samples "
             "per micro-batch. The controller starts at the whole batch; on each OOM it halves the micro-batch "
             "(it has no measured memory line yet to jump with) until a size holds: sizes are multiples of 8 "
             "(few shapes for torch.compile), so after 32 and 16 fail it runs 8, and accumulates to keep the "
             "global batch. Then it times one more split, 7+7+7+7+4 against 8x4 (objective='throughput': the "
             "fastest split that fits), and settles on the faster.")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], epilog=NEEDS)
    parser.add_argument("--limit", default="24GiB",
                        help="torchmem memory budget: a size such as 24GiB, or a fraction of the GPU such as 0.5 "
                             "(default: %(default)s)")
    parser.add_argument("--steps", type=int, default=40, help="training steps (default: %(default)s)")
    parser.add_argument("--global-batch", type=int, default=64,
                        help="samples per optimizer step, kept whatever the micro-batch (default: %(default)s)")
    parser.add_argument("--seq", type=int, default=1024, help="sequence length (default: %(default)s)")
    parser.add_argument("--no-install", action="store_true",
                        help="do not install torchmem: budget via torch.cuda.set_per_process_memory_fraction")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
    return parser.parse_args(argv)


def train(args, device, probe=None, synthetic=None):
    import torch
    import torchmem
    from tiny_gpt import GPT, GPTConfig, synthetic_tokens, tiny

    cfg = GPTConfig(seq=args.seq) if device == "cuda" else tiny()
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.0)
    step_model = torch.compile(model) if args.compile else model
    ctl = torchmem.BatchSizeController(args.global_batch, model=model, optimizer=optimizer, probe=probe,
                                       verbose=True)
    generator = torch.Generator().manual_seed(1)
    autocast = torch.autocast("cuda", dtype=torch.bfloat16, enabled=device == "cuda")

    def micro_step(ids):
        if synthetic is not None:
            synthetic.use(ids.shape[0])
        with autocast:
            logits = step_model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 ids[:, 1:].reshape(-1))

    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, seq {cfg.seq}, "
          f"global batch {args.global_batch}, probe {ctl.probe.name}")
    losses, rates = [], []
    for step in range(args.steps):
        batch = synthetic_tokens(args.global_batch, cfg, generator, device)
        start = time.perf_counter()
        loss = ctl.run(micro_step, batch)
        ctl.step()
        loss_value = loss.item()  # waits for the GPU
        elapsed = time.perf_counter() - start
        losses.append(loss_value)
        rates.append(args.global_batch * cfg.seq / elapsed)
        if step % 5 == 0 or step == args.steps - 1:
            peak = ctl.last_peak / 2**30 if ctl.last_peak else float("nan")
            print(f"step {step:3d}  loss {loss_value:7.3f}  micro {ctl.micro_batch:3d} x {ctl.accumulation_steps}  "
                  f"peak {peak:6.2f} GiB  {rates[-1]:9.0f} tok/s  OOMs survived {ctl.ooms}")
    tail = rates[len(rates) // 2:]
    print("\nsummary")
    print(f"  OOMs survived:      {ctl.ooms}")
    print(f"  decisions:          {[(e['step'], e['event'], e['from'], e['to']) for e in ctl.events]}")
    print(f"  final micro-batch:  {ctl.micro_batch} (x {ctl.accumulation_steps} accumulation = {args.global_batch})")
    print(f"  loss:               {losses[0]:.3f} -> {losses[-1]:.3f}")
    print(f"  throughput:         {sum(tail) / len(tail):.0f} tokens/s (second half of the run)")
    return 0 if losses[-1] < losses[0] else 1


def main(argv=None):
    args = parse_args(argv)
    import torch
    if not torch.cuda.is_available():
        print(textwrap.fill(CPU_STORY, width=100))
        from torchmem.batch import SyntheticMemory
        memory = SyntheticMemory(fixed=100 << 20, per_sample=8 << 20, budget=(100 << 20) + 12 * (8 << 20) + 1)
        args.steps = min(args.steps, 12)
        args.global_batch = min(args.global_batch, 32)
        return train(args, "cpu", probe=memory, synthetic=memory)
    import torchmem
    if args.no_install:
        from torchmem.runtime.config import Config
        limit = Config(limit=args.limit).limit_bytes(torch.cuda.get_device_properties(0).total_memory)
        fraction = limit / torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(fraction)
        print(f"torch's native allocator, memory fraction {fraction:.3f} ({limit / 2**30:.1f} GiB)")
    else:
        torchmem.install(limit=args.limit)
        print(f"torchmem installed with limit {args.limit}")
    return train(args, "cuda")


if __name__ == "__main__":
    sys.exit(main())
