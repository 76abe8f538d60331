"""FSDP2 training of a Llama-style model under one allocator, one JSON line per rank.

    torchrun --standalone --nproc-per-node=2 bench/fsdp_workload.py --allocator torchmem --limit-frac 0.17 --controller
    torchrun --standalone --nproc-per-node=1 bench/fsdp_workload.py --allocator native --micro-batch 8
    python bench/fsdp_workload.py sweep --nproc 2 --limit-fracs 1.0 0.17 --out fsdp.jsonl   (every allocator, a table)
    python bench/fsdp_workload.py sweep --budgets 1.05 1.10 --micro-batch 8 --out fsdp.jsonl  (x the peak request)
    python bench/fsdp_workload.py sweep --budgets 1.05 --micro-batch 8 --fallback-micro-batches 4 2  (time per sample)

Why: people who outgrow one GPU train with FSDP2 (`fully_shard` per decoder
layer, bf16 MixedPrecisionPolicy), and torchmem must hold there what it holds on
one GPU: the same losses, less memory at a budget, no slower steps. The model is
transformers' LlamaForCausalLM built from a LlamaConfig (random weights, seeded:
nothing is downloaded), the data synthetic tokens seeded by step and rank, so
every allocator trains the same steps on the same numbers and their losses can
be compared. Each rank sees one GPU (LOCAL_RANK picks it).

--allocator native | expandable (PyTorch's, expandable_segments:True) | torchmem;
--limit-frac F: the budget as a fraction of the device (torchmem.install(limit=F),
torch.cuda.set_per_process_memory_fraction(F) for PyTorch's); --controller: the
BatchSizeController picks the micro-batch on every rank (grad_sync="none":
FSDP2 reduce-scatters the gradients in each backward itself), else
--micro-batch is fixed and every micro-step but the last runs without gradient
sync (set_requires_gradient_sync). --device cpu runs it over gloo on the CPU
(bench/tests/test_fsdp_workload.py), where only native applies.
Each rank prints one JSON line: step times, peak memory, driver calls
(num_device_alloc/free; torchmem's backend calls, reclaims, barriers and step
plan counters under torchmem, and each step's maps, unmaps and barriers),
the micro-batch per step and the losses. `sweep` runs torchrun once per
allocator and budget, one after the other, and prints a table with each run's
losses against native's at the same budget. Its budgets are fractions of the
device (--limit-fracs) or multiples of the workload's own peak request
(--budgets, for a fixed --micro-batch: a native run without a limit measures
the peak first), the regime where an allocator's packing decides what fits. With
--fallback-micro-batches, a run that runs out of memory runs again at smaller
micro-batches until one fits, and the sweep prints torchmem's time per sample
at its micro-batch against each other allocator's at its own largest: where
only torchmem fits the larger micro-batch, that is the comparison a user makes.
"""

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time

from common import set_native_conf  # bench/common.py, beside this file

ALLOCATORS = ("native", "expandable", "torchmem")


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--allocator", choices=ALLOCATORS, default="torchmem")
    parser.add_argument("--limit-frac", type=float, default=None, help="budget as a fraction of the device (0, 1]")
    parser.add_argument("--controller", action="store_true", help="BatchSizeController picks the micro-batch")
    parser.add_argument("--micro-batch", type=int, default=None,
                        help="fixed micro-batch (default: the whole local batch); the controller's first size")
    parser.add_argument("--global-batch", type=int, default=32, help="sequences per optimizer step over all ranks")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the median step time")
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=None, help="attention heads (default: hidden / 128)")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--timeout-s", type=int, default=300, help="collective timeout: a hang becomes an error")
    parser.add_argument("--trace", default=None, metavar="PICKLE",
                        help="record torch's memory history over the steps (rank 0) and dump the snapshot here "
                             "(`python -m torchmem convert` makes it a trace for `replay`)")
    args = parser.parse_args(argv)
    if args.limit_frac is not None and not 0.0 < args.limit_frac <= 1.0:
        parser.error(f"--limit-frac must be in (0, 1], got {args.limit_frac}")
    if args.device == "cpu" and args.allocator != "native":
        parser.error("--device cpu runs PyTorch's CPU allocator only: --allocator native")
    return args


