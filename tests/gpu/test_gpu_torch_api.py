"""torch's allocator API under torchmem answers as under PyTorch's own allocator.

Each test runs one snippet twice in fresh interpreters (tests/support.py run_python):
once on the native allocator and once with torchmem installed, and compares what
the snippet prints (its last JSON line). The methods are those docs/compatibility.md
lists: memory fraction, memory history at any time, memory_stats keys, OOM observers
(and the snapshot-on-OOM recipe of PyTorch's docs), torch.cuda.MemPool with the
user's own allocator, OOM messages, lazy install and fork, graph-pool stats.
"""

import os
import shutil
import subprocess

import pytest

from support import last_json as _last_json
from support import run_both as _both
from support import run_python

pytestmark = pytest.mark.gpu

MiB = 1 << 20


def test_memory_fraction_answers_what_was_set():
    native, ours = _both("""
    seen = [torch.cuda.get_per_process_memory_fraction()]
    for f in (0.5, 1.0, 0.0, 0.3125):
        torch.cuda.set_per_process_memory_fraction(f)
        seen.append(torch.cuda.get_per_process_memory_fraction())
    torch.cuda.set_per_process_memory_fraction(0.0)
    try:
        torch.empty(MiB, dtype=torch.uint8, device="cuda")
        refused = False
    except torch.OutOfMemoryError:
        refused = True
    torch.cuda.set_per_process_memory_fraction(1.0)
    x = torch.ones(MiB, device="cuda")
    print(json.dumps({"seen": seen, "refused": refused, "sum": x.sum().item()}))
    """.replace("MiB", str(MiB)))
    assert native == ours
    assert ours["seen"] == [1.0, 0.5, 1.0, 0.0, 0.3125] and ours["refused"]


def test_memory_fraction_reports_the_install_limit():
    proc = run_python("""
    import json, torch, torchmem
    torchmem.install(limit=0.25, warn_unsupported=False)
    print(json.dumps({"f": torch.cuda.get_per_process_memory_fraction()}))
    """)
    assert _last_json(proc)["f"] == 0.25


HISTORY = """
def alloc_sizes(snap):
    dev = torch.cuda.current_device()
    return [e["size"] for e in snap["device_traces"][dev] if e["action"] == "alloc"]

early = torch.empty(3 * MiB, dtype=torch.uint8, device="cuda")  # pools exist before history starts
torch.cuda.memory._record_memory_history(max_entries=1000)
y = torch.empty(5 * MiB + 512, dtype=torch.uint8, device="cuda")
after_start = (5 * MiB + 512) in alloc_sizes(torch.cuda.memory._snapshot())
torch.cuda.memory._record_memory_history(max_entries=1000, clear_history=True)
cleared = (5 * MiB + 512) not in alloc_sizes(torch.cuda.memory._snapshot())
torch.cuda.memory._record_memory_history(enabled="state")
torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python", max_entries=10)
z = [torch.empty(4096, device="cuda") for _ in range(20)]
capped = len(torch.cuda.memory._snapshot()["device_traces"][torch.cuda.current_device()]) <= 10
torch.cuda.memory._record_memory_history(enabled=None)
print(json.dumps({"after_start": after_start, "cleared": cleared, "capped": capped}))
""".replace("MiB", str(MiB))


def test_record_memory_history_after_allocations_exist():
    native, ours = _both(HISTORY)
    assert native == ours == {"after_start": True, "cleared": True, "capped": True}


def test_unpatched_record_memory_history_drives_the_trace_ring():
    proc = run_python("""
    import json, torch, torchmem
    torchmem.install(patch_torch=False, warn_unsupported=False)
    early = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
    torch.cuda.memory._record_memory_history(max_entries=100)  # torch's own, through recordHistory
    y = torch.empty((5 << 20) + 512, dtype=torch.uint8, device="cuda")
    dev = torch.cuda.current_device()
    sizes = [e["size"] for e in torchmem.snapshot()["device_traces"][dev] if e["action"] == "alloc"]
    torch.cuda.memory._record_memory_history(enabled=None)
    off = torchmem.snapshot()["device_traces"][dev]
    print(json.dumps({"recorded": ((5 << 20) + 512) in sizes, "off_empty": off == []}))
    """)
    assert _last_json(proc) == {"recorded": True, "off_empty": True}


