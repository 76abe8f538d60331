"""Batch-size choice against a hand sweep, under one budget: is the controller's
steady throughput at least 0.98x the best fixed micro-batch?

    python bench/batch_sweep.py --out sweep.jsonl --table sweep.md      # both models, ~7 min on an H200
    python bench/batch_sweep.py --models gpt2 --allocators torchmem --methods sweep,throughput
    python bench/batch_sweep.py --smoke --out smoke.jsonl               # tiny models on the CPU: plumbing only
    python bench/batch_sweep.py --from sweep.jsonl --table sweep.md     # the tables of runs made before

For each model (gpt2: HF GPT-2 124M, seq 512, bf16 autocast, budget
--gpt2-budget 16GiB; llama: a ~0.5B LlamaConfig under FSDP2 on one rank, bf16
MixedPrecisionPolicy, budget --llama-budget 24GiB; bench/batch_sweep_child.py
has the details) and each allocator (torchmem: torchmem.install(limit=budget);
native: torch.cuda.set_per_process_memory_fraction(budget / total)), one
process per method, at a global batch of 64:

  sweep       every fixed micro-batch of --grid (6, 8, ..., 64; larger ones
              stop after two sizes in a row run out of memory), split
              [m, m, ..., rest] as a fixed micro-batch runs; --warmup untimed
              and --steps timed steps each, the cache emptied between sizes
  throughput  BatchSizeController(objective="throughput") from a cold start:
              --settle-steps steps, then --steps timed ones
  largest     the same with objective="largest" (the largest size that fits)
  accelerate  gpt2 only: accelerate.utils.find_executable_batch_size, 3 steps
              a trial, restarting on each OOM, then --steps timed steps
  lightning   gpt2 only: Tuner.scale_batch_size(mode="power", init_val=2,
              steps_per_trial=3), then --steps timed steps at the size found

Each child prints one RESULT line; here they become JSON lines (--out) and
Markdown tables (--table, and stdout): per method the micro-batch it settled
on (for the sweep: the best), the steps it took to settle (the step after
which the micro-batch no longer changed, trials and restarts included), the
OOMs on the way, steady samples/s (global batch / median synchronized step)
and the ratio to the best fixed micro-batch of either allocator's sweep of the
same model; then samples/s of every fixed size under both allocators.

Time with the defaults on an H200 (estimates from the step times seen so far,
to be replaced by measurements): gpt2 ~3.6 min (two sweeps ~40 s each, four
controller runs ~20 s each, Accelerate ~25 s, Lightning ~30 s), llama ~3.5 min
(two sweeps ~50 s each, four controller runs ~28 s each): ~7 min in all, a
third of it process start-up (imports, model build, CUDA context: ~15 s a
process). Run the models as two calls to stay clear of a 10-minute limit;
--grid 8:64:4, --steps 4 or --methods cut it further.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from common import append_jsonl  # bench/common.py, beside this file

HERE = os.path.dirname(os.path.abspath(__file__))
METHODS = ("sweep", "throughput", "largest", "accelerate", "lightning")
GPT2_ONLY = ("accelerate", "lightning")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--allocators", default="torchmem,native")
    parser.add_argument("--methods", default=",".join(METHODS))
    parser.add_argument("--gpt2-budget", default="16GiB")
    parser.add_argument("--llama-budget", default="24GiB")
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--grid", default="6:64:2")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--settle-steps", type=int, default=10)
    parser.add_argument("--timeout-s", type=int, default=300, help="per child process")
    parser.add_argument("--out", default=None, help="append JSON lines here")
    parser.add_argument("--table", default=None, help="write the Markdown tables here")
    parser.add_argument("--smoke", action="store_true", help="tiny models on the CPU, a size limit as budget")
    parser.add_argument("--from", dest="from_file", default=None,
                        help="run nothing: the tables of the JSON lines in this file (e.g. two calls' --out)")
    args = parser.parse_args(argv)
    if args.smoke:  # 3 of 8 samples fit (batch_sweep_child.py --smoke-fit)
        args.global_batch, args.seq = min(args.global_batch, 8), min(args.seq, 16)
        args.grid = "1:8:1" if args.grid == "6:64:2" else args.grid
        args.steps, args.warmup, args.settle_steps = min(args.steps, 2), min(args.warmup, 1), min(args.settle_steps, 6)
    return args


def jobs(args):
    for model in args.models.split(","):
        for allocator in args.allocators.split(","):
            for method in args.methods.split(","):
                if method in GPT2_ONLY and model != "gpt2":
                    continue
                yield model, allocator, method


def run_children(args, batch):
    """Runs the (model, allocator, method) jobs of `batch` in one child process; a
    result (or an error) for each."""
    spec = ",".join(f"{m}:{a}:{k}:{args.gpt2_budget if m == 'gpt2' else args.llama_budget}" for m, a, k in batch)
    command = [sys.executable, os.path.join(HERE, "batch_sweep_child.py"), "--jobs", spec,
               "--global-batch", str(args.global_batch), "--seq", str(args.seq), "--grid", args.grid,
               "--warmup", str(args.warmup), "--steps", str(args.steps), "--settle-steps", str(args.settle_steps)]
    if args.smoke:
        command.append("--smoke")
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, capture_output=True, text=True, timeout=args.timeout_s * len(batch))
        output, error = proc.stdout, (proc.stderr or proc.stdout)[-3000:]
    except subprocess.TimeoutExpired as exc:
        output, error = exc.stdout or "", f"timed out ({args.timeout_s} s a job)"
        output = output.decode() if isinstance(output, bytes) else output
    done = [json.loads(line[len("RESULT "):]) for line in output.splitlines() if line.startswith("RESULT ")]
    for result in done:
        result["process_s"] = round(time.perf_counter() - start, 1)
    return done + [{"model": m, "allocator": a, "method": k, "error": error} for m, a, k in batch[len(done):]]


def best_fixed(results, model):
    """(samples/s, allocator, micro) of the best fixed micro-batch of either sweep of `model`."""
    best = None
    for r in results:
        if r.get("model") == model and r.get("method") == "sweep" and r.get("samples_per_s"):
            if best is None or r["samples_per_s"] > best[0]:
                best = (r["samples_per_s"], r["allocator"], r["micro"])
    return best


def tables(results):
    """The Markdown tables: one row per (model, allocator, method), then the sweeps by size."""
    out = ["| model | allocator | method | micro-batch | micro-steps | steps to settle | OOMs | samples/s | vs best fixed |",
           "|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        best = best_fixed(results, r["model"])
        if "error" in r or "skipped" in r:
            out.append(f"| {r['model']} | {r['allocator']} | {r['method']} | "
                       f"{'skipped: ' + r['skipped'] if 'skipped' in r else 'failed (see JSON)'} | | | | | |")
            continue
        rate = r.get("samples_per_s")
        ratio = f"{rate / best[0]:.3f}" if rate and best else "-"
        micro = r.get("micro")
        steps = r.get("micro_steps") or (-(-r["global_batch"] // micro) if micro else "-")
        settle = "-" if r["method"] == "sweep" else r.get("steps_to_settle", "-")
        label = "best fixed" if r["method"] == "sweep" else r["method"]
        out.append(f"| {r['model']} | {r['allocator']} | {label} | {micro} | {steps} | {settle} | {r.get('ooms', '-')} "
                   f"| {rate or 0:.1f} | {ratio} |")
    sweeps = [r for r in results if r.get("method") == "sweep" and "by_micro" in r]
    if sweeps:
        sizes = sorted({int(m) for r in sweeps for m in r["by_micro"]})
        out += ["", "| model | allocator | " + " | ".join(str(m) for m in sizes) + " |",
                "|---|---|" + "---|" * len(sizes)]
        for r in sweeps:
            cells = []
            for m in sizes:
                value = r["by_micro"].get(str(m), "")
                cells.append("OOM" if value is None else ("" if value == "" else f"{value:.1f}"))
            out.append(f"| {r['model']} | {r['allocator']} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


def main(argv=None):
    args = parse_args(argv)
    if args.from_file:
        with open(args.from_file) as f:
            text = tables([json.loads(line) for line in f if line.strip()])
        print(text)
        if args.table:
            with open(args.table, "w") as f:
                f.write(text)
        return 0
    if not args.smoke:
        import torch
        if not torch.cuda.is_available():
            print("batch_sweep: no CUDA GPU here; run it on the GPU machine (or --smoke for the plumbing).")
            return 0
    results, start = [], time.perf_counter()
    todo = list(jobs(args))
    # one process a job (an allocator is chosen once per process); on the CPU one for all
    for batch in ([todo] if args.smoke else [[job] for job in todo]):
        for result in run_children(args, batch):
            results.append(result)
            line = json.dumps(result)
            print(line if "error" not in result else
                  f"FAILED {result['model']}/{result['allocator']}/{result['method']}: {result['error'][-800:]}",
                  flush=True)
            if args.out:
                append_jsonl(args.out, result)
    text = tables(results) + f"\n{len(results)} runs in {time.perf_counter() - start:.0f} s\n"
    print("\n" + text)
    if args.table:
        with open(args.table, "w") as f:
            f.write(text)
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