def _prepare_environment(args):
    """Before torch is imported: the allocator's settings and a one-process rendezvous when
    torchrun did not start us."""
    if args.allocator == "expandable":
        set_native_conf(args.allocator)
    if "RANK" not in os.environ:
        import socket

        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def build_model(args, torch):
    from transformers import LlamaConfig, LlamaForCausalLM

    heads = args.heads or max(1, args.hidden // 128)
    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=heads,
                         intermediate_size=256 * ((8 * args.hidden // 3 + 255) // 256),
                         max_position_embeddings=args.seq, tie_word_embeddings=False)
    torch.manual_seed(0)  # the same weights on every rank and under every allocator
    return LlamaForCausalLM(config)


def shard(model, torch):
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def tokens(args, step, rank, local, device, torch):
    generator = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randint(0, args.vocab, (local, args.seq), generator=generator).to(device)


def counters(args, torch):
    """Driver calls and OOMs: torch's keys for every allocator, torchmem's own under torchmem."""
    if args.device != "cuda":
        return {}
    stats = torch.cuda.memory_stats()
    out = {k: stats[k] for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_ooms",
                                      "num_sync_all_streams")
           if k in stats}
    if args.allocator == "torchmem":
        import torchmem

        mine = torchmem.memory_stats()
        out.update({k: v for k, v in mine.items() if k.startswith(TORCHMEM_COUNTER_PREFIXES)
                    or (k.startswith("torchmem.backend.") and k.endswith("_calls"))})
    return out


# torchmem's own counters worth a line per run: reclaims, barriers and the step plan's life
TORCHMEM_COUNTER_PREFIXES = ("torchmem.num_reclaims", "torchmem.num_plan",
                             "torchmem.plan_pass_us")
# per step, the deltas of these (torchmem only): the driver calls and barriers a warm step should not make
STEP_KEYS = ("torchmem.backend.map_calls", "torchmem.backend.unmap_calls", "num_sync_all_streams")


def train(args):
    _prepare_environment(args)
    import torch

    # 1.0 is the sweep's "unconstrained": no limit at all, since torchmem grows differently
    # under any limit (docs/config.md, run_below_limit)
    limit = args.limit_frac if args.limit_frac is not None and args.limit_frac < 1.0 else None
    if args.allocator == "torchmem":
        import torchmem

        torchmem.install(limit=limit)  # before anything touches CUDA
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.device == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count())
        torch.cuda.set_device(device)
        if limit is not None and args.allocator != "torchmem":
            torch.cuda.set_per_process_memory_fraction(limit, device)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=args.timeout_s))
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_s))
    if args.global_batch % world:
        raise SystemExit(f"fsdp_workload: --global-batch {args.global_batch} is not divisible by {world} ranks")
    local = args.global_batch // world

    model = build_model(args, torch)
    n_params = sum(p.numel() for p in model.parameters())
    model = shard(model.to(device), torch)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)

    def micro_loss(ids):
        return model(input_ids=ids, labels=ids).loss

    ctl = None
    if args.controller:
        import torchmem

        ctl = torchmem.BatchSizeController(args.global_batch, model=model, optimizer=optimizer, grad_sync="none",
                                           micro_batch=args.micro_batch)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    report = {"rank": rank, "world": world, "allocator": args.allocator, "limit_frac": args.limit_frac,
              "controller": args.controller, "global_batch": args.global_batch, "seq": args.seq,
              "layers": args.layers, "hidden": args.hidden, "params": n_params, "torch": torch.__version__,
              "step_s": [], "losses": [], "micro_batches": [], "oom": None}
    if args.trace and rank == 0:
        torch.cuda.memory._record_memory_history(max_entries=5_000_000, context=None, stacks="python")
    last = counters(args, torch)
    try:
        for step in range(args.steps):
            batch = tokens(args, step, rank, local, device, torch)
            sync()
            start = time.perf_counter()
            if ctl is not None:
                loss = ctl.run(micro_loss, batch)
                ctl.step()
                micro = ctl.micro_batch
            else:
                micro = min(args.micro_batch or local, local)
                parts = batch.split(micro)
                loss = torch.zeros((), device=device)
                for i, part in enumerate(parts):
                    model.set_requires_gradient_sync(i == len(parts) - 1)
                    part_loss = micro_loss(part) * (part.shape[0] / local)
                    part_loss.backward()
                    loss += part_loss.detach().float()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            sync()
            report["step_s"].append(time.perf_counter() - start)
            mean = loss.detach().float().clone()
            dist.all_reduce(mean)  # the global batch's loss, the same number on every rank
            report["losses"].append(mean.item() / world)
            report["micro_batches"].append(micro)
            now = counters(args, torch)
            if args.allocator == "torchmem":
                report.setdefault("step_calls", []).append([now.get(k, 0) - last.get(k, 0) for k in STEP_KEYS])
            last = now
    except torch.OutOfMemoryError as exc:
        report["oom"] = str(exc).splitlines()[0][:300]
    if args.trace and rank == 0:
        torch.cuda.memory._dump_snapshot(args.trace)
        torch.cuda.memory._record_memory_history(enabled=None)
    steady = report["step_s"][args.warmup:] or report["step_s"]
    report["median_step_s"] = statistics.median(steady) if steady else None
    report["tokens_per_s"] = args.global_batch * args.seq / report["median_step_s"] if steady else None
    if ctl is not None:
        report["ooms_recovered"] = ctl.ooms
    if device.type == "cuda":
        report["peak_allocated"] = torch.cuda.max_memory_allocated(device)
        report["peak_reserved"] = torch.cuda.max_memory_reserved(device)
        report["device_total"] = torch.cuda.get_device_properties(device).total_memory
    report["counters"] = counters(args, torch)
    print(json.dumps(report), flush=True)
    if report["oom"] is not None:
        os._exit(3)  # the other ranks wait in a collective: torchrun stops them when one exits non-zero
    dist.destroy_process_group()
    # Leave without running C++ static destructors: gloo's threads, still winding
    # down, have aborted the interpreter's exit now and then ("terminate called
    # without an active exception") after a run that had reported in full.
    sys.stderr.flush()
    os._exit(0)


