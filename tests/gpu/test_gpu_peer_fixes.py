"""GPU checks of torch behaviours the peer suite (PyTorch's test_cuda.py) showed apart, each run
once natively and once under torchmem in fresh interpreters (tests/support.py run_python):
C++ frames and compile contexts in memory history, MemPool.snapshot per pool, graph pools
reusing their own frees, per_process_memory_fraction from PYTORCH_CUDA_ALLOC_CONF, caching off,
one segment per growth in snapshots, and what empty_cache returns around another stream's block."""

import os
import textwrap

import pytest

from support import run_both as _both
from support import run_snippet as _run

pytestmark = pytest.mark.gpu


def test_history_with_cpp_stacks_shows_cpp_and_python_frames():
    native, ours = _both("""
    torch.cuda.memory._record_memory_history("state", stacks="all")
    def make_it():
        return torch.rand(311, 411, device="cuda")
    x = make_it()
    frames = [str(b["frames"]) for s in torch.cuda.memory._snapshot()["segments"] for b in s["blocks"]
              if b["requested_size"] == 311 * 411 * 4]
    torch.cuda.memory._record_memory_history(None)
    python_only = []
    torch.cuda.memory._record_memory_history("all", stacks="python")
    y = make_it()
    text = json.dumps(torch.cuda.memory._snapshot())
    torch.cuda.memory._record_memory_history(None)
    print(json.dumps({"found": len(frames) == 1, "cpp": "::rand" in frames[0], "py": "make_it" in frames[0],
                      "cpp_when_python": "::rand" in text, "py_when_python": "make_it" in text}))
    """)
    assert native == ours
    # the block of the first session keeps its C++ frames (PyTorch reports every block's context)
    assert ours == {"found": True, "cpp": True, "py": True, "cpp_when_python": True, "py_when_python": True}


def test_python_stacks_name_a_torchscript_function_first():
    # PyTorch's test_memory_snapshot_script: stacks="python" is torch's gather of Python and
    # TorchScript frames, so the scripted function that allocated is the innermost frame
    native, ours = _both("""
    torch.cuda.memory._record_memory_history("state", stacks="python")
    # (torch.jit.script of a def needs its source file; `python -c` has none)
    scripted = torch.jit.CompilationUnit("def foo():\\n    return torch.rand(311, 411, device='cuda')\\n")
    x = scripted.foo()
    names = [b["frames"][0]["name"] if b["frames"] else None for s in torch.cuda.memory._snapshot()["segments"]
             for b in s["blocks"] if b["requested_size"] == 311 * 411 * 4]
    text = str(torch.cuda.memory._snapshot()["segments"])
    torch.cuda.memory._record_memory_history(None)
    print(json.dumps({"names": names, "cpp": "::rand" in text}))
    """)
    assert native == ours == {"names": ["foo"], "cpp": False}


def test_compile_context_tags_allocations_of_compiled_regions():
    native, ours = _both("""
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(10, 10)
            self.b = torch.nn.Linear(10, 10)
        def forward(self, x):
            x = self.a(x)
            if x.sum() > 0:  # a graph break: two compiled regions
                x = x + 1
            else:
                x = x - 1
            return self.b(x)
    model = Model().cuda()
    compiled = torch.compile(model, backend="aot_eager")
    x = torch.randn(1, 10, device="cuda")
    compiled(x)
    torch.cuda.memory._record_memory_history(context="all", compile_context=True)
    compiled(x)
    trace = torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]
    torch.cuda.memory._record_memory_history(None)
    seen = []
    for e in trace:
        c = e["compile_context"]
        if c != "N/A" and (not seen or seen[-1] != c):
            seen.append(c)
    print(json.dumps({"regions": seen}))
    """)
    assert native == ours
    assert ours["regions"] and all(r.startswith("Torch-Compiled Region") for r in ours["regions"])


def test_mempool_snapshot_is_that_pools_and_segments_follow_growths():
    native, ours = _both("""
    MB = 1 << 20
    pools = [torch.cuda.MemPool() for _ in range(3)]
    keep = []
    def alloc():
        keep.append(torch.empty(20 * MB // 4, device="cuda"))
    with torch.cuda.use_mem_pool(pools[0]):
        alloc()
        with torch.cuda.use_mem_pool(pools[1]):
            alloc()
            with torch.cuda.use_mem_pool(pools[2]):
                alloc()
            alloc()
        alloc()
    counts = [len(torch.cuda.memory.memory_snapshot(p.id)) for p in pools]
    print(json.dumps({"counts": counts, "own": [len(p.snapshot()) for p in pools]}))
    """)
    assert native == ours
    assert ours["counts"] == [2, 2, 1]