def test_memory_stats_has_every_native_key():
    body = """
    x = torch.empty(3 * MiB, device="cuda")
    keys = sorted(torch.cuda.memory_stats())
    acc = torch.accelerator.memory_stats()
    before = acc["active_bytes.all.current"]
    tmp = torch.randn(256, device="cuda")
    delta = torch.accelerator.memory_stats()["active_bytes.all.current"] - before
    freed0 = torch.accelerator.memory_stats()["active_bytes.all.freed"]
    del tmp
    freed = torch.accelerator.memory_stats()["active_bytes.all.freed"] - freed0
    print(json.dumps({"keys": keys, "acc_keys": sorted(acc), "delta": delta, "freed": freed,
                      "max_split_size": torch.cuda.memory_stats()["max_split_size"]}))
    """.replace("MiB", str(MiB))
    native, ours = _both(body)
    assert set(native["keys"]) - set(ours["keys"]) == set()
    assert [k for k in set(ours["keys"]) - set(native["keys"]) if not k.startswith("torchmem.")] == []
    assert ours["acc_keys"] == native["acc_keys"]
    assert ours["delta"] == native["delta"] == 1024 and ours["freed"] == native["freed"] == 1024
    assert ours["max_split_size"] == native["max_split_size"]


def test_oom_observer_is_called_before_the_error():
    native, ours = _both("""
    calls = []
    torch._C._cuda_attach_out_of_memory_observer(lambda *args: calls.append(list(args)))
    try:
        torch.empty(1024 ** 4, dtype=torch.uint8, device="cuda")
        raised = False
    except torch.cuda.OutOfMemoryError:
        raised = True
    total = torch.cuda.get_device_properties(0).total_memory
    device, alloc, device_total, device_free = calls[0]
    print(json.dumps({"raised": raised, "calls": len(calls), "device": device, "alloc": alloc,
                      "total_ok": device_total == total, "free_ok": 0 <= device_free <= total}))
    """)
    assert native == ours
    assert ours == {"raised": True, "calls": 1, "device": 0, "alloc": 1024 ** 4, "total_ok": True, "free_ok": True}


def test_snapshot_on_oom_recipe_from_pytorch_docs(tmp_path):
    path = tmp_path / "oom_snapshot.pickle"
    native, ours = _both(f"""
    import pickle
    torch.cuda.memory._record_memory_history(max_entries=1000)
    def oom_observer(device, alloc, device_alloc, device_free):
        snapshot = torch.cuda.memory._snapshot()
        pickle.dump(snapshot, open({str(path)!r}, "wb"))
    torch._C._cuda_attach_out_of_memory_observer(oom_observer)
    keep = torch.empty(7 * {MiB} + 512, dtype=torch.uint8, device="cuda")
    try:
        torch.empty(1024 ** 4, dtype=torch.uint8, device="cuda")
    except torch.OutOfMemoryError:
        pass
    snap = pickle.load(open({str(path)!r}, "rb"))
    sizes = [b["requested_size"] for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    print(json.dumps({{"has_keep": 7 * {MiB} + 512 in sizes}}))
    """)
    assert native == ours == {"has_keep": True}


DUMMY_ALLOCATOR = r"""
#include <cuda_runtime_api.h>
#include <stddef.h>
extern "C" {
int alloc_calls = 0;
int free_calls = 0;
/* the ranges freed so far (the first 64): a test checks that none held a live tensor */
unsigned long long freed_begin[64];
unsigned long long freed_end[64];
void* dummy_alloc(size_t size, int device, void* stream) {
  void* ptr = NULL;
  alloc_calls += 1;
  return cudaMalloc(&ptr, size) == cudaSuccess ? ptr : NULL;
}
void dummy_free(void* ptr, size_t size, int device, void* stream) {
  if (free_calls < 64) {
    freed_begin[free_calls] = (unsigned long long)ptr;
    freed_end[free_calls] = (unsigned long long)ptr + size;
  }
  free_calls += 1;
  cudaFree(ptr);
}
}
"""


def _dummy_allocator_library(tmp_path):
    nvcc = shutil.which("nvcc") or os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "bin", "nvcc")
    if not os.path.exists(nvcc):
        pytest.skip("nvcc is needed to build the dummy allocator library")
    source = tmp_path / "dummy_allocator.cu"
    source.write_text(DUMMY_ALLOCATOR)
    library = tmp_path / "libdummy_allocator.so"
    subprocess.run([nvcc, "-shared", "-Xcompiler", "-fPIC", str(source), "-o", str(library)], check=True)
    return str(library)


