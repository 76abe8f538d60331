"""On a GPU: no stream ever touches unmapped memory (Note [Device barrier] in
csrc/core/pool.h).

The scene (stream_safety_scene.py) has a side-stream kernel read a tensor that
was freed on the default stream without record_stream while the pool stitches
its granules; an allocator that unmaps on the free stream's fence alone faults
with an illegal address there (seen under torchmem before the barrier, in
PyTorch's own test_cublas_multiple_threads_same_device). The threads test
replays that test's pattern under a tight budget, so stitching happens while
other threads' streams still run."""

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support import REPO, last_json, run_both, run_python

pytestmark = pytest.mark.gpu

SCENE = os.path.join(REPO, "tests", "gpu", "stream_safety_scene.py")


def run_scene(*args):
    proc = subprocess.run([sys.executable, SCENE, *args], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("mode", [[], ["record_stream"]])
def test_stitching_under_a_side_stream_reader_does_not_fault(mode):
    figures = run_scene(*mode)
    assert figures["data_ok"]
    if not mode:
        # The scene did force the pool to move x's granules under the reader.
        assert figures["reclaims"] > 0


def test_cublas_threads_freeing_default_stream_tensors_under_a_tight_budget():
    run_python(textwrap.dedent("""
        import threading, torch, torchmem
        # 4 cuBLAS workspaces (32 MiB each) + 4 x (result, mm output, 7.5 MiB junk)
        torchmem.install(limit="256MiB", stitch_above_limit=0.0)
        size, threads, iters, trials = 1024, 4, 60, 3
        weight = torch.ones((size, size), device="cuda")
        # The same threads and streams for every trial: cuBLAS keeps a workspace per
        # (handle, stream) for the life of the process, and a new thread may be handed
        # another thread's handle, so fresh threads could need 16 workspaces (512 MiB).
        streams = [torch.cuda.Stream() for _ in range(threads)]
        results = {}
        errors = []
        start = threading.Barrier(threads + 1, timeout=120)
        done = threading.Barrier(threads + 1, timeout=120)

        def work(t):
            try:
                for _ in range(trials):
                    start.wait()
                    with torch.cuda.stream(streams[t]):
                        for _ in range(iters):
                            # frees, on this stream, tensors allocated on the default one
                            results[t] = torch.mm(results[t], weight)
                            results[t].div_(float(size))
                            junk = torch.empty(int(7.5 * (1 << 20)), dtype=torch.uint8, device="cuda")
                            del junk
                    torch.cuda.synchronize()
                    done.wait()
            except threading.BrokenBarrierError:
                pass
            except BaseException as error:  # an OOM or a fault: the test must fail, not hang
                errors.append(repr(error))
                start.abort()
                done.abort()

        pool = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
        for th in pool: th.start()
        for trial in range(trials):
            for t in range(threads):
                results[t] = torch.ones((size, size), device="cuda")
            torch.cuda.synchronize()
            try:
                start.wait()
                done.wait()
            except threading.BrokenBarrierError:
                break
            for t in range(threads):
                assert torch.equal(results[t].sum().cpu(), torch.tensor(float(size * size))), (trial, t)
        for th in pool: th.join()
        assert not errors, errors
        stats = torchmem.memory_stats()
        print("reclaims", stats["torchmem.num_reclaims"], "syncs", stats["torchmem.backend.device_sync_calls"])
    """))


def run_late_read(install_args, read_and_drop, taker):
    """Three trials in a fresh process under torchmem.install(install_args): each makes `a`
    (16M floats) on the default stream, runs `read_and_drop` (script lines that queue a late
    read of `a`, after a sleep of `delay` cycles, 200 ms, and drop it), then has stream
    `taker` ask for as much and fill it. The figures: the sums read, whether the taker got
    a's address, and the pool's device-side waits and device barriers."""
    head = textwrap.dedent(f"""
        import json, torch, torchmem
        torchmem.install({install_args})
        # _sleep's cycles per ms, measured here (torch.testing._internal needs expecttest, a test-only
        # package): after one launch that loads the kernel, the median of five, so that the sleep
        # below is not cut short by a first launch's overhead counted as sleep
        torch.cuda._sleep(1_000_000); torch.cuda.synchronize()
        rates = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(); torch.cuda._sleep(10_000_000); end.record(); end.synchronize()
            rates.append(10_000_000 / start.elapsed_time(end))
        delay = int(200 * sorted(rates)[2])
        n = 16 << 20
        side, third = torch.cuda.Stream(), torch.cuda.Stream()
        sums, reused = [], []
        for _ in range(3):
            a = torch.ones(n, device="cuda")
            ptr = a.data_ptr()
    """)
    tail = textwrap.dedent(f"""
            with torch.cuda.stream({taker}):
                b = torch.empty(n, device="cuda")
                b.fill_(2.0)
                reused.append(b.data_ptr() == ptr)
            torch.cuda.synchronize()
            del b
        stats = torchmem.memory_stats()
        print(json.dumps({{"sums": [float(s) for s in sums], "reused": reused,
                          "waits": stats["torchmem.backend.stream_wait_calls"],
                          "barriers": stats["num_sync_all_streams"]}}))
    """)
    return last_json(run_python(head + textwrap.indent(textwrap.dedent(read_and_drop), "    ") + tail))


@pytest.mark.parametrize("stream_order", [True, False])
def test_a_block_handed_to_another_stream_waits_for_the_old_one(stream_order):
    """Note [Cross-stream reuse]: with no limit, a side stream's request takes the block
    the default stream just freed (rather than new memory) behind a device-side wait on
    the default stream. The default stream's last read of it runs late (after a sleep);
    a write on the side stream that did not wait would land before that read and change
    the sum. With stream_order=false the block changes streams only behind a device
    barrier, or the side stream gets other memory."""
    figures = run_late_read(f"stream_order={stream_order}", """
        torch.cuda._sleep(delay)  # the read below runs late
        sums.append(a.sum())
        del a  # freed on the default stream while its read is still queued
    """, taker="side")
    assert figures["sums"] == [float(16 << 20)] * 3
    if stream_order:
        assert figures["reused"][-1] and figures["waits"] >= 1 and figures["barriers"] == 0
    else:
        assert figures["waits"] == 0 and (figures["barriers"] >= 1 or not figures["reused"][-1])


def test_a_block_dropped_on_a_reader_stream_waits_for_that_reader():
    """Note [Freed under another stream]: the pattern of PyTorch's
    test_cusparse_multiple_threads_same_device. A tensor made on the default stream is read
    late (after a sleep) on a reader stream and dropped there, with no record_stream; a
    third stream's request then takes its block (with no limit, rather than new memory).
    Natively the block would stay the default stream's, which allocates nothing more, so
    the read is safe; under torchmem the third stream must wait for the reader as well as
    for the default stream, or its write lands before the read and changes the sum."""
    figures = run_late_read("", """
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # the reader
            torch.cuda._sleep(delay)  # the read below runs late
            sums.append(a.sum())
            del a  # freed (on the default stream, its allocation stream) under the reader
    """, taker="third")
    assert figures["sums"] == [float(16 << 20)] * 3
    # the handover took place (else the test shows nothing) behind device-side waits alone
    assert any(figures["reused"]) and figures["waits"] >= 2 and figures["barriers"] == 0


def test_a_mempool_scope_reuses_what_the_default_stream_dropped_and_grows_for_a_third_stream():
    """Note [Freed under another stream], Note [Unmapped tail]: the warm-up of torch.compile's
    cudagraph trees in small. A MemPool scope (which refuses stream waits and device barriers)
    on a side stream; one of its blocks is dropped under the default stream, its neighbour on
    the side stream. The side stream takes the merged block back at once, and a third
    stream's request in the scope gets new memory, under torchmem as natively; before, both
    ran out of memory with the device empty."""
    native, mine = run_both("""
        MiB = 1 << 20
        pool = torch.cuda.MemPool()
        side, third = torch.cuda.Stream(), torch.cuda.Stream()
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
            a = torch.ones(MiB, device="cuda")  # 4 MiB each
            b = torch.ones(MiB, device="cuda")
        a_ptr = a.data_ptr()
        torch.cuda.synchronize()
        del a  # dropped under the default stream: it is a reader of the block
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
            del b  # dropped on its own stream: merges with a's block
            c = torch.zeros(2 * MiB, device="cuda")
            with torch.cuda.stream(third):
                d = torch.zeros(2 * MiB, device="cuda")
        torch.cuda.synchronize()
        ooms = torch.cuda.memory_stats().get("num_ooms", 0)
        with torch.cuda.stream(side), torch.cuda.use_mem_pool(pool):
            try:  # more than the device: the message says the scope limits reuse
                torch.empty(1 << 50, dtype=torch.uint8, device="cuda")
                message = ""
            except torch.OutOfMemoryError as e:
                message = str(e)
        print(json.dumps({"c_is_a": c.data_ptr() == a_ptr, "sums": [float(c.sum()), float(d.sum())],
                          "ooms": ooms, "names_the_scope": "MemPool scope" in message}))
    """)
    for result in (native, mine):
        assert result["sums"] == [0.0, 0.0] and result["ooms"] == 0, result
    assert mine["c_is_a"], mine  # the side stream's own memory, with no wait and no barrier
    assert mine["names_the_scope"], mine