def test_a_released_graph_pools_live_block_is_not_shown_under_a_new_mempools_id():
    # PyTorch's test_nested_mempool after test_repeat_graph_capture_cublas_workspace_memory: a
    # graph's pool, released with a block still live (a cuBLAS workspace), was labelled by the
    # core's pool id, (0, id), which a later MemPool's key may equal; its snapshot showed 3 segments
    native, ours = _both("""
    MB = 1 << 20
    kept = []
    for _ in range(6):  # graph pools take core ids but no (0, n) MemPool key
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        with torch.cuda.stream(s):
            g.capture_begin()
            kept.append(torch.empty(32 * MB, dtype=torch.uint8, device="cuda"))
            g.capture_end()
        torch.cuda.synchronize()
        del g  # the pool is released; the block stays live
    pools = [torch.cuda.MemPool() for _ in range(8)]
    mine = []
    for p in pools:
        with torch.cuda.use_mem_pool(p):
            mine.append(torch.empty(20 * MB // 4, device="cuda"))
    shown = [[seg["total_size"] // MB for seg in torch.cuda.memory.memory_snapshot(p.id)] for p in pools]
    print(json.dumps({"shown": shown}))
    """)
    assert native == ours
    assert ours["shown"] == [[20]] * 8


def test_graphs_sharing_a_pool_reuse_each_others_frees_like_native():
    # PyTorch's test_graph_three_successive: g2's capture reuses what g1's capture freed, so
    # replaying out of order corrupts e (the documented cost of sharing a pool)
    native, ours = _both("""
    size = 1000
    s = torch.cuda.Stream()
    a = torch.ones((size,), device="cuda")
    g0, g1, g2 = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        g0.capture_begin()
        b = a.clone(); c = b + 1; d = b + 2
        g0.capture_end()
        g1.capture_begin(g0.pool())
        e = c + 3
        del c
        g1.capture_end()
        g2.capture_begin(g0.pool())
        f = d + 4
        g2.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    g0.replay(); g1.replay(); g2.replay()
    in_order = (e.sum().item(), f.sum().item())
    g0.replay(); g2.replay(); g1.replay()
    print(json.dumps({"in_order": in_order, "out_of_order_e": e.sum().item()}))
    """)
    assert native == ours
    assert ours["in_order"] == [5000.0, 7000.0] and ours["out_of_order_e"] == 10000.0


@pytest.mark.parametrize("fraction", ["0.0", "0.5", "1.0"])
def test_per_process_memory_fraction_from_torchs_alloc_conf(fraction):
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF=f"per_process_memory_fraction:{fraction}")
    native, ours = _both("""
    print(json.dumps({"f": torch.cuda.memory.get_per_process_memory_fraction(torch._C._cuda_getDevice())}))
    """, env=env)
    assert native == ours == {"f": float(fraction)}


def test_a_bad_per_process_memory_fraction_is_refused():
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="per_process_memory_fraction:1.1")
    proc = _run("torchmem", "print(json.dumps({}))", env=env, check=False)
    assert proc.returncode != 0 and "per_process_memory_fraction is invalid" in proc.stderr


def test_caching_off_allocates_outside_the_pool_like_native():
    native, ours = _both("""
    device = torch._C._cuda_getDevice()
    stream = torch._C._cuda_getCurrentRawStream(device)
    def requested_delta(size):
        start = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
        ptr = torch._C._cuda_cudaCachingAllocator_raw_alloc(size, stream)
        finish = torch.cuda.memory_stats()["requested_bytes.all.allocated"]
        torch._C._cuda_cudaCachingAllocator_raw_delete(ptr)
        return finish - start
    torch.cuda.caching_allocator_enable(False)
    off = requested_delta(1 << 20)
    t = torch.full((1000,), 3.0, device="cuda")
    off_tensor = t.sum().item()
    del t
    torch.cuda.caching_allocator_enable(True)
    on = requested_delta(1 << 20)
    print(json.dumps({"off": off, "on": on, "tensor": off_tensor}))
    """)
    assert native == ours == {"off": 0, "on": 1 << 20, "tensor": 3000.0}