def test_mempool_with_a_users_allocator_reaches_it_and_frees_after_delete(tmp_path):
    library = _dummy_allocator_library(tmp_path)
    native, ours = _both(f"""
    import ctypes, gc
    lib = ctypes.CDLL({library!r})
    allocs = ctypes.c_int.in_dll(lib, "alloc_calls")
    frees = ctypes.c_int.in_dll(lib, "free_calls")
    allocator = torch.cuda.memory.CUDAPluggableAllocator({library!r}, "dummy_alloc", "dummy_free")
    def make():
        pool = torch.cuda.MemPool(allocator.allocator())
        with torch.cuda.use_mem_pool(pool):
            x = torch.arange(1024 * 1024 * 2, device="cuda")
        return x
    x = make()  # the pool is gone; x lives on
    outside = torch.ones(10, device="cuda")  # not the pool's: never reaches the dummy
    allocs_after_use = allocs.value
    del allocator
    gc.collect()
    frees_while_live = frees.value
    begins = (ctypes.c_ulonglong * 64).in_dll(lib, "freed_begin")
    ends = (ctypes.c_ulonglong * 64).in_dll(lib, "freed_end")
    x_freed = any(begins[i] <= x.data_ptr() < ends[i] for i in range(min(frees_while_live, 64)))
    ok = bool((x[-1] == 1024 * 1024 * 2 - 1).item()) and outside.sum().item() == 10
    del x
    gc.collect()
    torch.cuda.empty_cache()
    print(json.dumps({{"used": allocs_after_use >= 1, "frees_while_live": frees_while_live, "ok": ok,
                       "allocs_after_use": allocs_after_use, "x_freed": x_freed,
                       "all_freed": frees.value == allocs.value}}))
    """)
    # torchmem calls the user's allocator once per block (native: once per segment it
    # carves), so any other block allocated in the pool's context is allocated and freed
    # through it too (on the H200: 2 calls and 1 free while x lived). What
    # must hold: the block under x is never given back while x lives (the dummy records
    # every range it freed), and x still reads right after the pool and allocator are gone.
    assert not ours["x_freed"] and ours["frees_while_live"] < ours["allocs_after_use"], ours
    for key in ("used", "ok", "all_freed"):
        assert native[key] == ours[key] is True, (native, ours)


def test_oom_messages_use_torchs_wording():
    native, ours = _both("""
    def message(n):
        try:
            torch.empty(n, dtype=torch.int8, device="cuda")
        except torch.OutOfMemoryError as e:
            return str(e)
        return ""
    huge = message(1024 * 1024 * 1024 * 800000000)
    absurd = message(1024 * 1024 * 1024 * 8000000000)
    print(json.dumps({
        "huge": huge.startswith("CUDA out of memory. Tried to allocate 800000000.00 GiB. GPU 0 has a total capacity of"),
        "absurd": absurd.startswith("CUDA out of memory. Tried to allocate more than 1EB memory"),
        "still_works": torch.ones(4, device="cuda").sum().item()}))
    """)
    assert native == ours == {"huge": True, "absurd": True, "still_works": 4.0}


def test_install_does_not_initialize_cuda():
    native, ours = _both("""
    import ctypes
    count = ctypes.c_int(-1)
    rc = ctypes.CDLL("libcuda.so.1").cuDeviceGetCount(ctypes.byref(count))
    print(json.dumps({"rc": rc, "initialized": torch.cuda.is_initialized()}))
    """)
    assert native == ours == {"rc": 3, "initialized": False}  # 3 = CUDA_ERROR_NOT_INITIALIZED


def test_visible_devices_set_after_install_still_count():
    native, ours = _both("""
    os.environ["CUDA_VISIBLE_DEVICES"] = "32"
    print(json.dumps({"count": torch.cuda.device_count()}))
    """)
    assert native == ours == {"count": 0}


def test_forked_child_uses_cuda_through_torchmem():
    native, ours = _both("""
    import multiprocessing
    def worker(conn):
        try:
            x = torch.ones(10, device="cuda")
            installed = False
            if "torchmem" in sys.modules:
                installed = sys.modules["torchmem"].is_installed() and sys.modules["torchmem"].memory_allocated() > 0
            conn.send({"sum": x.sum().item(), "torchmem_serves": installed})
        except Exception as e:
            conn.send({"error": str(e)})
        conn.close()
    torch.randn(10).is_pinned()
    parent, child = multiprocessing.get_context("fork").Pipe()
    p = multiprocessing.get_context("fork").Process(target=worker, args=(child,))
    p.start()
    got = parent.recv()
    p.join()
    got["torchmem_serves"] = got.get("torchmem_serves", False) or "torchmem" not in sys.modules
    print(json.dumps(got))
    """)
    assert native == ours == {"sum": 10.0, "torchmem_serves": True}


