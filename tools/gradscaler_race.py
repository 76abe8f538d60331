"""A test of one explanation for test_cuda.py's test_grad_scaler_with_preset_grad_scale
failing once under torchmem in the peer suite: the explanation did not hold on
the H200.

The test scales a CPU tensor (`scaler.scale(torch.ones(5))`), so the scale lives
on the CPU, and GradScaler.step computes
    found_inf = sum(t.to(scaler.device, non_blocking=True) for t in found_inf_per_device)
a device-to-host copy with non_blocking=True followed by a CPU read. The
failure (the gradient left at 15: the fused optimizer saw "inf found" and
skipped its step) would follow if that read saw a recycled pinned block's old
contents before the copy landed. This script runs the test's body in a loop
with the two conditions that would make that happen, a busy GPU (matmuls queued
just before step) and a pinned block of found_inf's size freed holding 7.0, each
on and off, natively or (--torchmem) under torchmem.

On the H200: 0 failures in 160 runs under either allocator, so the peer
failure's cause is still open. Prints one JSON line.

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
