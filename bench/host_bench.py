"""The pinned host pool against torch's pinned allocator and pageable memory,
for BENCHMARKS.md, Host memory and offload (the goals, all measured in the same call):

1. copy bandwidth, host->device and device->host, from a torchmem.host buffer,
   a torch pinned tensor and a pageable tensor (goal: torchmem >= 98% of the
   best pinned figure);
2. fresh pinning of 1 GiB: a new torchmem pool's first 1 GiB block (mmap +
   huge pages + parallel touch + cudaHostRegister), with and without huge
   pages, vs torch.empty(..., pin_memory=True) after torch's host cache was
   emptied (goal: <= 0.35 s);
3. a cached request: allocate + free of a block already in the cache, and
   pinning a CPU tensor into a cached block, vs torch (goal: <= torch's):
   through torchmem.host's Python API, and through torch's own calls
   (torch.empty(pin_memory=True), tensor.pin_memory()) once the pool is
   torch's host allocator (measured in a child process: the swap is for life).

    python bench/host_bench.py [--sizes-mib 64 256 1024] [--repeats 10] [--out host.json]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

# This checkout's torchmem, not whichever one is installed.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from common import environment  # noqa: E402  (bench/common.py, beside this file)

MiB = 1 << 20


def bandwidth(torch, src, dst, repeats):
    """GB/s of dst.copy_(src, non_blocking=True), the median of `repeats` timed copies."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    rates = []
    for _ in range(repeats):
        start.record()
        dst.copy_(src, non_blocking=True)
        end.record()
        end.synchronize()
        rates.append(src.numel() * src.element_size() / (start.elapsed_time(end) / 1e3) / 1e9)
    return statistics.median(rates)


def copy_figures(torch, host, sizes, repeats):
    pool = host.HostPool(backend="cuda")
    rows = []
    for size in sizes:
        dev = torch.empty(size, dtype=torch.uint8, device="cuda")
        sources = {
            "torchmem": pool.empty(size, torch.uint8),
            "torch_pinned": torch.empty(size, dtype=torch.uint8, pin_memory=True),
            "pageable": torch.empty(size, dtype=torch.uint8),
        }
        for buf in sources.values():
            buf.fill_(1)
        row = {"bytes": size}
        for name, buf in sources.items():
            row[f"{name}_h2d_gbs"] = bandwidth(torch, buf, dev, repeats)
            row[f"{name}_d2h_gbs"] = bandwidth(torch, dev, buf, repeats)
        for way in ("h2d", "d2h"):
            best = max(row[f"torchmem_{way}_gbs"], row[f"torch_pinned_{way}_gbs"])
            row[f"torchmem_{way}_of_best"] = row[f"torchmem_{way}_gbs"] / best
        rows.append(row)
        print(f"copy {size // MiB:5d} MiB  H2D GB/s: torchmem {row['torchmem_h2d_gbs']:.1f}  "
              f"torch pinned {row['torch_pinned_h2d_gbs']:.1f}  pageable {row['pageable_h2d_gbs']:.1f} | "
              f"D2H: torchmem {row['torchmem_d2h_gbs']:.1f}  torch pinned {row['torch_pinned_d2h_gbs']:.1f}  "
              f"pageable {row['pageable_d2h_gbs']:.1f}", flush=True)
        del sources, dev
    del pool
    return rows


def fresh_pinning(torch, host, size, repeats):
    out = {}
    for label, huge in (("torchmem_thp", "thp"), ("torchmem_4k", "off")):
        times = []
        for _ in range(repeats):
            pool = host.HostPool(backend="cuda", huge_pages=huge)
            t0 = time.perf_counter()
            buf = pool.empty(size, torch.uint8)
            times.append(time.perf_counter() - t0)
            s = pool.stats()
            del buf, pool
        out[label] = {"seconds": statistics.median(times), "huge_page_bytes": s["huge_page_bytes"],
                      "pinned_bytes": s["pinned_bytes"], "numa_node": s["numa_node"], "thp_mode": s["thp_mode"]}
    times = []
    for _ in range(repeats):
        torch._C._host_emptyCache()
        t0 = time.perf_counter()
        buf = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        times.append(time.perf_counter() - t0)
        del buf
    torch._C._host_emptyCache()
    out["torch"] = {"seconds": statistics.median(times)}
    print(f"fresh pinning of {size / (1 << 30):.2f} GiB (median of {repeats}): torchmem THP "
          f"{out['torchmem_thp']['seconds']:.3f} s ({out['torchmem_thp']['huge_page_bytes'] // MiB} MiB on huge "
          f"pages), torchmem 4 KiB {out['torchmem_4k']['seconds']:.3f} s, torch {out['torch']['seconds']:.3f} s",
          flush=True)
    return out


