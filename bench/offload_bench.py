"""Activation offload on GPT-2 124M (GPT2Config, seq 1024, bf16 autocast) or a
Llama-style model (LlamaConfig, 8 layers of width 1024, --model llama), for
BENCHMARKS.md: step time and peak memory of
  - no offload;
  - torchmem.offload_activations at a budget (--keep fractions of the saved
    activations kept on the device; 0 moves everything eligible);
  - torch.autograd.graph.save_on_cpu(pin_memory=True).
No offload and the keep fractions are measured in --rounds rounds (order rotated
each round, --steps timed steps per row and round); a row's step is the median
of all its timed steps, round_step_ms its per-round medians, and an offload
row's vs_none_by_round its ratio to the no-offload steps of the same round
(a process's speed drifts by more than the effect measured: BENCHMARKS.md, Host memory
and offload).
save_on_cpu, 5-8x slower, is measured once, after the rounds.
Goals: >= 3x faster than save_on_cpu at the same peak, and <= 1.5x the no-offload
step when less than half of the activations move.

Each offload row also gets a PCIe lower bound on its step (pcie_bound): to bring
the peak down by R = peak(none) - peak(row) bytes, R bytes must have crossed
PCIe device-to-host before the peak, the end of the forward pass at the
earliest, so that forward cannot end sooner than R / d2h:
    bound    = t_none + max(0, R / d2h - t_fwd)
The moved bytes M come back host-to-device, and backward needs them; adding
    estimate = bound + max(0, M / h2d - t_bwd)
is an estimate, not a bound (data whose room the peak does not need may come
back before backward starts). t_fwd / t_bwd / t_opt are medians of no-offload
steps that synchronize after the forward and after backward (extra steps, so
the "none" row itself stays unsynchronized); d2h / h2d are the best of 3 copies
of 1 GiB between a CUDA tensor and a pinned CPU tensor, in this process.
save_on_cpu's M is taken as the eligible saved bytes of torchmem's measuring
step (it moves at least those). JSON: top-level t_fwd_ms, t_bwd_ms, t_opt_ms,
d2h_gbps, h2d_gbps (GB/s, 1e9 bytes/s); per offload row bound_ms, estimate_ms,
step_over_bound, lowered_bytes, estimate_moved_bytes, and the row's own synchronized
split t_fwd_ms, t_bwd_ms, t_opt_ms (extra steps, after the timed ones).

    python bench/offload_bench.py [--model gpt2|llama] [--batch 8] [--keep 0 0.5] [--steps 6] [--rounds 3] [--out offload.json]
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
from common import environment  # noqa: E402  (bench/common.py, beside this file)

GiB = 1 << 30


def pcie_bound(t_none, t_fwd, t_bwd, lowered_bytes, moved_bytes, d2h, h2d):
    """The PCIe lower bound on an offload step and the two-sided estimate, in
    seconds. t_none, t_fwd, t_bwd: the no-offload step, its forward and its
    backward (s); lowered_bytes: how far the row's peak is below no offload's
    (<= 0: not lowered, nothing had to leave); moved_bytes: what came back for
    backward; d2h, h2d: pinned copy bandwidths (bytes/s). No torch here."""
    if d2h <= 0 or h2d <= 0:
        raise ValueError("bandwidths must be positive")
    bound = t_none + max(0.0, max(0, lowered_bytes) / d2h - t_fwd)
    estimate = bound + max(0.0, max(0, moved_bytes) / h2d - t_bwd)
    return bound, estimate


def bound_fields(row, none_row, split, bw, moved_bytes):
    """The per-row JSON fields of the bound: row and none_row have step_s and
    peak_bytes; split has t_fwd_s and t_bwd_s; bw has d2h and h2d (bytes/s)."""
    lowered = none_row["peak_bytes"] - row["peak_bytes"]
    bound, estimate = pcie_bound(none_row["step_s"], split["t_fwd_s"], split["t_bwd_s"],
                                 lowered, moved_bytes, bw["d2h"], bw["h2d"])
    return {"bound_ms": bound * 1e3, "estimate_ms": estimate * 1e3, "step_over_bound": row["step_s"] / bound,
            "lowered_bytes": lowered, "estimate_moved_bytes": moved_bytes}


def bound_text(fields):
    """What the summary line appends for the bound (no ';': the log is joined on it)."""
    return (f"   bound {fields['bound_ms']:.1f} ms (x{fields['step_over_bound']:.2f})"
            f", estimate {fields['estimate_ms']:.1f} ms")


def build_model(torch, name, seq):
    """GPT-2 124M (GPT2Config) or the Llama-style model (8 layers of width 1024), on the GPU."""
    torch.manual_seed(0)
    if name == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel
        model = GPT2LMHeadModel(GPT2Config(n_positions=seq))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM
        model = LlamaForCausalLM(LlamaConfig(
            vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
            num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=seq))
    model = model.cuda()
    model.config.use_cache = False
    return model


def pinned_bandwidth(torch, nbytes=GiB, repeats=3):
    """Device-to-host and host-to-device bytes/s of one non_blocking copy of
    nbytes between a CUDA tensor and a pinned CPU tensor, best of `repeats`
    after one warm-up copy each way."""
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def best(dst, src):
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        return nbytes / min(times)

    d2h = best(host, dev)
    h2d = best(dev, host)
    del dev, host
    torch.cuda.empty_cache()
    return {"d2h": d2h, "h2d": h2d}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="gpt2")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--keep", type=float, nargs="+", default=[0.0, 0.5, 0.75],
                        help="fractions of the measured saved bytes kept on the device")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per mode and round (after 2 warm-up steps)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds over no offload and the keep fractions, order rotated each round")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch

    if not torch.cuda.is_available():
        print("offload_bench: no CUDA GPU here", file=sys.stderr)
        return 2
    import torchmem
    bw = pinned_bandwidth(torch)  # before the model: the 1 GiB on the device is free again
    print(f"pcie pinned copy 1 GiB: d2h {bw['d2h'] / 1e9:.1f} GB/s, h2d {bw['h2d'] / 1e9:.1f} GB/s", flush=True)
    model = build_model(torch, args.model, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step(ctx, marks=None):
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        if marks is not None:  # the forward / backward split: synchronize at each end
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        loss.backward()
        if marks is not None:
            torch.cuda.synchronize()
            marks.append(time.perf_counter())
        opt.step()
        opt.zero_grad(set_to_none=True)

    def split_steps(make_ctx=contextlib.nullcontext):
        """Medians of the forward, backward and optimizer step (s) under make_ctx(), over
        args.steps extra steps that synchronize between them (the model is warm)."""
        fwd, bwd, rest = [], [], []
        for _ in range(args.steps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            marks = []
            step(make_ctx(), marks)
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            fwd.append(marks[0] - t0)
            bwd.append(marks[1] - marks[0])
            rest.append(t3 - marks[1])
        return {"t_fwd_s": statistics.median(fwd), "t_bwd_s": statistics.median(bwd),
                "t_opt_s": statistics.median(rest)}

    def timed_steps(make_ctx):
        """Two warm-up steps, then args.steps timed ones: (step seconds, peak allocated bytes)."""
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
        return times, torch.cuda.max_memory_allocated()

    def summary_line(row):
        spread = ""
        if len(row.get("round_step_ms", ())) > 1:
            spread = f" ({min(row['round_step_ms']):.1f}-{max(row['round_step_ms']):.1f})"
        return (f"{row['mode']:28s} step {row['step_s'] * 1e3:8.1f} ms{spread}   peak {row['peak_bytes'] / 2**30:6.2f} GiB"
                + (f"   moved {row['moved_bytes'] / 2**30:.2f} of {row['saved_bytes'] / 2**30:.2f} GiB"
                   if "moved_bytes" in row else "")
                + (bound_text(row) if "bound_ms" in row else ""))

    offload = torchmem.offload_activations(None)
    step(offload)  # the measuring step
    saved = offload.last_step["saved_bytes"]

    # No offload and every keep fraction, measured in rounds whose order rotates: a process's
    # speed drifts (BENCHMARKS.md, How to reproduce), so each row's neighbours change from round to
    # round and each round's ratio to "none" compares steps taken minutes, not processes, apart.
    modes = [("none", None)] + [(f"torchmem keep {keep:.2f}", keep) for keep in args.keep]
    times = {name: [] for name, _ in modes}
    round_ms = {name: [] for name, _ in modes}
    peaks = {name: 0 for name, _ in modes}
    moved = {}
    for r in range(args.rounds):
        for name, keep in modes[r % len(modes):] + modes[:r % len(modes)]:
            if keep is None:
                ts, peak = timed_steps(contextlib.nullcontext)
            else:
                offload.set_budget(int(keep * saved))
                ts, peak = timed_steps(lambda: offload)
                moved[name] = {"moved_bytes": offload.last_step["offloaded_bytes"],
                               "saved_bytes": offload.last_step["saved_bytes"], "keep": keep}
            times[name] += ts
            round_ms[name].append(statistics.median(ts) * 1e3)
            peaks[name] = max(peaks[name], peak)

    rows = []
    for name, keep in modes:
        row = {"mode": name, "step_s": statistics.median(times[name]), "peak_bytes": peaks[name],
               "round_step_ms": round_ms[name]}
        row.update(moved.get(name, {}))
        rows.append(row)
    split = split_steps()
    print(f"no offload split: forward {split['t_fwd_s'] * 1e3:.1f} ms, backward {split['t_bwd_s'] * 1e3:.1f} ms,"
          f" optimizer {split['t_opt_s'] * 1e3:.1f} ms", flush=True)
    print(summary_line(rows[0]), flush=True)
    for row in rows[1:]:
        row.update(bound_fields(row, rows[0], split, bw, row["moved_bytes"]))
        row["vs_none_by_round"] = [t / n for t, n in zip(row["round_step_ms"], rows[0]["round_step_ms"])]
        print(summary_line(row), flush=True)
        # where the row's time goes: its own synchronized forward / backward split (extra steps)
        offload.set_budget(int(row["keep"] * saved))
        own = split_steps(lambda: offload)
        row.update({"t_fwd_ms": own["t_fwd_s"] * 1e3, "t_bwd_ms": own["t_bwd_s"] * 1e3,
                    "t_opt_ms": own["t_opt_s"] * 1e3})
        print(f"{'':28s} synchronized split: forward {own['t_fwd_s'] * 1e3:.1f} ms,"
              f" backward {own['t_bwd_s'] * 1e3:.1f} ms, optimizer {own['t_opt_s'] * 1e3:.1f} ms;"
              f" x none by round: {', '.join(f'{x:.2f}' for x in row['vs_none_by_round'])}", flush=True)
    soc_times, soc_peak = timed_steps(lambda: torch.autograd.graph.save_on_cpu(pin_memory=True))
    soc_row = {"mode": "save_on_cpu(pin_memory=True)", "step_s": statistics.median(soc_times),
               "peak_bytes": soc_peak}
    soc_row.update(bound_fields(soc_row, rows[0], split, bw, saved))  # it moves at least the eligible bytes
    rows.append(soc_row)
    print(summary_line(soc_row), flush=True)
    base = rows[0]["step_s"]
    soc = rows[-1]
    for row in rows:
        row["vs_none"] = row["step_s"] / base
        row["save_on_cpu_over_this"] = soc["step_s"] / row["step_s"]
    result = {**environment(torch), "model": args.model,
              "batch": args.batch,
              "seq": args.seq, "rounds": args.rounds, "steps": args.steps, "rows": rows, "host_pool": torchmem.host.stats(),
              "t_fwd_ms": split["t_fwd_s"] * 1e3, "t_bwd_ms": split["t_bwd_s"] * 1e3,
              "t_opt_ms": split["t_opt_s"] * 1e3,
              "d2h_gbps": bw["d2h"] / 1e9, "h2d_gbps": bw["h2d"] / 1e9}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
