"""torch.compile(mode="reduce-overhead") on GPT-2 small: native allocator vs torchmem.

    python bench/compile_reduce_overhead.py --out compile_ro.json [--rounds 2] [--steps 30]

CUDA graph trees record into a private pool of the allocator and restore its
checkpoints (torchmem: csrc/shim/checkpoint.cpp). This runs the same workload
once under PyTorch's native allocator and once with torchmem installed, each in
its own interpreter (an allocator is chosen once per process), alternating which
goes first over the rounds, and prints median step times and torchmem/native
ratios. The model is GPT-2 small built from transformers' GPT2Config (no
download), in bf16, with a fixed batch shape (graphs replay one shape).

Per run: train_step_s and infer_step_s (medians of synchronized steps after the
warm-up steps, which include compilation and graph recording), peak_reserved
(torch.cuda.max_memory_reserved: torchmem's figure when installed),
cudagraph_skips (inductor's count of graphs that fell back to eager: 0 expected)
and graphs_recorded.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# torchmem: the default (park_private_frees=False: blocks freed in a graph pool are reused by
# that pool, as in PyTorch); torchmem_park: park_private_frees=True (kept until the pool's release)
MODES = ("native", "torchmem", "torchmem_park")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # torchmem from this checkout
from common import environment  # noqa: E402  (bench/common.py, beside this file)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per phase")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps per phase (compile, record)")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "warmup", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    return args


def run_child(args):
    """One mode in this process; prints one JSON line."""
    import torch

    if args.child.startswith("torchmem"):
        import torchmem

        torchmem.install(park_private_frees=args.child == "torchmem_park")
    import torch._dynamo.utils as dynamo_utils
    import torch._inductor.cudagraph_trees as trees
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    config = GPT2Config(use_cache=False)  # GPT-2 small: 12 layers, 768 wide, 50257 tokens
    model = GPT2LMHeadModel(config).to(device="cuda", dtype=torch.bfloat16)
    compiled = torch.compile(model, mode="reduce-overhead")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, config.vocab_size, (args.batch, args.seq), device="cuda")

    def timed(step):
        times = []
        for i in range(args.warmup + args.steps):
            torch.cuda.synchronize()
            start = time.perf_counter()
            step()
            torch.cuda.synchronize()
            if i >= args.warmup:
                times.append(time.perf_counter() - start)
        return statistics.median(times)

    def train_step():
        torch.compiler.cudagraph_mark_step_begin()
        loss = compiled(tokens, labels=tokens).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    def infer_step():
        torch.compiler.cudagraph_mark_step_begin()
        with torch.no_grad():
            compiled(tokens).logits.float().sum().item()

    model.train()
    train_s = timed(train_step)
    model.eval()
    infer_s = timed(infer_step)
    manager = trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    result = {
        "mode": args.child,
        **environment(torch),
        "batch": args.batch,
        "seq": args.seq,
        "train_step_s": train_s,
        "infer_step_s": infer_s,
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "cudagraph_skips": dynamo_utils.counters["inductor"]["cudagraph_skips"],
        "graphs_recorded": sum(1 + root.num_descendants() for root in manager.get_roots()) if manager else 0,
    }
    print(json.dumps(result), flush=True)


def run_parent(args):
    runs = []
    for r in range(args.rounds):
        order = MODES if r % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", mode,
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
                   "--seq", str(args.seq)]
            proc = subprocess.run(cmd, capture_output=True, text=True)
            if proc.returncode != 0:
                sys.stderr.write(proc.stdout + proc.stderr)
                raise SystemExit(f"{mode} run of round {r} failed (exit {proc.returncode}); its output is above")
            result = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
            result["round"] = r
            runs.append(result)
            print(f"round {r} {mode:14s} train {result['train_step_s'] * 1e3:8.2f} ms  infer "
                  f"{result['infer_step_s'] * 1e3:8.2f} ms  peak reserved {result['peak_reserved'] / 2**30:6.2f} GiB  "
                  f"skips {result['cudagraph_skips']}  graphs {result['graphs_recorded']}", flush=True)
    summary = {}
    for mode in MODES:
        mine = [x for x in runs if x["mode"] == mode]
        summary[mode] = {key: statistics.median(x[key] for x in mine)
                         for key in ("train_step_s", "infer_step_s", "peak_reserved")}
    ratios = {}
    for mode in MODES[1:]:
        ratios[mode] = {key: summary[mode][key] / summary["native"][key] for key in summary["native"]}
        print(f"{mode} / native: train {ratios[mode]['train_step_s']:.3f}x  infer "
              f"{ratios[mode]['infer_step_s']:.3f}x  peak reserved {ratios[mode]['peak_reserved']:.3f}x")
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "median": summary, "ratio_over_native": ratios}, f, indent=2)
    print(f"wrote {args.out}")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run_child(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