def time_cases(cases, iters):
    """Microseconds per call of each case, after 10 calls that fill the cache."""
    out = {}
    for name, make in cases.items():
        for _ in range(10):
            make()
        t0 = time.perf_counter()
        for _ in range(iters):
            make()
        out[f"{name}_us"] = (time.perf_counter() - t0) / iters * 1e6
    return out


def torch_cases(torch, size):
    cpu = torch.ones(size, dtype=torch.uint8)
    return {"torch_empty": lambda: torch.empty(size, dtype=torch.uint8, pin_memory=True),
            "torch_pin": lambda: cpu.pin_memory()}


def routed_child(sizes, iters):
    """In a fresh process: torchmem's pool as torch's host allocator, then torch's own calls."""
    import torch
    from torchmem import host

    host.install_torch_host_allocator()
    torch.empty(1, device="cuda")
    pool = host.default_pool()
    rows = []
    for size in sizes:
        cases = torch_cases(torch, size)
        cases["torch_api_empty"] = lambda: pool.empty(size, torch.uint8)  # torchmem.host's API, routed
        rows.append(time_cases(cases, iters))
    assert host.default_pool().stats()["cache_hits"] > 0, "torch's pinned calls did not reach torchmem's pool"
    print(json.dumps(rows))
    return 0


def cached_latency(torch, host, sizes, iters):
    pool = host.HostPool(backend="cuda")
    rows = []
    for size in sizes:
        cpu = torch.ones(size, dtype=torch.uint8)
        row = {"bytes": size}
        row.update(time_cases({"torchmem_empty": lambda: pool.empty(size, torch.uint8),
                               "torchmem_pin": lambda: pool.pin(cpu)}, iters))
        row.update(time_cases(torch_cases(torch, size), iters))
        rows.append(row)
    child = subprocess.run([sys.executable, __file__, "--routed-child", "--latency-iters", str(iters),
                            "--latency-kib", *[str(size // 1024) for size in sizes]],
                           capture_output=True, text=True, timeout=300)
    if child.returncode != 0:
        print(f"routed child failed: {child.stderr[-2000:]}", file=sys.stderr)
        routed = [{} for _ in sizes]
    else:
        routed = json.loads(child.stdout.strip().splitlines()[-1])
    for row, via in zip(rows, routed):
        row.update({k.replace("torch_", "routed_", 1): v for k, v in via.items()})
        print(f"cached request {row['bytes'] // 1024:6d} KiB (us): empty torchmem {row['torchmem_empty_us']:.1f} "
              f"torch {row['torch_empty_us']:.1f} routed {row.get('routed_empty_us', float('nan')):.1f} "
              f"(API routed {row.get('routed_api_empty_us', float('nan')):.1f}) | "
              f"pin() torchmem {row['torchmem_pin_us']:.1f} torch {row['torch_pin_us']:.1f} "
              f"routed {row.get('routed_pin_us', float('nan')):.1f}", flush=True)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[64, 256, 1024])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--pin-gib", type=float, default=1.0)
    parser.add_argument("--pin-repeats", type=int, default=3)
    parser.add_argument("--latency-kib", type=int, nargs="+", default=[64, 1024, 16384])
    parser.add_argument("--latency-iters", type=int, default=200)
    parser.add_argument("--out", help="write the figures as JSON here")
    parser.add_argument("--routed-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.routed_child:
        return routed_child([k * 1024 for k in args.latency_kib], args.latency_iters)

    import torch
    from torchmem import host

    if not torch.cuda.is_available():
        print("host_bench: no CUDA GPU here", file=sys.stderr)
        return 2
    torch.empty(1, device="cuda")  # the context's start-up is not part of any figure
    result = {**environment(torch),
              "copies": copy_figures(torch, host, [s * MiB for s in args.sizes_mib], args.repeats),
              "fresh_pinning": fresh_pinning(torch, host, int(args.pin_gib * (1 << 30)), args.pin_repeats),
              "cached_request": cached_latency(torch, host, [k * 1024 for k in args.latency_kib], args.latency_iters)}
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