GRAPH_STATS = """
import gc
stats = ("active.", "active_bytes.", "allocation.", "allocated_bytes.")
s = torch.cuda.Stream()
out = {}
for numel, kind in (((1048576 + 512) // 4, "large_pool"), (((10485760 + 512) // 4), "large_pool")):
    g = torch.cuda.CUDAGraph()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        a = torch.ones((numel,), device="cuda")
        pre = torch.cuda.memory_stats()
        g.capture_begin()
        b = a.clone()
        for _ in range(5):
            b = b.clone() + 1
        g.capture_end()
    torch.cuda.current_stream().wait_stream(s)
    gc.collect()
    post = torch.cuda.memory_stats()
    deltas = {name + kind: post[name + kind + ".current"] - pre[name + kind + ".current"] for name in stats}
    g.replay()
    value = b.sum().item()
    del g
    gc.collect()
    after_destroy = torch.cuda.memory_stats()["active." + kind + ".current"] - pre["active." + kind + ".current"]
    out[str(numel)] = {"deltas": deltas, "value": value, "after_destroy": after_destroy}
    del a, b
    gc.collect()
print(json.dumps(out))
"""


def test_graph_capture_stats_deltas_match_native():
    native, ours = _both(GRAPH_STATS)
    assert native == ours
    for numel, result in ours.items():
        assert result["deltas"]["active.large_pool"] == 1
        assert result["deltas"]["active_bytes.large_pool"] == int(numel) * 4


def test_history_context_skip_actions_and_metadata_answer_like_native():
    # PyTorch's test_memory_plots_free_stack, ..._free_segment_stack, ..._metadata and
    # test_memory_snapshot_skip_actions, in one snippet.
    native, ours = _both("""
    seen = {}
    def thealloc():
        return torch.rand(3, 4, device="cuda")
    def thefree(x):
        del x
    for context in ("alloc", "all", "state"):
        torch.cuda.memory.empty_cache()
        torch.cuda.memory._record_memory_history(context=context)
        thefree(thealloc())
        y = torch.rand(3, 4, device="cuda")
        del y
        torch.cuda.memory.empty_cache()
        ss = json.dumps(torch.cuda.memory._snapshot())
        seen[context] = ["thefree" in ss, "thealloc" in ss, "empty_cache" in ss]
        torch.cuda.memory._record_memory_history(None)
    has_metadata = hasattr(torch.cuda.memory, "_set_memory_metadata")
    if has_metadata:
        torch.cuda.memory._set_memory_metadata("metadata test")
    torch.cuda.memory._record_memory_history(context="all", skip_actions=["free_requested"])
    z = torch.rand(128, 128, device="cuda")
    del z
    events = torch.cuda.memory._snapshot()["device_traces"][0]
    if has_metadata:
        torch.cuda.memory._set_memory_metadata("")
    torch.cuda.memory._record_memory_history(None)
    actions = sorted({e["action"] for e in events})
    metadata_ok = all(e.get("user_metadata") == "metadata test" for e in events) if has_metadata else True
    print(json.dumps({"seen": seen, "skipped": "free_requested" not in actions and len(actions) > 0,
                      "metadata_ok": metadata_ok}))
    """)
    assert ours == native, (native, ours)
    assert ours["seen"]["all"][:2] == [True, True] and ours["seen"]["state"][:2] == [False, False]


def test_profiler_sees_cuda_memory_like_native():
    # PyTorch's test_memory_profiler_viz: torch.profiler(profile_memory=True) hears of every block.
    native, ours = _both("""
    from torch.cuda._memory_viz import _profile_to_snapshot
    with torch.profiler.profile(with_stack=True, profile_memory=True, record_shapes=True) as prof:
        x = torch.rand(128, 128, device="cuda")
        x * x + x * x
    plot = json.dumps(_profile_to_snapshot(prof))
    device_bytes = sum(max(0, e.self_device_memory_usage) for e in prof.key_averages())
    print(json.dumps({"category": "category" in plot, "any_device_memory": device_bytes > 0}))
    """)
    assert ours == native == {"category": True, "any_device_memory": True}, (native, ours)