def sweep(argv):
    parser = argparse.ArgumentParser(prog="fsdp_workload.py sweep", allow_abbrev=False,
                                     description="every allocator and budget in turn; one JSON line per rank and run")
    parser.add_argument("--nproc", type=int, default=1)
    parser.add_argument("--allocators", nargs="+", choices=ALLOCATORS, default=list(ALLOCATORS))
    parser.add_argument("--limit-fracs", nargs="+", type=float, default=[],
                        help="budgets as fractions of the device (1.0: no limit); default 1.0 without --budgets")
    parser.add_argument("--budgets", nargs="+", type=float, default=[],
                        help="budgets as multiples of the workload's own peak request, which a native run "
                             "without a limit measures first (max_memory_allocated, the largest rank's)")
    parser.add_argument("--out", default="fsdp_workload.jsonl")
    parser.add_argument("--timeout-s", type=int, default=1200, help="per run")
    parser.add_argument("--fallback-micro-batches", nargs="+", type=int, default=[], metavar="M",
                        help="where a run runs out of memory, run that allocator at that budget again at each of "
                             "these micro-batches in turn until one fits: its own largest, whose time per sample "
                             "the table sets beside the others' (the global batch stays, so a step is the same "
                             "samples in more micro-steps)")
    args, rest = parser.parse_known_args(argv)
    if not args.limit_fracs and not args.budgets:
        args.limit_fracs = [1.0]
    runs = []
    with open(args.out, "a") as out:
        def run_once(label, frac, allocator, extra=()):
            cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
                   os.path.abspath(__file__), "--allocator", allocator, "--limit-frac", f"{frac:.6f}",
                   *rest, *extra]  # argparse takes the last --micro-batch given
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout_s)
            reports = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
            for report in reports:
                out.write(json.dumps(dict(report, returncode=proc.returncode, budget=label)) + "\n")
            if not reports:
                print(f"{allocator} at {label}: exit {proc.returncode}, no report\n{proc.stderr[-3000:]}",
                      file=sys.stderr)
            runs.append((label, allocator, sorted(reports, key=lambda r: r["rank"])))
            return reports

        def run(label, frac, allocator):
            reports = run_once(label, frac, allocator)
            for micro in args.fallback_micro_batches:
                if not reports or fitted(reports):
                    break  # it fits, or it failed for a reason a smaller micro-batch does not cure
                reports = run_once(label, frac, allocator, ["--micro-batch", str(micro)])
            return reports

        for frac in args.limit_fracs:
            for allocator in args.allocators:
                run(f"{frac:g}", frac, allocator)
        if args.budgets:
            fracs = budget_fractions(run_once("peak", 1.0, "native"), args.budgets)
            for budget, frac in zip(args.budgets, fracs):
                for allocator in args.allocators:
                    run(f"{budget:g}x", frac, allocator)
    print(table(runs))
    for line in per_sample_lines(runs):
        print(line)
    return 0


