"""DDP on two GPUs with a different torchmem budget per rank: the ranks must
agree on the micro-batch every step, survive OOMs that only one rank hits,
and never hang.

    torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py
    torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py --limits 24GiB,12GiB --steps 30
    torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py --grad-sync ddp --micro-batch 16
    torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py --objective largest

Each rank sees only its own GPU (CUDA_VISIBLE_DEVICES is set from LOCAL_RANK
before torch is imported), installs torchmem with its own limit, wraps
GPT-2 small (examples/tiny_gpt.py) in DDP(broadcast_buffers=False) and trains
with BatchSizeController at a global batch of 64 per step over both ranks.
After each step the ranks gather their micro-batch (a check only, outside the
controller) and rank 0 prints a summary: micro-batches per step, OOMs per
rank, loss, tokens/s, and AGREED/DISAGREED; under --objective throughput (the
default) also the count of micro-steps the ranks settled on and why (their
step times are reduced with MAX in the agreement, so both choose alike). A collective timeout of
--timeout-s seconds turns a hang into an error. Exit status 0 only when the
ranks agreed on every step and the loss fell.
"""

import argparse
import datetime
import os
import sys
import time

LOCAL_RANK = int(os.environ.get("LOCAL_RANK", "0"))
os.environ.setdefault("CUDA_VISIBLE_DEVICES", str(LOCAL_RANK))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples"))


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limits", default="24GiB,12GiB", help="torchmem limit per rank, comma-separated")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--global-batch", type=int, default=64)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--grad-sync", default="auto", choices=("auto", "controller", "ddp"))
    parser.add_argument("--micro-batch", type=int, default=None, help="first micro-batch (default: whole local batch)")
    parser.add_argument("--objective", default="throughput", choices=("throughput", "largest"))
    parser.add_argument("--timeout-s", type=int, default=300)
    return parser.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    import torch
    import torch.distributed as dist
    import torchmem

    if "RANK" not in os.environ:
        print("ddp_batch: start it with torchrun --standalone --nproc_per_node=2 bench/ddp_batch.py")
        return 0
    if not torch.cuda.is_available():
        print("ddp_batch: no CUDA GPU here; run it on a machine with 2 GPUs.")
        return 0
    rank = int(os.environ["RANK"])
    limits = args.limits.split(",")
    limit = limits[rank % len(limits)]
    torchmem.install(limit=limit)
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=args.timeout_s))
    world = dist.get_world_size()

    from tiny_gpt import GPT, GPTConfig, synthetic_tokens
    cfg = GPTConfig(seq=args.seq)
    torch.manual_seed(0)
    net = GPT(cfg).cuda()
    model = torch.nn.parallel.DistributedDataParallel(net, broadcast_buffers=False)
    optimizer = torch.optim.AdamW(net.parameters(), lr=3e-4)
    ctl = torchmem.BatchSizeController(args.global_batch, model=model, optimizer=optimizer,
                                       grad_sync=args.grad_sync, micro_batch=args.micro_batch, verbose=rank == 0,
                                       objective=args.objective)
    generator = torch.Generator().manual_seed(100 + rank)
    local = args.global_batch // world

    def micro_step(ids):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids[:, :-1])
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(),
                                                 ids[:, 1:].reshape(-1))

    agreed_every_step = True
    micro_per_step, losses, times = [], [], []
    for step in range(args.steps):
        batch = synthetic_tokens(local, cfg, generator, "cuda")
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = ctl.run(micro_step, batch)
        ctl.step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        sizes = [None] * world
        dist.all_gather_object(sizes, ctl.micro_batch)
        agreed_every_step &= len(set(sizes)) == 1
        micro_per_step.append(sizes)
        losses.append(loss.item())
    ooms = [None] * world
    dist.all_gather_object(ooms, ctl.ooms)
    if rank == 0:
        steady = sorted(times[len(times) // 2:])[len(times[len(times) // 2:]) // 2]
        print("\nddp_batch summary")
        print(f"  limits per rank:     {limits[:world]}   grad_sync={ctl.grad_sync}")
        print(f"  micro per step:      {[s[0] if len(set(s)) == 1 else s for s in micro_per_step]}")
        print(f"  OOMs per rank:       {ooms}")
        print(f"  loss:                {losses[0]:.3f} -> {losses[-1]:.3f}")
        print(f"  tokens/s (median):   {args.global_batch * cfg.seq / steady:.0f}")
        settles = [e for e in ctl.events if e["event"] == "settle"]
        if settles:
            print(f"  settled (step {settles[-1]['step']}): {settles[-1]['reason']}")
        print(f"  ranks: {'AGREED' if agreed_every_step else 'DISAGREED'} on every step; no hang")
    dist.destroy_process_group()
    return 0 if agreed_every_step and losses[-1] < losses[0] else 1


if __name__ == "__main__":
    sys.exit(main())
