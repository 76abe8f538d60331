"""Three training processes on one GPU whose memory demand shifts over time, under elastic
sharing (torchmem share=GROUP) vs static fractions, in one call.

    python bench/share_scenario.py --out share_scenario.json
    python bench/share_scenario.py --modes elastic,static --phase-s 20 --width 1024
    python bench/share_scenario.py --width 2048 --layers 24 --heavy-seq 12288 --heavy-batch 8 --offload-auto

The first is compute-bound: a static third already holds micro-batches that
keep the GPU busy, so elastic can at best tie the static split there. The
second gives the heavy phase long sequences that a third of the card cannot
hold at micro-batch 1 (a long-context phase): a static process must offload,
an elastic one borrows.

The script: the run is cut into phases of --phase-s seconds; in phase k process
k % 3 is "heavy" (it trains on --heavy-batch sequences per step) and the
other two are "light" (--light-batch per step). Every process trains a GPT
(examples/tiny_gpt.py, bf16 autocast, AdamW) with a BatchSizeController, which
splits each batch into the largest micro-batches that fit its budget. Modes:
  elastic          torchmem installed with share=scenario,guarantee=1/3 each: a
                   heavy process borrows what the light ones leave, owners
                   take it back (the controller's budget is the arbiter's grant)
  static           PyTorch's allocator, set_per_process_memory_fraction(1/3)
  static_torchmem  torchmem with limit=1/3 (the same split under torchmem's pool)
  elastic_granules elastic with run_below_limit=0: a driver handle per granule under
                   the moving limit (with share the default is 0.5, Note [Runs under
                   a limit])
  static_torchmem_runs
                   static_torchmem with run_below_limit=0.5: growth by one driver handle
                   per run in the bottom half of the limit
                   (the last two are not in the default --modes)
Reported per mode (JSON to --out, a table on stdout):
  crashes          processes that died (an OOM nobody recovered from)
  samples_per_s    total throughput: samples trained by all three / wall time
  ooms_recovered   OOMs the controllers recovered from (a retry of one batch)
  return_wait_s    elastic only: how long owners' allocations waited for
                   borrowers to give memory back (max, median, count)
  micro_heavy      median micro-batch of the heavy process in each phase
Each process prints "ready" once its model is built, then waits for the start
time the parent sends to all three, so the phases line up; then one JSON line.
"""

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ("elastic", "static", "static_torchmem")
# opt-in: run_below_limit other than the default (Note [Runs under a limit])
RUN_MODES = {"elastic_granules": 0.0, "static_torchmem_runs": 0.5}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--phase-s", type=float, default=20.0, help="seconds per phase (3 phases, one heavy each)")
    p.add_argument("--heavy-batch", type=int, default=256, help="sequences per step of the heavy process")
    p.add_argument("--light-batch", type=int, default=8, help="sequences per step of a light process")
    p.add_argument("--width", type=int, default=1024)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--heavy-seq", type=int, default=None,
                   help="sequence length of the heavy phase (default: --seq); a long-context phase that a "
                        "static share cannot hold at micro-batch 1 is where memory, not compute, limits")
    p.add_argument("--offload-auto", action="store_true",
                   help="BatchSizeController(offload='auto') in every mode: a process whose smallest "
                        "micro-batch does not fit offloads activations instead of crashing")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--mode", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    bad = [m for m in args.modes.split(",") if m not in MODES + tuple(RUN_MODES)]
    if bad:
        p.error(f"unknown mode(s) {bad}; choose from {', '.join(MODES + tuple(RUN_MODES))}")
    return args


