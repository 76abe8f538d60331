"""torch.compile(mode="reduce-overhead") on GPT-2 small: native allocator vs torchmem.

    python bench/compile_reduce_overhead.py --out compile_ro.json [--rounds 2] [--steps 30] [--budgets 1.05 1.10]

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

Budgets (--budgets B ...): after the unconstrained rounds, every mode runs again under
torch.cuda.set_per_process_memory_fraction(B x the largest peak request of those rounds /
device memory), which PyTorch's allocator obeys and torchmem answers as its limit. A run that
runs out of memory is reported as an OOM (its phase and the error's first line), not an error.
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
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES),
                        help="the modes to run (native is always one: the ratios are over it)")
    parser.add_argument("--budgets", type=float, nargs="*", default=[],
                        help="also run each mode under these multiples of the peak request (e.g. 1.05 1.10)")
    parser.add_argument("--child", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--memory-fraction", type=float, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    for name in ("rounds", "steps", "warmup", "batch", "seq"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be >= 1")
    if any(b < 1.0 for b in args.budgets):
        parser.error("--budgets are multiples of the peak request: each must be >= 1")
    if "native" not in args.modes:
        parser.error("--modes must include native: every ratio is over it")
    return args


def run_child(args):
    """One mode in this process; prints one JSON line."""
    import torch

    if args.child.startswith("torchmem"):
        import torchmem

        torchmem.install(park_private_frees=args.child == "torchmem_park")
    if args.memory_fraction:
        torch.cuda.set_per_process_memory_fraction(args.memory_fraction)
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

    base = {"mode": args.child, **environment(torch), "batch": args.batch, "seq": args.seq,
            "memory_fraction": args.memory_fraction}
    phase = "train"
    try:
        model.train()
        train_s = timed(train_step)
        phase = "infer"
        model.eval()
        infer_s = timed(infer_step)
    except torch.OutOfMemoryError as e:
        print(json.dumps({**base, "oom": phase, "error": str(e).splitlines()[0][:200]}), flush=True)
        return
    manager = trees.get_manager(torch.cuda.current_device(), create_if_none_exists=False)
    result = {
        **base,
        "train_step_s": train_s,
        "infer_step_s": infer_s,
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "peak_requested": torch.cuda.max_memory_allocated(),
        "device_memory": torch.cuda.get_device_properties(0).total_memory,
        "cudagraph_skips": dynamo_utils.counters["inductor"]["cudagraph_skips"],
        "graphs_recorded": sum(1 + root.num_descendants() for root in manager.get_roots()) if manager else 0,
    }
    print(json.dumps(result), flush=True)


def run_mode(args, mode, fraction=None):
    """One child process; its JSON line."""
    cmd = [sys.executable, os.path.abspath(__file__), "--out", args.out, "--child", mode,
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--batch", str(args.batch),
           "--seq", str(args.seq)] + (["--memory-fraction", f"{fraction:.6f}"] if fraction else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout + proc.stderr)
        raise SystemExit(f"{mode} run failed (exit {proc.returncode}); its output is above")
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def report(run, label):
    if "oom" in run:
        print(f"{label} {run['mode']:14s} OOM in {run['oom']}: {run['error']}", flush=True)
        return
    print(f"{label} {run['mode']:14s} train {run['train_step_s'] * 1e3:8.2f} ms  infer "
          f"{run['infer_step_s'] * 1e3:8.2f} ms  peak reserved {run['peak_reserved'] / 2**30:6.2f} GiB  "
          f"skips {run['cudagraph_skips']}  graphs {run['graphs_recorded']}", flush=True)


def round_order(args, r):
    """The modes in round r's order: alternated, so that none is always first."""
    modes = tuple(m for m in MODES if m in args.modes)
    return modes if r % 2 == 0 else tuple(reversed(modes))


def medians_and_ratios(runs):
    """Per mode, the median of each figure over the runs that fit; each mode over native."""
    summary = {}
    for mode in MODES:
        mine = [x for x in runs if x["mode"] == mode and "oom" not in x]
        if mine:
            summary[mode] = {key: statistics.median(x[key] for x in mine)
                             for key in ("train_step_s", "infer_step_s", "peak_reserved")}
    ratios = {}
    for mode in MODES[1:]:
        if mode in summary and "native" in summary:
            ratios[mode] = {key: summary[mode][key] / summary["native"][key] for key in summary["native"]}
    return summary, ratios


def print_ratios(ratios, label):
    for mode, r in ratios.items():
        print(f"{label}{mode} / native: train {r['train_step_s']:.3f}x  infer {r['infer_step_s']:.3f}x  "
              f"peak reserved {r['peak_reserved']:.3f}x")


def run_parent(args):
    runs = []
    for r in range(args.rounds):
        for mode in round_order(args, r):
            result = run_mode(args, mode)
            if "oom" in result:
                raise SystemExit(f"{mode} ran out of memory with no budget: {result['error']}")
            result["round"] = r
            runs.append(result)
            report(result, f"round {r}")
    summary, ratios = medians_and_ratios(runs)
    print_ratios(ratios, "")
    budgets = {}
    if args.budgets:
        peak = max(x["peak_requested"] for x in runs)
        total = runs[0]["device_memory"]
        for budget in args.budgets:
            fraction = min(1.0, budget * peak / total)
            label = f"budget {budget:g}x"
            mine = []
            for r in range(args.rounds):
                for mode in round_order(args, r):
                    result = run_mode(args, mode, fraction)
                    result.update(round=r, budget=budget)
                    mine.append(result)
                    report(result, f"{label} round {r}")
            b_summary, b_ratios = medians_and_ratios(mine)
            print_ratios(b_ratios, f"{label}: ")
            budgets[f"{budget:g}"] = {"fraction": fraction, "runs": mine, "median": b_summary,
                                      "ratio_over_native": b_ratios,
                                      "oom": sorted({x["mode"] for x in mine if "oom" in x})}
    with open(args.out, "w") as f:
        json.dump({"runs": runs, "median": summary, "ratio_over_native": ratios, "budgets": budgets}, f, indent=2)
    print(f"wrote {args.out}")


def main(argv=None):
    args = parse_args(argv)
    if args.child:
        run_child(args)
    else:
        run_parent(args)


if __name__ == "__main__":
    main()
