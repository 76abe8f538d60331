"""Why test_cuda.py's test_grad_scaler_with_preset_grad_scale can fail under any
allocator: a race in the test's use of GradScaler, shown here natively.

The test scales a CPU tensor (`scaler.scale(torch.ones(5))`), so the scale lives
on the CPU. GradScaler.step then computes
    found_inf = sum(t.to(scaler.device, non_blocking=True) for t in found_inf_per_device)
i.e. a device-to-host copy with non_blocking=True, which torch makes into
pinned memory and does not wait for, and sum() reads that memory on the CPU at
once. If the GPU is still busy, the CPU reads whatever the recycled pinned block
held before; anything non-zero means "inf found", the fused optimizer skips its
step, and the gradient stays 15 instead of 1: the failure seen in the peer suite
(BENCHMARKS.md sections 6 and 18, under torchmem, whose first allocations after
an empty_cache() make a test's first steps slower).

This script runs the test's body in a loop, with and without the two conditions:
a busy GPU (matmuls queued just before step) and a pinned block left holding a
non-zero value (a pinned tensor of the same size freed just before). With
--torchmem it installs torchmem first. Prints one JSON line.

    python tools/gradscaler_race.py [--torchmem] [--iters 40]
"""

import argparse
import json
import sys


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--torchmem", action="store_true", help="torchmem.install() first")
    parser.add_argument("--iters", type=int, default=40)
    args = parser.parse_args(argv)
    import torch
    if args.torchmem:
        import torchmem
        torchmem.install()
    if not torch.cuda.is_available():
        print("gradscaler_race: no CUDA GPU here", file=sys.stderr)
        return 2
    busy_input = torch.randn(8192, 8192, device="cuda")

    def one(busy, stale):
        weight = torch.ones((5, 5), device="cuda", requires_grad=True)
        weight.grad = torch.full_like(weight, fill_value=15)
        opt = torch.optim.Adam([weight], lr=0.1, fused=True)
        scaler = torch.amp.GradScaler(init_scale=5)
        scaler.scale(torch.ones(5))
        opt.grad_scale = torch.Tensor([3]).cuda()
        if stale:  # a pinned block of found_inf's size, freed holding 7.0: the cache hands it out next
            torch.full((), 7.0).pin_memory()
        if busy:
            for _ in range(4):
                busy_input @ busy_input
        scaler.step(opt)
        return torch.equal(weight.grad, torch.full_like(weight, fill_value=1))

    failures = {}
    for busy in (False, True):
        for stale in (False, True):
            failed = sum(not one(busy, stale) for _ in range(args.iters))
            failures[f"busy={busy},stale={stale}"] = failed
    torch.cuda.synchronize()
    print(json.dumps({"allocator": "torchmem" if args.torchmem else "native", "iters": args.iters,
                      "failures": failures}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