def worker(args):
    """One training process: prints one JSON line with what it did."""
    import torch

    rank, mode = args.worker, args.mode
    share = 1.0 / 3.0
    runs = {"run_below_limit": RUN_MODES[mode]} if mode in RUN_MODES else {}
    if mode.startswith("elastic"):
        import torchmem
        torchmem.install(share="scenario", guarantee=share * 0.98, **runs)
    elif mode.startswith("static_torchmem"):
        import torchmem
        torchmem.install(limit=share * 0.98, **runs)
    else:
        torch.cuda.set_per_process_memory_fraction(share * 0.98)
    import torchmem
    from torchmem import monitor
    sys.path.insert(0, os.path.join(ROOT, "examples"))
    from tiny_gpt import GPT, GPTConfig, synthetic_tokens

    heavy_seq = args.heavy_seq or args.seq
    cfg = GPTConfig(vocab=8192, seq=max(args.seq, heavy_seq), width=args.width, layers=args.layers,
                    heads=max(1, args.width // 64))
    light_data, heavy_data = dataclasses.replace(cfg, seq=args.seq), dataclasses.replace(cfg, seq=heavy_seq)
    torch.manual_seed(rank)
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    ctl = torchmem.BatchSizeController(args.heavy_batch, model=model, optimizer=opt,
                                       offload="auto" if args.offload_auto else None)
    gen = torch.Generator().manual_seed(rank)

    def loss_fn(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return model.loss(ids)

    # Ready: tell the parent, then wait for the start time it writes once all three are ready.
    print("ready", flush=True)
    start_at = float(sys.stdin.readline())
    args.start_at = start_at
    while time.time() < start_at:
        time.sleep(0.01)
    end = args.start_at + 3 * args.phase_s
    samples, tokens, steps, micro_by_phase, crashed = 0, 0, 0, {0: [], 1: [], 2: []}, None
    slow_steps = []  # steps that took over a second: where a stall went (time, seconds, heavy, micro, OOMs so far)
    try:
        while (now := time.time()) < end:
            phase = int((now - args.start_at) // args.phase_s)
            heavy = phase % 3 == rank
            batch = synthetic_tokens(args.heavy_batch if heavy else args.light_batch,
                                     heavy_data if heavy else light_data, gen, "cuda")
            ctl.run(loss_fn, batch)
            ctl.step()  # optimizer.step() and zero_grad
            samples += batch.shape[0]
            tokens += batch.shape[0] * (batch.shape[1] - 1)
            steps += 1
            took = time.time() - now
            if took > 1.0:
                slow_steps.append([round(now - args.start_at, 2), round(took, 2), heavy, ctl.micro_batch, ctl.ooms])
            if heavy:
                micro_by_phase[phase].append(ctl.micro_batch)
    except Exception as exc:  # a crash: what the scenario counts
        crashed = f"{type(exc).__name__}: {str(exc)[:300]}"
    torch.cuda.synchronize()
    wall = max(time.time(), end) - args.start_at
    waits, levers = [], {}
    pub = monitor.publisher() if mode.startswith("elastic") else None
    if pub is not None and pub.agent is not None:
        waits = [seconds for seconds, _ in pub.agent.waits]
        levers = dict(pub.agent.counts)
    pool = {}
    if mode != "static":  # what the pool did meanwhile: driver calls and cache releases
        pool = {k: v for k, v in torchmem.memory_stats().items()
                if k.startswith("torchmem.backend.") or k in ("torchmem.num_reclaims", "torchmem.num_cache_releases")}
    print(json.dumps({"rank": rank, "mode": mode, "samples": samples, "tokens": tokens, "steps": steps, "wall_s": wall, "pool": pool,
                      "share_levers": levers, "slow_steps": slow_steps,
                      "ooms_recovered": ctl.ooms, "crashed": crashed, "waits_s": waits,
                      "micro_heavy": {str(k): (statistics.median(v) if v else None) for k, v in micro_by_phase.items()}}),
          flush=True)
    return 0


def run_mode(args, mode):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.pop("TORCHMEM_CONF", None)
    procs = [subprocess.Popen([sys.executable, os.path.abspath(__file__), "--worker", str(rank), "--mode", mode,
                               "--phase-s", str(args.phase_s),
                               "--heavy-batch", str(args.heavy_batch), "--light-batch", str(args.light_batch),
                               "--width", str(args.width), "--layers", str(args.layers), "--seq", str(args.seq)]
                              + (["--heavy-seq", str(args.heavy_seq)] if args.heavy_seq else [])
                              + (["--offload-auto"] if args.offload_auto else []),
                              cwd=ROOT, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
             for rank in range(3)]
    # One start time for all three, once each has imported torch and built its model (a
    # process that died before "ready" is reported below like any crash).
    for proc in procs:
        while (line := proc.stdout.readline()) and line.strip() != "ready":
            pass
    start_at = time.time() + 1.0
    for proc in procs:
        try:
            proc.stdin.write(f"{start_at}\n")
            proc.stdin.flush()
        except OSError:
            pass
    results = []
    for rank, proc in enumerate(procs):
        out, err = proc.communicate()
        lines = [line for line in out.splitlines() if line.startswith("{")]
        if proc.returncode != 0 or not lines:
            last_error = err.strip().splitlines()[-1] if err.strip() else ""
            results.append({"rank": rank, "mode": mode, "samples": 0, "crashed": f"exit {proc.returncode}: {last_error}",
                            "waits_s": [], "ooms_recovered": 0, "wall_s": 3 * args.phase_s, "micro_heavy": {}})
        else:
            results.append(json.loads(lines[-1]))
    wall = max(r["wall_s"] for r in results)
    waits = [w for r in results for w in r["waits_s"]]
    return {
        "mode": mode,
        "crashes": sum(1 for r in results if r["crashed"]),
        "samples_per_s": sum(r["samples"] for r in results) / wall,
        "tokens_per_s": sum(r.get("tokens", 0) for r in results) / wall,
        "ooms_recovered": sum(r["ooms_recovered"] for r in results),
        "return_wait_s": {"max": max(waits), "median": statistics.median(waits), "count": len(waits)} if waits else None,
        "micro_heavy": {str(r["rank"]): r["micro_heavy"].get(str(r["rank"])) for r in results},
        "processes": results,
    }


def main(argv=None):
    args = parse_args(argv)
    if args.worker is not None:
        return worker(args)
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench/share_scenario.py needs a CUDA GPU")
    report = {"device": torch.cuda.get_device_name(0), "phase_s": args.phase_s, "heavy_batch": args.heavy_batch,
              "light_batch": args.light_batch, "offload_auto": args.offload_auto,
              "model": {"width": args.width, "layers": args.layers, "seq": args.seq,
                        "heavy_seq": args.heavy_seq or args.seq},
              "modes": []}
    for mode in args.modes.split(","):
        result = run_mode(args, mode)
        report["modes"].append(result)
        wait = result["return_wait_s"]
        wait_text = "-" if wait is None else f"max {wait['max']:.3f} s, median {wait['median']:.3f} s"
        print(f"{mode:16} crashes={result['crashes']} samples/s={result['samples_per_s']:.1f} "
              f"tokens/s={result['tokens_per_s']:.0f} "
              f"ooms_recovered={result['ooms_recovered']} heavy micro={result['micro_heavy']} "
              f"return wait: {wait_text}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
