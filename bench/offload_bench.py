"""Activation offload on GPT-2 124M (GPT2Config, seq 1024, bf16 autocast) or a
Llama-style model (LlamaConfig, 8 layers of width 1024, --model llama), for
BENCHMARKS.md: step time and peak memory of
  - no offload;
  - torchmem.offload_activations at a budget (--keep fractions of the saved
    activations kept on the device; 0 moves everything eligible);
  - torch.autograd.graph.save_on_cpu(pin_memory=True).
Issue 13's goals: >= 3x faster than save_on_cpu at the same peak, and <= 1.5x
the no-offload step when less than half of the activations move.

    python bench/offload_bench.py [--model gpt2|llama] [--batch 8] [--keep 0 0.5] [--steps 6] [--out offload.json]
"""

import argparse
import contextlib
import json
import os
import statistics
import sys
import time

# This checkout's torchmem, not whichever one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.0, 0.5, 0.75],
                        help="fractions of the measured saved bytes kept on the device")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode (after 2 warm-up steps)")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("offload_bench: no CUDA GPU here", file=sys.stderr)
        return 2
    import torchmem
    torch.manual_seed(0)
    if args.model == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_positions=args.seq)).cuda()
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=args.seq)).cuda()
    model.config.use_cache = False
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step(ctx):
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def measure(name, make_ctx, extra=None):
        for _ in range(2):
            step(make_ctx())
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            step(make_ctx())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        row = {"mode": name, "step_s": statistics.median(times), "peak_bytes": torch.cuda.max_memory_allocated()}
        row.update(extra() if extra else {})
        print(f"{name:28s} step {row['step_s'] * 1e3:8.1f} ms   peak {row['peak_bytes'] / 2**30:6.2f} GiB"
              + (f"   moved {row['moved_bytes'] / 2**30:.2f} of {row['saved_bytes'] / 2**30:.2f} GiB"
                 if "moved_bytes" in row else ""), flush=True)
        return row

    rows = [measure("none", contextlib.nullcontext)]
    offload = torchmem.offload_activations(None)
    step(offload)  # the measuring step
    saved = offload.last_step["saved_bytes"]
    for keep in args.keep:
        offload.set_budget(int(keep * saved))
        stats = lambda: {"moved_bytes": offload.last_step["offloaded_bytes"],  # noqa: E731
                         "saved_bytes": offload.last_step["saved_bytes"], "keep": keep}
        rows.append(measure(f"torchmem keep {keep:.2f}", lambda: offload, stats))
    rows.append(measure("save_on_cpu(pin_memory=True)",
                        lambda: torch.autograd.graph.save_on_cpu(pin_memory=True)))
    base = rows[0]["step_s"]
    soc = rows[-1]
    for row in rows:
        row["vs_none"] = row["step_s"] / base
        row["save_on_cpu_over_this"] = soc["step_s"] / row["step_s"]
    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model": args.model,
              "batch": args.batch,
              "seq": args.seq, "rows": rows, "host_pool": torchmem.host.stats()}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
