"""Where an offload step's time goes, with CUDA events instead of a profiler:
the model of bench/offload_bench.py, unprofiled, with no offload and with
torchmem.offload_activations at budgets (--keep), timed on the GPU and the host.

bench/offload_profile.py runs torch.profiler, which more than doubles a
host-bound step's hook time (Llama: 87 ms unprofiled, 153 ms profiled), so its
split is not the split of a real step. Here
each step records timing events on the compute stream (start, end of forward,
end of backward, end of the optimizer step) next to the host clock at the same
points, and for each moved tensor: when forward saved it, when its copy out
ended, when its fetch was issued (host clock and compute stream position),
when the fetch ended, and when backward asked for it and could go on. From
these:
  - host-bound or not: the host's enqueue of forward/backward against the GPU's
    completion of it (a GPU end within a few hundred us of the host's means the
    GPU waited for the host);
  - the hooks' host time (pack, unpack: perf_counter around the hooks);
  - saves of a storage the step saved before (the offloader's count: Note
    [Shared storages]);
  - the copies out: first save to last end (effective GB/s);
  - the fetches: first issue, last end, and the stall backward took waiting
    for them (sum over moved tensors of resume - need on the compute stream).
keep 1.0 runs the hooks with nothing moved: their cost alone. Each row also has
the time Python's cyclic garbage collector ran during the step (gc.callbacks),
and --host-profile adds cProfile's own-time table for 3 steps at the last keep.

    python bench/offload_timeline.py [--model llama|gpt2] [--keep 1.0 0.75] [--steps 3] [--out timeline.json]
"""

import argparse
import cProfile
import gc
import io
import pstats
import contextlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from common import environment  # noqa: E402  (bench/common.py)
from offload_bench import build_model  # noqa: E402 (the same models)

MS = 1e3