def budget_fractions(peak_reports, budgets):
    """Each budget (a multiple of the peak request) as a fraction of the device: the largest
    rank's max_memory_allocated times the budget, over the device's memory."""
    if not peak_reports or any(r.get("oom") for r in peak_reports):
        raise SystemExit("fsdp_workload sweep: the native run without a limit gave no peak request "
                         "(no report or an OOM): pick a smaller --micro-batch or model")
    peak = max(r["peak_allocated"] for r in peak_reports)
    total = peak_reports[0]["device_total"]
    fracs = [min(1.0, b * peak / total) for b in budgets]
    print("peak request " + f"{peak / 2**30:.2f} GiB of {total / 2**30:.1f} GiB; budgets "
          + ", ".join(f"{b:g}x = {f:.4f} of the device" for b, f in zip(budgets, fracs)), flush=True)
    return fracs


def table(runs):
    """One line per run: step time, tokens/s, micro-batches, peak memory per rank, driver calls,
    and the largest relative loss difference against native at the same budget."""
    native = {label: reports for label, allocator, reports in runs if allocator == "native" and reports}
    lines = [f"{'budget':>6} {'allocator':>10} {'step s':>7} {'tok/s':>8} {'micro':>8} "
             f"{'peak reserved GiB/rank':>24} {'dev alloc':>9} {'OOM':>4} {'loss vs native':>14}"]
    for label, allocator, reports in runs:
        if not reports:
            lines.append(f"{label:>6} {allocator:>10}  (no report)")
            continue
        r0 = reports[0]
        peaks = "/".join(f"{r.get('peak_reserved', 0) / 2**30:.2f}" for r in reports)
        diff = "-"
        base = native.get(label)
        if base and allocator != "native" and base[0]["losses"] and r0["losses"]:
            pairs = list(zip(base[0]["losses"], r0["losses"]))
            diff = f"{max(abs(a - b) / max(abs(a), 1e-9) for a, b in pairs):.2e}"
        micro = sorted(set(r0["micro_batches"][-3:])) if r0["micro_batches"] else "-"
        step = f"{r0['median_step_s']:.3f}" if r0.get("median_step_s") else "-"
        tps = f"{r0['tokens_per_s']:.0f}" if r0.get("tokens_per_s") else "-"
        oom = "yes" if any(r["oom"] for r in reports) else "no"
        lines.append(f"{label:>6} {allocator:>10} {step:>7} {tps:>8} {str(micro):>8} {peaks:>24} "
                     f"{r0['counters'].get('num_device_alloc', '-'):>9} {oom:>4} {diff:>14}")
    return "\n".join(lines)


def fitted(reports):
    """Every rank reported and none ran out of memory."""
    return bool(reports) and not any(r.get("oom") for r in reports)


def per_sample_lines(runs):
    """Where torchmem runs a larger micro-batch at a budget than another allocator fits there
    (--fallback-micro-batches), its time per sample against that allocator's at its own largest."""
    largest = {}  # (budget, allocator) -> (micro-batch, seconds per sample) of the last run that fit
    for label, allocator, reports in runs:
        if fitted(reports) and reports[0].get("median_step_s"):
            r0 = reports[0]
            largest[(label, allocator)] = (max(r0["micro_batches"]), r0["median_step_s"] / r0["global_batch"])
    lines = []
    for (label, allocator), (micro, per_sample) in largest.items():
        if allocator != "torchmem":
            continue
        for (other_label, other), (other_micro, other_per_sample) in largest.items():
            if other_label == label and other != "torchmem" and other_micro < micro:
                lines.append(f"{label}: torchmem at micro-batch {micro} {per_sample * 1e3:.2f} ms/sample, "
                             f"{other} at its largest that fits, {other_micro}, {other_per_sample * 1e3:.2f} "
                             f"ms/sample: {per_sample / other_per_sample:.3f}x")
    return lines


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["sweep"]:
        return sweep(argv[1:])
    return train(parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