# A MemPool's own allocator, in C with no CUDA headers: the driver's cuMemAlloc / cuMemFree
# (looked up at run time, so the build needs only a C compiler), counting its calls.
_COUNTING_ALLOCATOR_C = r"""
#include <dlfcn.h>
#include <stddef.h>
typedef int (*mem_alloc_fn)(unsigned long long*, size_t);
typedef int (*mem_free_fn)(unsigned long long);
int allocs = 0, frees = 0;
static mem_alloc_fn mem_alloc;
static mem_free_fn mem_free;
static void load(void) {
  if (mem_alloc) return;
  void* driver = dlopen("libcuda.so.1", RTLD_NOW);
  mem_alloc = (mem_alloc_fn)dlsym(driver, "cuMemAlloc_v2");
  mem_free = (mem_free_fn)dlsym(driver, "cuMemFree_v2");
}
void* counted_alloc(size_t size, int device, void* stream) {
  unsigned long long ptr = 0;
  load();
  if (mem_alloc(&ptr, size) != 0) return NULL;
  allocs++;
  return (void*)ptr;
}
void counted_free(void* ptr, size_t size, int device, void* stream) {
  load();
  mem_free((unsigned long long)ptr);
  frees++;
}
"""


@pytest.fixture(scope="module")
def counting_allocator(tmp_path_factory):
    import subprocess

    folder = tmp_path_factory.mktemp("allocator")
    source = folder / "counting.c"
    source.write_text(_COUNTING_ALLOCATOR_C)
    library = folder / "libcounting.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-o", str(library), str(source), "-ldl"], check=True)
    return str(library)


def test_mempool_with_its_own_allocator_caches_its_segments_like_native(counting_allocator):
    # Note [External pool allocators]: X is called when the pool grows, its segments are the
    # device's (budget, reserved), and a use_on_oom pool lends its cache to the device pool.
    native, ours = _both(f"""
    import ctypes
    path = {counting_allocator!r}
    lib = ctypes.CDLL(path)
    allocs, frees = (ctypes.c_int.in_dll(lib, name) for name in ("allocs", "frees"))
    allocator = torch.cuda.memory.CUDAPluggableAllocator(path, "counted_alloc", "counted_free")
    MiB = 1 << 20
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    pool = torch.cuda.MemPool(allocator.allocator())
    with torch.cuda.use_mem_pool(pool):
        for _ in range(10):
            x = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
            del x
        y = torch.empty(4 * MiB, dtype=torch.uint8, device="cuda")
    churn_calls = allocs.value
    reserved_grew = torch.cuda.memory_reserved() - base >= 4 * MiB
    in_snapshot = [s["total_size"] >= 4 * MiB and s["allocated_size"] >= 4 * MiB and not s["is_expandable"]
                   for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == tuple(pool.id)]
    del pool  # released; y still lives
    frees_while_live = frees.value
    del y
    torch.cuda.empty_cache()
    frees_after_empty = frees.value

    # the budget counts X's segments, and a use_on_oom pool lends its cached block
    torch.cuda.empty_cache()
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction((torch.cuda.memory_reserved() + 64 * MiB) / total)
    lender = torch.cuda.MemPool(allocator.allocator(), use_on_oom=True)
    with torch.cuda.use_mem_pool(lender):
        a = torch.empty(48 * MiB, dtype=torch.uint8, device="cuda")
    a_ptr = a.data_ptr()
    del a
    b = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")  # over the budget: borrowed
    borrowed = b.data_ptr() == a_ptr
    try:
        c = torch.empty(32 * MiB, dtype=torch.uint8, device="cuda")
        second_oom = False
    except torch.OutOfMemoryError:
        second_oom = True
    del b
    torch.cuda.set_per_process_memory_fraction(1.0)
    print(json.dumps({{"churn_calls": churn_calls, "reserved_grew": reserved_grew, "in_snapshot": in_snapshot,
                      "frees_while_live": frees_while_live, "frees_after_empty": frees_after_empty,
                      "borrowed": borrowed, "second_oom": second_oom}}))
    """)
    assert native == ours
    assert ours == {"churn_calls": 1, "reserved_grew": True, "in_snapshot": [True], "frees_while_live": 0,
                    "frees_after_empty": 1,
                    "borrowed": True, "second_oom": True}


