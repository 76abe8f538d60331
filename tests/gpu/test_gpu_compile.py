"""torch.compile(mode="reduce-overhead") under torchmem: CUDA graph trees record
into torchmem's private pools and restore their checkpoints
(csrc/shim/checkpoint.cpp, csrc/core/detail/checkpoint.cpp).

Each test installs torchmem in a fresh interpreter (tests/support.py run_python).
The checkpoint tests follow PyTorch's TestBlockStateAbsorption (test/test_cuda.py)
with torch's own liveness check (_cuda_checkPoolLiveAllocations) where that test
reads memory snapshots. PyTorch's class itself runs when TORCHMEM_TORCH_TEST_CUDA
names a copy of test/test_cuda.py.
"""

import json
import os
import textwrap

import pytest

from support import run_python

pytestmark = pytest.mark.gpu

PRELUDE = """
import gc, json, warnings
import torch
import torchmem
torchmem.install()
assert torchmem.is_installed()

def cudagraphify(fn, inputs, pool=None):
    # As PyTorch's test_cuda.py: warm up on a side stream, then capture.
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(*inputs)
    stream.synchronize()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream, pool=pool):
        outputs = fn(*inputs)
    return graph, outputs

def live(pool, ptrs):
    return torch._C._cuda_checkPoolLiveAllocations(0, pool, set(ptrs))

def restore(state, stale=(), deleters=()):
    torch._C._cuda_setCheckpointPoolState(
        0, state, [t.untyped_storage()._cdata for t in stale], [t.untyped_storage()._cdata for t in deleters])
"""


def script(body):
    """PRELUDE, then `body` dedented (it would otherwise continue PRELUDE's last function)."""
    return PRELUDE + textwrap.dedent(body)


def _last_json(proc):
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_checkpoint_restores_dead_outputs_and_torch_frees_them_by_address():
    run_python(script("""
    def foo():
        return torch.ones([512], device="cuda", dtype=torch.uint8), torch.ones([3 << 20], device="cuda", dtype=torch.uint8)
    graph, outputs = cudagraphify(foo, [])
    pool = graph.pool()
    ptrs = [o.data_ptr() for o in outputs]
    assert live(pool, ptrs) and not live(pool, ptrs[:1]) and not live(pool, ptrs + [0])
    state = torch._C._cuda_getCheckpointState(0, pool)
    del outputs
    assert live(pool, [])
    restore(state)
    assert live(pool, ptrs)  # both back, at their addresses
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[0])
    assert live(pool, ptrs[1:])
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[1])
    assert live(pool, [])
    graph.replay()  # the graph still owns its memory
    torch.cuda.synchronize()
    """))


def test_checkpoint_gives_deleters_to_reconstructed_outputs():
    run_python(script("""
    def foo(x):
        return (torch.ones([512], device="cuda", dtype=torch.uint8) + x,
                torch.ones([512], device="cuda", dtype=torch.uint8) + x,
                torch.ones([3 << 20], device="cuda", dtype=torch.uint8) + x)
    inp = torch.tensor([1], device="cuda", dtype=torch.uint8)
    graph, outputs = cudagraphify(foo, [inp])
    pool = graph.pool()
    graph.replay()
    state = torch._C._cuda_getCheckpointState(0, pool)
    meta = [(o.untyped_storage().data_ptr(), o.untyped_storage().nbytes(), o.shape) for o in outputs]
    del outputs
    assert live(pool, [])
    # Tensors over the graph's memory without deleters, as graph trees make them.
    rebuilt = []
    for ptr, nbytes, shape in meta:
        storage = torch._C._construct_storage_from_data_pointer(ptr, torch.device("cuda", 0), nbytes)
        t = torch.empty([0], device="cuda", dtype=torch.uint8)
        t.set_(source=storage, storage_offset=0, size=shape, stride=(1,))
        rebuilt.append(t)
    inp.add_(1)
    graph.replay()
    torch.cuda.synchronize()
    assert all(float(t.float().mean()) == 3 for t in rebuilt)
    restore(state, deleters=rebuilt[:2])
    ptrs = [m[0] for m in meta]
    assert live(pool, ptrs)
    rebuilt[0] = None
    assert live(pool, ptrs[1:])
    rebuilt[1] = None
    assert live(pool, ptrs[2:])
    rebuilt[2] = None  # not given a deleter: its block stays until freed by address
    assert live(pool, ptrs[2:])
    torch._C._cuda_cudaCachingAllocator_raw_delete(ptrs[2])
    assert live(pool, [])
    """))


def test_checkpoint_frees_stale_outputs_of_a_later_graph():
    run_python(script("""
    foo = lambda: (torch.ones([512], device="cuda", dtype=torch.uint8),)
    graph, outputs = cudagraphify(foo, [])
    pool = graph.pool()
    state = torch._C._cuda_getCheckpointState(0, pool)
    graph2, outputs2 = cudagraphify(foo, [], pool=pool)
    assert outputs2[0].data_ptr() != outputs[0].data_ptr()
    restore(state, stale=outputs2)
    del outputs2  # its deleter was taken away: no double free
    assert live(pool, [outputs[0].data_ptr()])
    assert torchmem._C.runtime_stats(0)["failed_deleter_frees"] == 0
    """))


