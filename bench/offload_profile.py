"""Where an offload step's time goes: torch.profiler over a few steps of the
model of bench/offload_bench.py, with no offload and with
torchmem.offload_activations at a budget, summarized per stream.

The offload bench gives step times and a PCIe bound; when a row is far above
its bound (a host-bound model such as the Llama one: BENCHMARKS.md, Host
memory and offload) this says
why: how long the compute stream sat idle and where (the kernels around each
gap and the host calls inside it), how busy each copy direction was, how much
host time the saved-tensor hooks took, and the allocator and synchronizing
runtime calls made during the step.

    python bench/offload_profile.py [--model llama|gpt2] [--keep 0.75] [--steps 2] [--out DIR]

DIR gets summary.json and the keep row's Chrome trace (trace_keep.json.gz).
"""

import argparse
import contextlib
import gzip
import json
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from offload_bench import build_model  # noqa: E402 (the same models)


def union_length(intervals):
    """Total length covered by (start, end) intervals."""
    total, reach = 0.0, None
    for lo, hi in sorted(intervals):
        if reach is None or lo > reach:
            total += hi - lo
            reach = hi
        elif hi > reach:
            total += hi - reach
            reach = hi
    return total


def summarize(events, window):
    """Per-stream busy time, compute-stream gaps and host-call totals of the
    Chrome-trace `events` inside `window` (ts_lo, ts_hi) in microseconds."""
    lo, hi = window
    inside = [e for e in events if e.get("ph") == "X" and lo <= e.get("ts", -1) <= hi]
    gpu = [e for e in inside if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    streams = {}
    for e in gpu:
        s = streams.setdefault(e["args"].get("stream"), {"kernels": 0, "copies_d2h": 0, "copies_h2d": 0, "iv": []})
        s["iv"].append((e["ts"], e["ts"] + e["dur"]))
        name = e.get("name", "")
        if e["cat"] == "gpu_memcpy":
            s["copies_d2h" if "DtoH" in name else "copies_h2d" if "HtoD" in name else "kernels"] += 1
        else:
            s["kernels"] += 1
    per_stream = {}
    for sid, s in streams.items():
        per_stream[str(sid)] = {"busy_ms": union_length(s["iv"]) / 1e3, "kernels": s["kernels"],
                                "d2h_copies": s["copies_d2h"], "h2d_copies": s["copies_h2d"],
                                "first_ms": (min(a for a, _ in s["iv"]) - lo) / 1e3,
                                "last_ms": (max(b for _, b in s["iv"]) - lo) / 1e3}
    # The compute stream: the one with the most kernels.
    compute = max(streams, key=lambda k: streams[k]["kernels"]) if streams else None
    gaps = []
    if compute is not None:
        seq = sorted((e for e in gpu if e["args"].get("stream") == compute), key=lambda e: e["ts"])
        for a, b in zip(seq, seq[1:]):
            gap = b["ts"] - (a["ts"] + a["dur"])
            if gap > 30:
                gaps.append((gap, a, b))
    host = [e for e in inside if e.get("cat") in ("cuda_runtime", "cuda_driver")]
    launch_of = {e["args"].get("correlation"): e for e in host if "correlation" in e.get("args", {})}
    # A gap whose next kernel was launched before the gap began waited on the GPU (an event:
    # a copy it needs); one launched during the gap waited for the host.
    waited_gpu = waited_host = 0.0
    for gap, a, b in gaps:
        launch = launch_of.get(b["args"].get("correlation"))
        if launch is not None and launch["ts"] + launch["dur"] <= a["ts"] + a["dur"]:
            waited_gpu += gap
        else:
            waited_host += gap
    gaps.sort(key=lambda g: -g[0])
    top = []
    for gap, a, b in gaps[:12]:
        g_lo, g_hi = a["ts"] + a["dur"], b["ts"]
        # host calls whose launch led to b (correlation) and the runtime calls overlapping the gap
        calls = {}
        for e in host:
            if e["ts"] < g_hi and e["ts"] + e["dur"] > g_lo - 2000:
                calls[e["name"]] = calls.get(e["name"], 0) + 1
        top.append({"gap_us": round(gap, 1), "at_ms": round((g_lo - lo) / 1e3, 2),
                    "before": a.get("name", "")[:80], "after": b.get("name", "")[:80],
                    "after_launched_ms": (round((launch_of[b["args"].get("correlation")]["ts"] - lo) / 1e3, 2)
                                          if b["args"].get("correlation") in launch_of else None),
                    "host_calls_near": dict(sorted(calls.items(), key=lambda kv: -kv[1])[:6])})
    runtime = {}
    for e in host:
        r = runtime.setdefault(e["name"], [0, 0.0])
        r[0] += 1
        r[1] += e["dur"] / 1e3
    user = {}
    for e in inside:
        if e.get("cat") == "user_annotation":
            u = user.setdefault(e["name"], [0, 0.0])
            u[0] += 1
            u[1] += e["dur"] / 1e3
    return {"window_ms": (hi - lo) / 1e3, "compute_stream": compute, "per_stream": per_stream,
            "compute_idle_ms": sum(g[0] for g in gaps) / 1e3, "compute_gaps_over_30us": len(gaps),
            "idle_waiting_gpu_ms": waited_gpu / 1e3, "idle_waiting_host_ms": waited_host / 1e3,
            "top_gaps": top,
            "runtime_calls": {k: {"count": v[0], "ms": round(v[1], 3)}
                              for k, v in sorted(runtime.items(), key=lambda kv: -kv[1][1])[:15]},
            "annotations": {k: {"count": v[0], "ms": round(v[1], 3)} for k, v in user.items()}}


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--keep", type=float, default=0.75)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--out", default=".")
    args = parser.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("offload_profile: no CUDA GPU here", file=sys.stderr)
        return 2
    import torchmem
    from torch.profiler import ProfilerActivity, profile, record_function

    model = build_model(torch, args.model, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step(ctx):
        with record_function("tm_forward"):
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids).loss
        with record_function("tm_backward"):
            loss.backward()
        with record_function("tm_optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)

    offload = torchmem.offload_activations(None)
    step(offload)  # the measuring step
    saved = offload.last_step["saved_bytes"]
    offload.set_budget(int(args.keep * saved))
    pack, unpack = offload.pack_hook, offload.unpack_hook  # torch's saved_tensors_hooks attributes

    def timed_pack(t):
        with record_function("tm_pack"):
            return pack(t)

    def timed_unpack(o):
        with record_function("tm_unpack"):
            return unpack(o)

    os.makedirs(args.out, exist_ok=True)
    summary = {"model": args.model, "batch": args.batch, "seq": args.seq, "keep": args.keep,
               "saved_bytes": saved, "rows": {}}
    for name, make_ctx in (("none", contextlib.nullcontext), ("keep", lambda: offload)):
        for _ in range(3):
            step(make_ctx())
        torch.cuda.synchronize()
        times = []
        for _ in range(4):
            t0 = time.perf_counter()
            step(make_ctx())
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        if name == "keep":  # the hooks are annotated only inside the profile
            offload.pack_hook, offload.unpack_hook = timed_pack, timed_unpack
        tmp = tempfile.mkdtemp()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.steps):
                with record_function("tm_step"):
                    step(make_ctx())
                torch.cuda.synchronize()
        path = os.path.join(tmp, "trace.json")
        prof.export_chrome_trace(path)
        events = json.load(open(path))["traceEvents"]
        steps = sorted((e for e in events if e.get("name") == "tm_step" and e.get("ph") == "X"), key=lambda e: e["ts"])
        last = steps[-1]
        row = summarize(events, (last["ts"], last["ts"] + last["dur"]))
        row["unprofiled_step_ms"] = sorted(times)[len(times) // 2] * 1e3
        row["last_step"] = offload.last_step if name == "keep" else None
        summary["rows"][name] = row
        if name == "keep":
            with open(path, "rb") as f, gzip.open(os.path.join(args.out, "trace_keep.json.gz"), "wb") as g:
                shutil.copyfileobj(f, g)
        shutil.rmtree(tmp, ignore_errors=True)
        print(f"{name}: step {row['unprofiled_step_ms']:.1f} ms (profiled window {row['window_ms']:.1f} ms), "
              f"compute idle {row['compute_idle_ms']:.1f} ms in {row['compute_gaps_over_30us']} gaps "
              f"(waiting on the GPU {row['idle_waiting_gpu_ms']:.1f}, on the host {row['idle_waiting_host_ms']:.1f})",
              flush=True)
    with open(os.path.join(args.out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    print(json.dumps(summary["rows"]["keep"], indent=1, default=str)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