def test_torchs_cpp_history_and_snapshot_give_torchs_frames():
    # Note [Torch's recorder]: with torch.cuda.memory left unpatched, _record_memory_history and
    # _snapshot are torch's own C++ (recordHistory with torch's recorder, then snapshot()), as a
    # C++ user's torch::cuda::_record_memory_history / _memory_snapshot_pickled are.
    body = """
    torch.cuda.memory._record_memory_history("all", stacks="all")
    def make_it():
        return torch.rand(311, 411, device="cuda")
    x = make_it()
    snapshot = torch.cuda.memory._snapshot()
    blocks = [b for s in snapshot["segments"] for b in s["blocks"]
              if b["state"] == "active_allocated" and b["requested_size"] == 311 * 411 * 4]
    frames = str(blocks[0]["frames"]) if blocks else ""
    trace = snapshot["device_traces"][torch.cuda.current_device()]
    allocs = [e for e in trace if e["action"] == "alloc" and e["size"] == 311 * 411 * 4]
    torch.cuda.memory._record_memory_history(None)
    print(json.dumps({"found": len(blocks) == 1, "cpp": "::rand" in frames, "py": "make_it" in frames,
                      "traced": len(allocs) == 1, "trace_frames": bool(allocs and allocs[0]["frames"]),
                      "pool_ids": sorted({tuple(s["segment_pool_id"]) for s in snapshot["segments"]})}))
    """
    native = _run("native", body)
    ours = _run("native", "import torchmem\ntorchmem.install(patch_torch=False, warn_unsupported=False)\n"
                + textwrap.dedent(body))
    assert native == ours
    assert ours["found"] and ours["cpp"] and ours["py"] and ours["traced"] and ours["trace_frames"]


def test_a_thread_allocating_into_a_graph_pool_beside_another_thread_repeatedly():
    # PyTorch's TestBlockStateAbsorption.test_allocate_in_thread_to_pool, in our own words and
    # repeated: under torchmem it saw 2 segments where 4 are expected in one peer run of five
    # (docs/compatibility.md). Each repeat reports the pool's segments; all must agree with native.
    body = """
    import threading
    LARGE = 20 << 20
    def ones(size):
        return torch.ones([size], device="cuda", dtype=torch.uint8)
    def capture(fn):
        torch.cuda.synchronize()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            fn()
        stream.synchronize()
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream, pool=torch.cuda.graph_pool_handle()):
            out = fn()
        return graph, out
    def segments(pool):
        return sorted(s["total_size"] >> 20 for s in torch.cuda.memory_snapshot() if s["segment_pool_id"] == pool)
    counts = []
    for repeat in range(12):
        graph, out = capture(lambda: torch.rand([4], device="cuda"))
        pool, device = graph.pool(), out.device.index
        del out
        def in_pool():
            torch.cuda.synchronize()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream), torch.device(device):
                torch._C._cuda_beginAllocateCurrentThreadToPool(device, pool)
                try:
                    for _ in range(10):
                        a, b = ones(LARGE), ones(LARGE)
                        c = a + b
                        del a, b, c
                finally:
                    torch._C._cuda_endAllocateToPool(device, pool)
                    torch._C._cuda_releasePool(device, pool)
            torch.cuda.current_stream().wait_stream(stream)
        def beside():
            for _ in range(10):
                a, b = ones(LARGE), ones(LARGE)
                del a, b
        threads = [threading.Thread(target=in_pool), threading.Thread(target=beside)]
        for t in threads: t.start()
        for t in threads: t.join()
        counts.append(segments(pool))
        del graph
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
    print(json.dumps({"counts": counts}))
    """
    native, ours = _both(body)
    assert ours == native, (native, ours)


def test_a_small_block_of_another_stream_keeps_little_of_a_freed_tensor_through_empty_cache():
    # PyTorch's test_device_memory_used after test_randint_generation_for_large_numel (Note [Run
    # length]): one stream frees 2 GiB, another then takes a 32 MiB block that stays live; empty_cache
    # must return nearly all of the 2 GiB, so that a 512 MiB tensor after it shows on the device
    native, ours = _both("""
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_reserved()
    with torch.cuda.stream(s1):
        big = torch.empty(2**31 + 1, dtype=torch.int8, device="cuda")
        big.fill_(1)
        del big
    torch.cuda.synchronize()
    with torch.cuda.stream(s2):
        small = torch.ones(32 << 20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved() - base
    free, total = torch.cuda.mem_get_info()
    x = torch.ones(512 << 20, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free_after, _ = torch.cuda.mem_get_info()
    grew = free - free_after
    print(json.dumps({"kept_mib": kept >> 20, "grew_like_the_test_asks": (512 << 20) // 32 <= grew <= (512 << 20) * 32,
                      "small_intact": bool((small == 1).all())}))
    """)
    assert native["grew_like_the_test_asks"] and native["small_intact"]
    assert ours["grew_like_the_test_asks"] and ours["small_intact"]
    assert native["kept_mib"] <= 64 and ours["kept_mib"] <= 256