TRAIN = """
import json
import torch, torchmem
torchmem.install()
import torch._dynamo.utils as dutils
import torch._inductor.config as iconfig
import torch._inductor.cudagraph_trees as trees
iconfig.triton.slow_path_cudagraph_asserts = True  # torch checks pool liveness through torchmem
torch.manual_seed(0)

def make():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 256),
                               torch.nn.GELU(), torch.nn.Linear(256, 8)).cuda()

eager, compiled_model = make(), make()
compiled = torch.compile(compiled_model, mode="reduce-overhead")
opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
opt_c = torch.optim.SGD(compiled_model.parameters(), lr=0.05)
g = torch.Generator(device="cuda").manual_seed(1)
batches = [(torch.randn(32, 64, device="cuda", generator=g), torch.randn(32, 8, device="cuda", generator=g))
           for _ in range(6)]
loss_e, loss_c = [], []
for x, y in batches:
    torch.compiler.cudagraph_mark_step_begin()
    for model, opt, losses in ((eager, opt_e, loss_e), (compiled, opt_c, loss_c)):
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
# Serving: eval + no_grad records new graphs off the training tree.
eager.eval(); compiled_model.eval()
outs = []
with torch.no_grad():
    for i in range(4):
        torch.compiler.cudagraph_mark_step_begin()
        x = batches[i][0]
        outs.append(float((compiled(x) - eager(x)).abs().max()))
manager = trees.get_manager(0, create_if_none_exists=False)
# Recorded CUDA graphs (warm-up runs are not nodes of the tree).
graphs = sum(1 + root.num_descendants() for root in manager.get_roots()) if manager is not None else 0
print(json.dumps({"loss_e": loss_e, "loss_c": loss_c, "serve_diff": outs, "graphs": graphs,
                  "skips": dutils.counters["inductor"]["cudagraph_skips"],
                  "checkpoints": getattr(manager, "debug_checkpointing_counter", None),
                  "installed": torchmem.is_installed(),
                  "failed_frees": torchmem._C.runtime_stats(0)["failed_deleter_frees"]}))
"""


@pytest.mark.parametrize("conf", ["", "park_private_frees=true"])
def test_reduce_overhead_trains_and_serves_like_eager(conf):
    result = _last_json(run_python(TRAIN, timeout=900, env={"TORCHMEM_CONF": conf}))
    assert result["installed"] and result["failed_frees"] == 0
    assert result["skips"] == 0, "cudagraph trees fell back to eager"
    assert result["graphs"] >= 3, result  # recorded: forward, backward, inference
    for e, c in zip(result["loss_e"], result["loss_c"]):
        assert abs(e - c) <= 1e-3 * max(1.0, abs(e)), result
    # The compiled run follows eager's trajectory (the tiny model need not converge in 6 steps).
    assert (result["loss_c"][-1] < result["loss_c"][0]) == (result["loss_e"][-1] < result["loss_e"][0])
    assert max(result["serve_diff"]) < 1e-3, result


@pytest.mark.skipif(not os.environ.get("TORCHMEM_TORCH_TEST_CUDA"),
                    reason="set TORCHMEM_TORCH_TEST_CUDA to a copy of PyTorch's test/test_cuda.py")
@pytest.mark.parametrize("conf", ["", "park_private_frees=true"])
def test_pytorch_block_state_absorption_under_torchmem(conf):
    path = os.environ["TORCHMEM_TORCH_TEST_CUDA"]
    proc = run_python(f"""
    import sys, unittest
    import torch, torchmem
    torchmem.install()
    sys.argv = [sys.argv[0]]
    sys.path.insert(0, {os.path.dirname(path)!r})
    import importlib.util
    spec = importlib.util.spec_from_file_location("torch_test_cuda", {path!r})
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    suite = unittest.defaultTestLoader.loadTestsFromTestCase(module.TestBlockStateAbsorption)
    if {conf!r} == "park_private_frees=true":
        # parked frees are never reused by the pool, so its growths (segments) outnumber
        # PyTorch's four in this one test (31 on the H200); the layout checks still apply
        suite = unittest.TestSuite(t for t in suite if "allocate_in_thread_to_pool" not in t.id())
    result = unittest.TextTestRunner(verbosity=2).run(suite)
    assert torchmem.is_installed()
    sys.exit(0 if result.wasSuccessful() else 1)
    """, timeout=900, check=False,
    # PyTorch's tests expect the segment layout of its default (non-expandable) allocator:
    # torchmem's snapshots show one segment per growth (Note [Map groups]), as that one does.
    env={"TORCHMEM_CONF": conf})
    assert proc.returncode == 0, proc.stdout + proc.stderr
