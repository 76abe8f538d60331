"""One rank of the NCCL scenes of test_gpu_nccl.py, on PyTorch's allocator or under torchmem.

    python tests/gpu/nccl_scene.py MODE CASE RANK WORLD INIT_FILE

MODE is native or torchmem (installed before anything touches CUDA, as a training
script does), or gloo: the collectives case on the CPU over gloo, which checks the
scene's own expected values without a GPU (tests/test_nccl_scene.py); CASE is one of
CASES below. Each rank joins an NCCL process group
through a FileStore (INIT_FILE), runs the case and prints one JSON line: the phase it
reached, whether it finished, the error that stopped it, and one boolean per value
check. A failure is reported, not raised, so the test can tell "failed at once, with
this message" from a wrong value.

The values of every check are chosen so that a collective that read the wrong memory
(another rank's, a freed block reused too early, a stale segment) cannot pass: each
element depends on its index, its rank and the tensor.
"""

import contextlib
import datetime
import json
import os
import sys
import traceback

MiB = 1 << 20
# element counts: the small heap (4 KiB), a block over the 1 MiB small threshold, several granules
SIZES = (1024, 300_000, 12 * MiB // 4)


def base(torch, n, device):
    return torch.arange(n, dtype=torch.int32, device=device) % 1021


def sync(torch, device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def collectives(torch, dist, rank, world, device, checks, prefix="", where=contextlib.nullcontext, sizes=SIZES):
    """all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor on int32 tensors of
    SIZES and a view at an odd offset, plus a bf16 all_reduce; tensors are made inside `where()`
    (a MemPool, or the default pool). Returns the tensors made, for the caller's checks."""
    made = []
    for n in sizes:
        with where():
            b = base(torch, n, device)
            x = b + 7 * rank
            y = b + 100 * rank
            gathered = torch.empty(world * n, dtype=torch.int32, device=device)
            g_in = b + 100 * rank
            scatter_in = torch.cat([b + 1000 * c + 10 * rank for c in range(world)])
            scattered = torch.empty(n, dtype=torch.int32, device=device)
            z = torch.full((n,), float(rank + 1), dtype=torch.bfloat16, device=device)
            big = b + 3 * rank
            view = big[3:]  # a pointer 12 bytes into a block
        made += [x, y, gathered, g_in, scatter_in, scattered, z, big]
        dist.all_reduce(x)
        dist.broadcast(y, src=0)
        dist.all_gather_into_tensor(gathered, g_in)
        dist.reduce_scatter_tensor(scattered, scatter_in)
        dist.all_reduce(z)
        dist.all_reduce(view)
        sync(torch, device)
        ranks_sum = world * (world - 1) // 2
        checks[f"{prefix}all_reduce_{n}"] = torch.equal(x, world * b + 7 * ranks_sum)
        checks[f"{prefix}broadcast_{n}"] = torch.equal(y, b)
        checks[f"{prefix}all_gather_{n}"] = torch.equal(gathered, torch.cat([b + 100 * r for r in range(world)]))
        checks[f"{prefix}reduce_scatter_{n}"] = torch.equal(scattered, world * (b + 1000 * rank) + 10 * ranks_sum)
        checks[f"{prefix}bf16_all_reduce_{n}"] = bool((z == world * (world + 1) // 2).all())
        checks[f"{prefix}view_all_reduce_{n}"] = (torch.equal(big[3:], world * b[3:] + 3 * ranks_sum)
                                                 and int(big[:3].ne(b[:3] + 3 * rank).sum()) == 0)
    return made


def freed_input_is_not_reused_early(torch, dist, rank, world, device, checks, rounds=6):
    """The input of an async all_gather is dropped at once and a same-sized tensor is written on
    the compute stream while NCCL's stream still waits behind a sleep: the allocator must not
    hand the input's memory out before NCCL read it (recordStream, or the process group keeping
    the tensor: TORCH_NCCL_AVOID_RECORD_STREAMS)."""
    n = 8 * MiB // 4
    ok = True
    for i in range(rounds):
        b = base(torch, n, device)
        inp = b + 11 * rank + i
        out = torch.empty(world * n, dtype=torch.int32, device=device)
        torch.cuda._sleep(50_000_000)  # NCCL's stream waits for this one: the gather starts late
        work = dist.all_gather_into_tensor(out, inp, async_op=True)
        del inp
        junk = torch.empty(n, dtype=torch.int32, device=device)
        junk.fill_(-1)
        work.wait()
        torch.cuda.synchronize()
        ok = ok and torch.equal(out, torch.cat([b + 11 * r + i for r in range(world)]))
        del junk, out
    checks["freed_input_not_reused_early"] = ok


def case_collectives(torch, dist, rank, world, device, out):
    if device.type != "cuda":  # gloo checks the arithmetic; the largest size only costs time there
        collectives(torch, dist, rank, world, device, out["checks"], sizes=SIZES[:2])
        return
    collectives(torch, dist, rank, world, device, out["checks"])
    out["phase"] = "async_free"
    freed_input_is_not_reused_early(torch, dist, rank, world, device, out["checks"])


def case_register_hook(torch, dist, rank, world, device, out):
    """The process group was made with TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK set (the
    test sets it): collectives must still be right."""
    out["hook_env"] = os.environ.get("TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK")
    case_collectives(torch, dist, rank, world, device, out)


def _segments(pool):
    return [(s["address"], s["total_size"]) for s in pool.snapshot()]


def case_nccl_mempool(torch, dist, rank, world, device, out):
    """A torch.cuda.MemPool over NCCL's own allocator (ncclMemAlloc): tensors made in it lie in
    its segments and collectives on them are right; then the pool is registered with NCCL
    (register_mem_pool) and the collectives run again."""
    backend = dist.group.WORLD._get_backend(device)
    if not hasattr(backend, "mem_allocator"):
        out["skipped"] = f"torch {torch.__version__}: the NCCL backend has no mem_allocator"
        return
    out["phase"] = "allocator"
    allocator = backend.mem_allocator
    out["phase"] = "pool"
    pool = torch.cuda.MemPool(allocator)
    out["phase"] = "pool_collectives"
    made = collectives(torch, dist, rank, world, device, out["checks"], "pool_",
                       lambda: torch.cuda.use_mem_pool(pool))
    segments = _segments(pool)
    out["pool_segments"] = len(segments)
    out["checks"]["pool_tensors_in_pools_segments"] = bool(segments) and all(
        any(a <= t.data_ptr() < a + size for a, size in segments) for t in made)
    if hasattr(backend, "register_mem_pool"):
        out["phase"] = "register"
        backend.register_mem_pool(pool)
        out["phase"] = "registered_collectives"
        made += collectives(torch, dist, rank, world, device, out["checks"], "registered_",
                            lambda: torch.cuda.use_mem_pool(pool))
        out["phase"] = "deregister"
        backend.deregister_mem_pool(pool)
    del made
    torch.cuda.synchronize()
    out["phase"] = "pool_release"
    del pool
    torch.cuda.empty_cache()


def case_symm_mem(torch, dist, rank, world, device, out):
    """torch's symmetric memory: symm_mem.empty tensors (through torch's implicit MemPool where
    torch has one, which under torchmem is a torchmem pool over the symmetric allocator),
    rendezvous, every peer's buffer read back, and one_shot_all_reduce where it runs."""
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as exc:
        out["skipped"] = f"no torch.distributed._symmetric_memory: {exc}"
        return
    group_name = dist.group.WORLD.group_name
    out["implicit_pool"] = (symm_mem._should_use_implicit_mempool()
                            if hasattr(symm_mem, "_should_use_implicit_mempool") else None)
    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        symm_mem.enable_symm_mem_for_group(group_name)
    out["phase"] = "empty"
    n_a, n_b = 256 * 1024, 3 * MiB // 4
    a = symm_mem.empty(n_a, dtype=torch.float32, device=device)
    b = symm_mem.empty(n_b, dtype=torch.int32, device=device)
    a.fill_(rank + 1)
    b.copy_(base(torch, n_b, device) + 5 * rank)
    out["phase"] = "rendezvous"
    handles = [symm_mem.rendezvous(a, group_name), symm_mem.rendezvous(b, group_name)]
    for h in handles:
        h.barrier()
    torch.cuda.synchronize()
    out["phase"] = "peers"
    ok = True
    for peer in range(world):
        pa = handles[0].get_buffer(peer, (n_a,), torch.float32, getattr(handles[0], "offset", 0) // 4)
        pb = handles[1].get_buffer(peer, (n_b,), torch.int32, getattr(handles[1], "offset", 0) // 4)
        ok = ok and bool((pa == peer + 1).all()) and torch.equal(pb, base(torch, n_b, device) + 5 * peer)
    out["checks"]["symm_peer_buffers"] = ok
    out["phase"] = "one_shot_all_reduce"
    try:
        reduced = torch.ops.symm_mem.one_shot_all_reduce(a, "sum", group_name)
        torch.cuda.synchronize()
        out["checks"]["symm_one_shot_all_reduce"] = bool((reduced == world * (world + 1) / 2).all())
    except (RuntimeError, AttributeError) as exc:  # not every GPU or torch runs it: the native run says
        out["one_shot_error"] = f"{type(exc).__name__}: {exc}"[:500]
    for h in handles:
        h.barrier()
    torch.cuda.synchronize()


CASES = {"collectives": case_collectives, "register_hook": case_register_hook,
         "nccl_mempool": case_nccl_mempool, "symm_mem": case_symm_mem}


def main():
    mode, case, rank, world, init_file = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    out = {"rank": rank, "world": world, "mode": mode, "case": case, "phase": "install", "ok": False,
           "error": None, "checks": {}}
    try:
        import torch

        if mode == "torchmem":
            import torchmem

            torchmem.install(warn_unsupported=False)
            out["installed"] = torchmem.is_installed()
        import torch.distributed as dist

        out["torch"] = torch.__version__
        timeout = datetime.timedelta(seconds=120)
        if mode == "gloo":
            device = torch.device("cpu")
            out["phase"] = "init"
            dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                    timeout=timeout)
        else:
            out["nccl"] = ".".join(map(str, torch.cuda.nccl.version()))
            device = torch.device("cuda", rank % torch.cuda.device_count())
            torch.cuda.set_device(device)
            out["phase"] = "init"
            # device_id: the communicator is made now (register_mem_pool needs it), and an error in
            # the process group's constructor surfaces here
            dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=world,
                                    device_id=device, timeout=timeout)
        out["phase"] = case
        CASES[case](torch, dist, rank, world, device, out)
        out["phase"] = "destroy"
        dist.destroy_process_group()
        out["phase"] = "done"
        out["ok"] = True
    except Exception as exc:  # reported: the test decides whether this failure was the expected one
        out["error"] = f"{type(exc).__name__}: {exc}"[:2000]
        out["traceback"] = traceback.format_exc()[-3000:]
    print(json.dumps(out), flush=True)
    sys.stdout.flush()
    # a rank that failed must not wait in NCCL's teardown for a peer that left
    os._exit(0)


if __name__ == "__main__":
    main()
