"""CUDA IPC scene (Note [CUDA IPC], csrc/shim/ipc.cpp), run by test_gpu_ipc.py.

A producer sends CUDA tensors through a torch.multiprocessing Queue to a spawned
consumer; either side runs torchmem (with TORCHMEM_CONF for its options) or PyTorch's
native allocator. The consumer checks every value, doubles one tensor in place and
replies; the producer checks that it sees the write, then frees everything and empties
its cache once the consumer let go. Prints one JSON line.

    python tests/gpu/ipc_scene.py PRODUCER CONSUMER     (each: torchmem or native)
"""

import json
import sys

MiB = 1 << 20


def install(mode):
    import torch

    if mode == "torchmem":
        import torchmem

        torchmem.install(warn_unsupported=False)
    return torch


def expected_tensors(torch):
    """name -> the values each tensor holds (CPU), one per layout the pool makes."""
    return {
        "small": torch.arange(16 * 1024, dtype=torch.float32),           # 64 KiB: the small heap
        "view": torch.arange(3 * MiB // 4, dtype=torch.float32)[1000:],  # a view: storage offset
        "large": torch.arange(48 * MiB // 4, dtype=torch.float32),       # 48 MiB: several granules
        "int": torch.arange(5 * MiB // 8, dtype=torch.int64) * 7,        # 5 MiB
    }


def consumer(mode, inbox, outbox):
    torch = install(mode)
    reply = {"mode": mode}
    try:
        received = inbox.get(timeout=120)
        expected = expected_tensors(torch)
        reply["data_ok"] = all(torch.equal(received[k].cpu(), v) for k, v in expected.items())
        received["large"].mul_(2)  # the producer must see this
        torch.cuda.synchronize()
        if mode == "torchmem":
            import torchmem

            reply["installed"] = torchmem.is_installed()
        del received
    except Exception as e:  # reported to the producer, which decides what was expected
        reply["error"] = f"{type(e).__name__}: {e}"
    outbox.put(reply)
    inbox.get(timeout=120)  # "done": stay alive until the producer has read the reply


def main():
    producer_mode, consumer_mode = sys.argv[1], sys.argv[2]
    torch = install(producer_mode)
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    inbox, outbox = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=consumer, args=(consumer_mode, inbox, outbox))
    proc.start()
    expected = expected_tensors(torch)
    torch.cuda.empty_cache()
    sent = {k: v.cuda() for k, v in expected.items() if k != "view"}
    base = torch.arange(3 * MiB // 4, dtype=torch.float32, device="cuda")
    sent["view"] = base[1000:]  # .cuda() of a CPU view would copy; this one shares base's storage
    torch.cuda.synchronize()
    inbox.put(sent)
    reply = outbox.get(timeout=180)
    out = {"producer": producer_mode, "consumer": consumer_mode, "reply": reply}
    if "error" not in reply:
        out["write_seen"] = torch.equal(sent["large"].cpu(), expected["large"] * 2)
    inbox.put("done")
    proc.join(timeout=120)
    out["consumer_exit"] = proc.exitcode
    del sent, base
    torch.cuda.ipc_collect()  # torch keeps sent storages until their consumers let go
    torch.cuda.empty_cache()
    out["allocated_after"] = torch.cuda.memory_allocated()
    out["same_process"] = same_process_round_trip(torch)
    print(json.dumps(out))


def same_process_round_trip(torch):
    """Share a storage and open the handle again in this process (torch's own Python
    cache is bypassed: _new_shared_cuda always asks the allocator). torch's IPC event
    cannot be opened in the process that made it (cudaIpcOpenEventHandle: "invalid
    device context" on the H200), so the receiver is told not to wait on it; the
    producer synchronized already."""
    t = torch.arange(3 * MiB, dtype=torch.int32, device="cuda")
    torch.cuda.synchronize()
    try:
        args = list(t.untyped_storage()._share_cuda_())
        args[7] = False  # event_sync_required
        opened = torch.UntypedStorage._new_shared_cuda(*args)
        view = torch.empty(0, dtype=torch.int32, device="cuda").set_(opened)
        return {"ok": bool(torch.equal(view, t)), "distinct": opened.data_ptr() != t.data_ptr()}
    except Exception as e:
        return {"error": f"{type(e).__name__}: {e}"}


if __name__ == "__main__":
    main()
