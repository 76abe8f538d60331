"""Adaptive batch size on one GPU: torchmem's controller vs Accelerate's
find_executable_batch_size vs Lightning's BatchSizeFinder, same model, same
budget; plus the best fixed micro-batch from a sweep, and 100 forced OOMs.

    python bench/batch_compare.py                       # everything, GPT-2 small, 24 GiB, global batch 64
    python bench/batch_compare.py --methods torchmem,sweep --limit 16GiB
    python bench/batch_compare.py --out batch_compare.jsonl

Each method runs in its own process (the allocator is chosen once per process)
with torchmem installed at `--limit`, trains GPT-2 small (examples/tiny_gpt.py,
bf16 autocast, AdamW) on synthetic tokens at a global batch of 64 (micro-batches
accumulate up to it), and prints one JSON line:
  steps_to_converge  training steps run (including steps of failed trials or
                     restarts) until the size stops changing
  ooms               OOMs on the way
  final_micro        the micro-batch it trains at
  tokens_per_s       steady-state throughput at that size (median of timed steps)
Methods:
  torchmem    BatchSizeController from a cold start (first try: all 64), with
              --objective (throughput, the default, or largest)
  accelerate  accelerate.utils.find_executable_batch_size(starting_batch_size=64):
              restarts the training function (fresh model) on each OOM
  lightning   Tuner.scale_batch_size(mode="power", init_val=2, steps_per_trial=3)
              then training at the size found
  sweep       fixed micro-batches 8, 16, ..., 64 by hand: the best is the goal
              ("controller within 3% of the best fixed size")
  forced_oom  100 steps with an OOM forced mid-forward (activations alive):
              each recovered, memory back to the baseline after every step
Accelerate and Lightning are skipped (with a line saying so) when not installed.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from common import append_jsonl  # bench/common.py, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "examples"))

METHODS = ("torchmem", "accelerate", "lightning", "sweep", "forced_oom")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--limit", default="24GiB")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=30, help="timed steps per method")
    parser.add_argument("--objective", default="throughput", choices=("throughput", "largest"))
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # child mode
    return parser.parse_args(argv)


class Setup:
    """Model, optimizer and data in this process (torchmem already installed)."""

    def __init__(self, args):
        import torch
        from tiny_gpt import GPT, GPTConfig, synthetic_tokens
        self.torch = torch
        self.args = args
        self.cfg = GPTConfig(seq=args.seq)
        torch.manual_seed(0)
        self.model = GPT(self.cfg).cuda()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=3e-4, fused=True)
        generator = torch.Generator().manual_seed(1)
        self.batches = [synthetic_tokens(args.global_batch, self.cfg, generator, "cuda") for _ in range(4)]

    def loss(self, ids):
        with self.torch.autocast("cuda", dtype=self.torch.bfloat16):
            return self.model.loss(ids)

    def batch(self, step):
        return self.batches[step % len(self.batches)]

    def fixed_step(self, micro, step):
        """One optimizer step at a fixed micro-batch, accumulating to the global batch."""
        batch = self.batch(step)
        total = batch.shape[0]
        for chunk in batch.split(micro):
            (self.loss(chunk) * (chunk.shape[0] / total)).backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def timed(self, step_fn, steps, warmup=3):
        """Median tokens/s over `steps` steps after `warmup`."""
        torch = self.torch
        for i in range(warmup):
            step_fn(i)
        torch.cuda.synchronize()
        times = []
        for i in range(steps):
            start = time.perf_counter()
            step_fn(warmup + i)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
        return self.args.global_batch * self.cfg.seq / statistics.median(times)


def run_torchmem(args, setup):
    import torchmem
    ctl = torchmem.BatchSizeController(args.global_batch, model=setup.model, optimizer=setup.optimizer,
                                       objective=args.objective)
    sizes = []
    for step in range(12):
        ctl.run(setup.loss, setup.batch(step))
        ctl.step()
        sizes.append(ctl.micro_batch)
    converged = next(i for i in range(len(sizes)) if len(set(sizes[i:])) == 1) + 1
    ooms_before = ctl.ooms

    def step_fn(i):
        ctl.run(setup.loss, setup.batch(i))
        ctl.step()

    rate = setup.timed(step_fn, args.steps)
    return {"steps_to_converge": converged, "ooms": ctl.ooms, "final_micro": ctl.micro_batch,
            "tokens_per_s": rate, "ooms_after_convergence": ctl.ooms - ooms_before,
            "decisions": [(e["step"], e["event"], e["from"], e["to"], e["reason"]) for e in ctl.events],
            "memory_model": {"fixed": ctl.memory_model.fixed, "slope": ctl.memory_model.slope,
                             "observations": list(ctl.memory_model.observations)},
            "budget_bytes": ctl.figures()["budget_bytes"]}


def run_accelerate(args, setup):
    try:
        from accelerate.utils import find_executable_batch_size
    except ImportError:
        return {"skipped": "accelerate is not installed"}
    torch = setup.torch
    trials, steps_run = [], [0]

    @find_executable_batch_size(starting_batch_size=args.global_batch)
    def train(batch_size):
        # Accelerate's rule: everything holding memory is created inside the function
        trials.append(batch_size)
        setup.optimizer.zero_grad(set_to_none=True)
        setup.optimizer.state.clear()
        for step in range(3):
            steps_run[0] += 1
            setup.fixed_step(batch_size, step)
        return batch_size

    micro = train()
    torch.cuda.empty_cache()
    rate = setup.timed(lambda i: setup.fixed_step(micro, i), args.steps)
    return {"steps_to_converge": steps_run[0] - 2, "ooms": len(trials) - 1, "final_micro": micro,
            "tokens_per_s": rate, "trials": trials}


def run_lightning(args, setup):
    try:
        import lightning as L
        from lightning.pytorch.tuner import Tuner
    except ImportError:
        return {"skipped": "lightning is not installed"}
    torch = setup.torch

    class Data(torch.utils.data.Dataset):
        def __len__(self):
            return 100_000

        def __getitem__(self, i):
            return setup.batches[0][i % args.global_batch].cpu()

    class Module(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 2
            self.gpt = setup.model

        def train_dataloader(self):
            return torch.utils.data.DataLoader(Data(), batch_size=self.batch_size)

        def training_step(self, batch, batch_idx):
            return self.gpt.loss(batch)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=3e-4)

    module = Module()
    trainer = L.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=1, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    found = Tuner(trainer).scale_batch_size(module, mode="power", init_val=2, steps_per_trial=3, max_trials=25)
    found = min(found, args.global_batch)
    setup.model.cuda()  # the Trainer's teardown moved the module (and so the shared model) to the CPU
    powers = 0
    size = 2
    while size <= found:
        powers += 1
        size *= 2
    torch.cuda.empty_cache()
    rate = setup.timed(lambda i: setup.fixed_step(found, i), args.steps)
    # trials: every power of two from 2 up to the first failure, steps_per_trial steps each
    return {"steps_to_converge": 3 * (powers + 1), "ooms": 1 if found < args.global_batch else 0,
            "final_micro": found, "tokens_per_s": rate}


def run_sweep(args, setup):
    torch = setup.torch
    results = {}
    for micro in range(8, args.global_batch + 1, 8):
        failed = False
        try:
            rate = setup.timed(lambda i: setup.fixed_step(micro, i), max(5, args.steps // 3), warmup=2)
        except torch.OutOfMemoryError:
            failed = True
        if failed:
            setup.optimizer.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            results[micro] = None
            continue
        results[micro] = rate
    fitting = {m: r for m, r in results.items() if r is not None}
    best = max(fitting, key=fitting.get) if fitting else None
    return {"by_micro": results, "final_micro": best, "tokens_per_s": fitting.get(best)}


def run_forced_oom(args, setup):
    import torchmem
    torch = setup.torch
    ctl = torchmem.BatchSizeController(args.global_batch, model=setup.model, optimizer=setup.optimizer)
    for step in range(6):
        ctl.run(setup.loss, setup.batch(step))
        ctl.step()
    converged = ctl.state_dict()
    torch.cuda.synchronize()
    baseline = torchmem.memory_allocated()
    survived, drift = 0, []
    huge = torchmem.memory_stats().get("torchmem.limit_bytes", 0) or torch.cuda.get_device_properties(0).total_memory
    for i in range(100):
        ctl.load_state_dict(converged)
        state = {"forced": False}
        ooms = ctl.ooms

        def step_fn(ids):
            loss = setup.loss(ids)                   # activations are alive now
            if not state["forced"]:
                state["forced"] = True
                torch.empty(huge, dtype=torch.uint8, device="cuda")   # more than the budget: OOM
            return loss

        ctl.run(step_fn, setup.batch(i))
        ctl.step()
        survived += ctl.ooms - ooms
        torch.cuda.synchronize()
        drift.append(torchmem.memory_allocated() - baseline)
    return {"forced_ooms_survived": survived, "max_allocated_drift_bytes": max(drift),
            "final_allocated_drift_bytes": drift[-1]}


RUNNERS = {"torchmem": run_torchmem, "accelerate": run_accelerate, "lightning": run_lightning,
           "sweep": run_sweep, "forced_oom": run_forced_oom}


def child(args):
    import torch
    import torchmem
    torchmem.install(limit=args.limit)
    setup = Setup(args)
    start = time.perf_counter()
    result = RUNNERS[args.one](args, setup)
    result.update(method=args.one, limit=args.limit, global_batch=args.global_batch, seq=args.seq,
                  objective=args.objective,
                  wall_s=round(time.perf_counter() - start, 1), gpu=torch.cuda.get_device_name(0))
    print("RESULT " + json.dumps(result), flush=True)


def main(argv=None):
    args = parse_args(argv)
    if args.one:
        return child(args)
    import torch
    if not torch.cuda.is_available():
        print("batch_compare: no CUDA GPU here; run it on the GPU machine.")
        return 0
    results = {}
    for method in args.methods.split(","):
        command = [sys.executable, os.path.abspath(__file__), "--one", method, "--limit", args.limit,
                   "--global-batch", str(args.global_batch), "--seq", str(args.seq), "--steps", str(args.steps),
                   "--objective", args.objective]
        proc = subprocess.run(command, capture_output=True, text=True)
        lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            results[method] = {"method": method, "error": proc.stderr[-2000:]}
        else:
            results[method] = json.loads(lines[-1][len("RESULT "):])
        print(json.dumps(results[method]), flush=True)
        if args.out:
            append_jsonl(args.out, results[method])
    best = results.get("sweep", {}).get("tokens_per_s")
    print(f"\n{'method':<12}{'steps to converge':>18}{'OOMs':>6}{'final micro':>12}{'tokens/s':>12}{'vs best fixed':>14}")
    for method, r in results.items():
        if method == "forced_oom" or "tokens_per_s" not in r:
            continue
        ratio = f"{r['tokens_per_s'] / best:.3f}" if best and r.get("tokens_per_s") else "-"
        print(f"{method:<12}{str(r.get('steps_to_converge', '-')):>18}{str(r.get('ooms', '-')):>6}"
              f"{str(r.get('final_micro')):>12}{r['tokens_per_s'] or 0:>12.0f}{ratio:>14}")
    if "forced_oom" in results:
        print(f"forced OOMs: {results['forced_oom']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
