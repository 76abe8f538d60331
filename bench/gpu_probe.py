"""Times the CUDA backends' driver calls on this GPU, for BENCHMARKS.md:
cuMemAddressReserve, cuMemCreate, cuMemMap + cuMemSetAccess (first time on a
range, and again), cuMemUnmap, cuMemRelease, cudaMalloc / cudaFree (2 MiB,
20 MiB, 1 GiB), event record / query, and one free + allocate pair through
torchmem's own allocation path (C++, no torch wrapper: compare with the churn
microbenchmark to see what torch's CUDAPluggableAllocator adds).

    python bench/gpu_probe.py [--device 0] [--repeats 20] [--granules 1 16] [--out probe.json]
                              [--live-granules 5000] [--evict-mib 64]

--live-granules and --evict-mib add runs of one granule per call in the conditions of a training
process (Note [Probe conditions], csrc/shim/diagnostics.cpp): that many granules mapped meanwhile,
that much host memory walked before each timed call, and both. The first run of one granule with
neither is the one `replay --costs` and `lockstep.py table --costs` read.

The timing loop is C++ (torchmem.runtime.probe.driver_costs) on fresh backends,
outside any pool, so the figures are the driver's, not torchmem's policy's.
torchmem is NOT installed as the allocator here; the probe needs no torch tensors.
"""

import argparse
import json
import sys

from common import environment  # bench/common.py, beside this file


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--granules", type=int, nargs="+", default=[1, 16],
                        help="granules per map/unmap call (one run each)")
    parser.add_argument("--live-granules", type=int, default=0,
                        help="also time one granule per call with this many granules mapped meanwhile")
    parser.add_argument("--evict-mib", type=int, default=0,
                        help="also time one granule per call after walking this much host memory before each call")
    parser.add_argument("--out", help="write the figures as JSON here")
    args = parser.parse_args(argv)
    if args.live_granules < 0 or args.evict_mib < 0:
        parser.error(f"--live-granules ({args.live_granules}) and --evict-mib ({args.evict_mib}) must be 0 or more")

    import torch
    from torchmem.runtime import probe

    if not torch.cuda.is_available():
        print("gpu_probe: no CUDA GPU here", file=sys.stderr)
        return 2
    torch.cuda.init()
    result = {**environment(torch, args.device), "runs": []}
    evict = args.evict_mib << 20
    runs = [(granules, 0, 0) for granules in args.granules]
    runs += [(1, live, bytes_) for live, bytes_ in ((args.live_granules, 0), (0, evict), (args.live_granules, evict))
             if live or bytes_]
    for granules, live, bytes_ in dict.fromkeys(runs):
        figures = probe.driver_costs(args.device, args.repeats, granules, live_granules=live, evict_bytes=bytes_)
        result["runs"].append(figures)
        conditions = f", {live} granules mapped meanwhile" if live else ""
        conditions += f", {bytes_ >> 20} MiB of host memory walked before each call" if bytes_ else ""
        print(f"-- {granules} granule(s) per map/unmap call{conditions}, mean of {args.repeats}")
        for name, value in figures.items():
            per = ""
            if name.endswith("_per_call") and granules > 1:
                per = f"   ({value / granules:.2f} us per granule)"
            print(f"{name:40s} {value:12.2f}{per}")
    pair_ns = probe.allocation_pair_ns(args.device, 200_000)
    result["shim_pair_ns"] = pair_ns
    print(f"{'torchmem free+allocate pair (C++, ns)':40s} {pair_ns:12.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
