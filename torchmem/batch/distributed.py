"""What the batch-size controller needs from torch.distributed: one agreement
collective per attempt, and a gradient average for models not wrapped in DDP.

Note [One collective, two answers]
Ranks must agree on two things: the micro-batch of the next attempt (the
smallest any rank can afford: MIN) and whether any rank hit OOM in this attempt
(MAX). Both fit in one all_reduce with op MAX over [-proposal, oom_flag],
because max(-x) = -min(x). One small collective per attempt is cheap next to a
gradient all-reduce, and it happens at the same point of the step on every rank
(the controller places it), so a rank that stopped early on OOM and a rank that
finished meet there instead of in different collectives.

Note [Averaging gradients ourselves]
DDP's reducer all-reduces gradients inside backward, so an OOM in one rank's
final backward leaves the other ranks blocked in that all-reduce: the agreement
cannot run after it. With grad_sync="controller" the model is NOT wrapped in
DDP; every micro-step runs locally, the agreement runs after all backward
passes, and only then are gradients averaged, in flat buckets of
`bucket_bytes` (bounded extra memory). An OOM anywhere in forward or backward
on any subset of ranks is then recoverable, at the price of DDP's overlap of
communication with backward.
"""

import torch
import torch.distributed as dist

__all__ = ["world_size", "agree", "average_gradients", "timing_to_ints", "timing_from_ints"]

# A missing step time: above any real one, so that the MAX over ranks says "missing" when any rank lacks it.
_NO_TIME = 1 << 62


def world_size(group=None):
    """Ranks in `group` (1 when torch.distributed is not initialized)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size(group)


def _collective_device(group):
    backend = dist.get_backend(group)
    if backend == "nccl" or (isinstance(backend, str) and "nccl" in backend):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree(proposal, oom, group=None, extra=()):
    """(MIN of proposals, any rank OOM, MAX of each of `extra`) over the group in
    one all_reduce (Note [One collective, two answers]). `extra` are ints (the
    throughput choice's step times in microseconds and flags), reduced with MAX
    so every rank decides from the slowest rank's figures. Without
    torch.distributed it returns its inputs."""
    extra = tuple(int(x) for x in extra)
    if world_size(group) == 1:
        return int(proposal), bool(oom), extra
    flags = torch.tensor([-int(proposal), 1 if oom else 0, *extra], dtype=torch.int64,
                         device=_collective_device(group))
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    values = flags.tolist()
    return -int(values[0]), values[1] > 0, tuple(int(v) for v in values[2:])


def timing_to_ints(calibrate, seconds):
    """The throughput choice's part of the agreement (agree's `extra`): a flag (the memory
    line wants a smaller size measured) and (work, gap, new-size cost) seconds, or None,
    in microseconds. Under MAX, a time missing on any rank stays missing; a new-size cost
    measured on any rank counts."""
    work = gap = _NO_TIME
    cost = -1
    if seconds is not None:
        work, gap = (_NO_TIME if x is None else int(x * 1e6) for x in seconds[:2])
        cost = -1 if seconds[2] is None else int(seconds[2] * 1e6)
    return 1 if calibrate else 0, work, gap, cost


def timing_from_ints(extra):
    """timing_to_ints' fields back from agree's reduced `extra`, in seconds (None: missing)."""
    work, gap, cost = extra[1:4]
    return {"work": None if work >= _NO_TIME else work / 1e6, "gap": None if gap >= _NO_TIME else gap / 1e6,
            "cost": None if cost < 0 else cost / 1e6}


def average_gradients(parameters, group=None, bucket_bytes=32 << 20):
    """Averages .grad of `parameters` over the group, bucketed by dtype/device
    (Note [Averaging gradients ourselves]). Parameters without a gradient on
    this rank contribute zeros, so every rank makes the same calls."""
    size = world_size(group)
    if size == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    buckets, current, current_bytes, key = [], [], 0, None
    for p in params:
        grad = p.grad
        grad_key = (grad.dtype, grad.device)
        nbytes = grad.numel() * grad.element_size()
        if current and (grad_key != key or current_bytes + nbytes > bucket_bytes):
            buckets.append(current)
            current, current_bytes = [], 0
        current.append(grad)
        current_bytes += nbytes
        key = grad_key
    if current:
        buckets.append(current)
    for bucket in buckets:
        flat = torch.cat([g.reshape(-1) for g in bucket])
        dist.all_reduce(flat, group=group)
        flat.div_(size)
        offset = 0
        for g in bucket:
            g.copy_(flat[offset:offset + g.numel()].view_as(g))
            offset += g.numel()