def summarize_moved(records, t_fwd_end):
    """Figures of one step's moved tensors; each record holds ms since the step's
    start: save, out_end, fetch_issue_gpu, fetch_issue_host, in_end, need, resume
    (None where it did not happen), bytes and urgent. No torch here."""
    if not records:
        return {"moved": 0}
    out_ends = [r["out_end"] for r in records]
    fetched = [r for r in records if r.get("in_end") is not None]
    stalls = [max(0.0, r["resume"] - r["need"]) for r in records if r.get("need") is not None]
    moved_bytes = sum(r["bytes"] for r in records)
    first_save = min(r["save"] for r in records)
    out_span = max(out_ends) - first_save
    return {
        "moved": len(records),
        "moved_bytes": moved_bytes,
        "first_save_ms": first_save,
        "last_out_end_ms": max(out_ends),
        "out_gbps": moved_bytes / (out_span / MS) / 1e9 if out_span > 0 else None,
        "out_done_at_fwd_end": sum(r["bytes"] for r in records if r["out_end"] <= t_fwd_end),
        "first_fetch_issue_host_ms": min((r["fetch_issue_host"] for r in fetched), default=None),
        "first_fetch_issue_gpu_ms": min((r["fetch_issue_gpu"] for r in fetched), default=None),
        "last_in_end_ms": max((r["in_end"] for r in fetched), default=None),
        "urgent": sum(1 for r in fetched if r["urgent"]),
        "first_need_ms": min((r["need"] for r in records if r.get("need") is not None), default=None),
        "stall_ms": sum(stalls),
        "stalled": sum(1 for s in stalls if s > 0.05),
    }


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", choices=("gpt2", "llama"), default="llama")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--keep", type=float, nargs="+", default=[1.0, 0.75])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per mode (after 2 warm-up steps)")
    parser.add_argument("--host-profile", action="store_true",
                        help="then cProfile 3 steps at the last --keep: the host calls' own times")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)

    import torch
    if not torch.cuda.is_available():
        print("offload_timeline: no CUDA GPU here", file=sys.stderr)
        return 2
    from torchmem.host.offload import OffloadActivations

    compute = torch.cuda.current_stream()  # the benches never change it

    def event():
        # On the compute stream given, not looked up: torch.cuda.current_stream() costs tens of us
        # of host time (cProfile), which this bench would add to the step.
        e = torch.cuda.Event(enable_timing=True)
        e.record(compute)
        return e

    class TimedOffload(OffloadActivations):
        """Records, for each moved tensor, events and host times (see the module's text): the
        offloader's observer for the moved tensors, perf_counter around its hooks."""

        def __init__(self, *a, **kw):
            super().__init__(*a, observer=self.observe, **kw)
            self.records = {}  # id(OffloadedTensor) -> events and host times
            self.hook_s = {"pack": 0.0, "unpack": 0.0}
            pack, unpack = self.pack_hook, self.unpack_hook  # torch's saved_tensors_hooks attributes

            def timed_pack(t):
                h0 = time.perf_counter()
                out = pack(t)
                self.hook_s["pack"] += time.perf_counter() - h0
                return out

            def timed_unpack(obj):
                h0 = time.perf_counter()
                out = unpack(obj)
                self.hook_s["unpack"] += time.perf_counter() - h0
                return out

            self.pack_hook, self.unpack_hook = timed_pack, timed_unpack

        def observe(self, what, h, stream):
            if what == "out":  # a new copy, not a shared save
                out_end = torch.cuda.Event(enable_timing=True)
                out_end.record(stream)
                self.records[id(h)] = {"bytes": h.nbytes, "save": event(), "out_end": out_end,
                                       "what": f"{str(h.dtype)[6:]}{list(h.shape)}"}
                return
            rec = self.records.get(id(h))
            if rec is None:
                return
            if what in ("in", "urgent"):
                in_end = torch.cuda.Event(enable_timing=True)
                in_end.record(stream)
                rec.update(fetch_issue_host=time.perf_counter(), fetch_issue_gpu=event(), in_end=in_end,
                           urgent=what == "urgent")
            elif what == "need":
                rec["need"] = event()
            elif what == "used":
                rec["resume"] = event()

    model = build_model(torch, args.model, args.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, model.config.vocab_size, (args.batch, args.seq), device="cuda")

    def step(ctx, marks):
        """One step; marks gets (name, gpu event, host seconds) at each phase end."""
        with ctx:
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(input_ids=ids, labels=ids).loss
        marks.append(("fwd", event(), time.perf_counter()))
        loss.backward()
        marks.append(("bwd", event(), time.perf_counter()))
        opt.step()
        opt.zero_grad(set_to_none=True)
        marks.append(("opt", event(), time.perf_counter()))

    gc_time = {"s": 0.0, "count": 0, "t0": None}

    def on_gc(phase, info):
        # Python's cyclic collector runs inside whatever allocates the object that trips it:
        # a hook, a module's forward. Its pauses are host time a host-bound step pays for.
        if phase == "start":
            gc_time["t0"] = time.perf_counter()
        elif gc_time["t0"] is not None:
            gc_time["s"] += time.perf_counter() - gc_time["t0"]
            gc_time["count"] += 1
            gc_time["t0"] = None

    gc.callbacks.append(on_gc)

    def timed_step(ctx, offload):
        gc_time.update(s=0.0, count=0, t0=None)
        if offload is not None:
            offload.records = {}
            offload.hook_s = {"pack": 0.0, "unpack": 0.0}
        torch.cuda.synchronize()
        start, h_start = event(), time.perf_counter()
        marks = []
        step(ctx, marks)
        torch.cuda.synchronize()
        h_end = time.perf_counter()
        row = {"wall_ms": (h_end - h_start) * MS, "gc_ms": gc_time["s"] * MS, "gc_runs": gc_time["count"]}
        for name, ev, host in marks:
            row[f"gpu_{name}_ms"] = start.elapsed_time(ev)
            row[f"host_{name}_ms"] = (host - h_start) * MS
        if offload is not None:
            row["pack_host_ms"] = offload.hook_s["pack"] * MS
            row["unpack_host_ms"] = offload.hook_s["unpack"] * MS
            # the offloader's own count: a later save of a storage counts 0 (Note [Shared storages])
            row["saves_of_a_shared_storage"] = offload.last_step["shared_saves"]
            records = []
            for rec in offload.records.values():
                r = {"bytes": rec["bytes"], "urgent": rec.get("urgent", False), "what": rec["what"]}
                for key in ("save", "out_end", "fetch_issue_gpu", "in_end", "need", "resume"):
                    r[key] = start.elapsed_time(rec[key]) if key in rec else None
                r["fetch_issue_host"] = ((rec["fetch_issue_host"] - h_start) * MS
                                         if "fetch_issue_host" in rec else None)
                records.append(r)
            row.update(summarize_moved(records, row["gpu_fwd_ms"]))
            row["moved_tensors"] = records
            offload.records = {}
        return row

    offload = TimedOffload(None)
    step(offload, [])  # the measuring step
    saved = offload.last_step["saved_bytes"]
    modes = [("none", None)] + [(f"keep {k:.2f}", k) for k in args.keep]
    result = {**environment(torch), "model": args.model,
              "batch": args.batch, "seq": args.seq, "saved_bytes": saved, "modes": {}}
    for name, keep in modes:
        if keep is not None:
            offload.set_budget(int(keep * saved))
        ctx_of = (lambda: contextlib.nullcontext()) if keep is None else (lambda: offload)
        for _ in range(2):
            step(ctx_of(), [])
        rows = [timed_step(ctx_of(), offload if keep is not None else None) for _ in range(args.steps)]
        med = {k: statistics.median(r[k] for r in rows) for k in rows[0]
               if all(isinstance(r.get(k), (int, float)) for r in rows)}
        result["modes"][name] = {"median": med, "steps": rows}
        line = (f"{name:10s} wall {med['wall_ms']:6.1f} ms | gc {med['gc_ms']:4.1f} ms | gpu fwd/bwd/opt end {med['gpu_fwd_ms']:6.1f}"
                f" {med['gpu_bwd_ms']:6.1f} {med['gpu_opt_ms']:6.1f} | host fwd/bwd/opt {med['host_fwd_ms']:6.1f}"
                f" {med['host_bwd_ms']:6.1f} {med['host_opt_ms']:6.1f}")
        if keep is not None:
            line += (f" | hooks pack {med['pack_host_ms']:.1f} unpack {med['unpack_host_ms']:.1f} ms"
                     f" | {med['saves_of_a_shared_storage']:.0f} saves of a shared storage")
            if med.get("moved"):
                line += (f" | moved {med['moved']:.0f} ({med['moved_bytes'] / 2**30:.2f} GiB), out by fwd end"
                         f" {med['out_done_at_fwd_end'] / 2**30:.2f} GiB, last out {med['last_out_end_ms']:.1f},"
                         f" first fetch host/gpu {med.get('first_fetch_issue_host_ms', float('nan')):.1f}"
                         f"/{med.get('first_fetch_issue_gpu_ms', float('nan')):.1f}, last in"
                         f" {med.get('last_in_end_ms', float('nan')):.1f}, first need"
                         f" {med.get('first_need_ms', float('nan')):.1f}, stall {med['stall_ms']:.1f} ms"
                         f" ({med['stalled']:.0f} tensors, {med['urgent']:.0f} urgent)")
        print(line, flush=True)
    if args.host_profile:
        offload.set_budget(int(args.keep[-1] * saved))
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(3):
            step(offload, [])
        torch.cuda.synchronize()
        profiler.disable()
        text = io.StringIO()
        pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
        result["host_profile"] = text.getvalue()
        print(f"cProfile, 3 steps at keep {args.keep[-1]:.2f}, by own time:")
        print(text.getvalue())
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1, default=str)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
