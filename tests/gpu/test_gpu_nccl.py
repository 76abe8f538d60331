"""On a GPU: NCCL on torchmem's memory. Each scene (nccl_scene.py) runs every rank in its own
interpreter (the allocator swap is once per process) in a world of one rank, which one GPU
can hold, and in a world of two where the machine has two GPUs. Each test checks values,
not just that a call returned: every element depends on its index, rank and tensor.

Where a scene may legitimately fail under torchmem, it must fail at once, with a message that
names the option to change; where it fails on PyTorch's own allocator too (an old torch or
NCCL, a GPU without the feature), the test is skipped with that error as its reason.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

from support import REPO

pytestmark = pytest.mark.gpu

SCENE = os.path.join(REPO, "tests", "gpu", "nccl_scene.py")
HOOK = "TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK"


def _worlds():
    two = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2,
                             reason="a world of two ranks needs two GPUs (NCCL refuses two ranks on one GPU)")
    return [1, pytest.param(2, marks=two)]


def run_world(tmp_path, mode, case, world=1, env=None, timeout=300):
    """Runs the scene's ranks at once and returns rank 0's report (every rank's under "ranks")."""
    init_file = tmp_path / f"store-{mode}-{case}-{world}"
    full_env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHMEM_MONITOR_DIR=str(tmp_path / "records"))
    full_env.update(env or {})
    procs = [subprocess.Popen([sys.executable, SCENE, mode, case, str(rank), str(world), str(init_file)],
                              cwd=REPO, env=full_env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank in range(world)]
    reports = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            lines = [line for line in stdout.splitlines() if line.startswith("{")]
            assert proc.returncode == 0 and lines, (
                f"{mode} {case} rank {len(reports)} exited {proc.returncode} without a report (a fault?)\n"
                f"--- stdout ---\n{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}")
            reports.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    report = dict(reports[0], ranks=reports)
    if mode == "torchmem":
        assert report.get("installed"), json.dumps(report)[:4000]
    return report


def assert_all_right(report, prefix=""):
    """Every rank finished and every value check (with `prefix`) holds."""
    shown = json.dumps({k: v for k, v in report.items() if k != "ranks"})[:6000]
    for rank_report in report["ranks"]:
        assert rank_report["ok"], shown + "\n" + str(rank_report.get("traceback"))
        checks = {k: v for k, v in rank_report["checks"].items() if k.startswith(prefix)}
        assert checks and all(checks.values()), f"rank {rank_report['rank']}: {checks}\n{shown}"


def native_or_skip(tmp_path, case, world=1, env=None):
    """The scene on PyTorch's allocator: a failure there is torch's, NCCL's or the GPU's, so the
    torchmem test is skipped with it as the reason."""
    native = run_world(tmp_path, "native", case, world, env)
    if not native["ok"]:
        pytest.skip(f"fails on PyTorch's own allocator too (torch {native.get('torch')}, NCCL {native.get('nccl')}), "
                    f"at {native['phase']}: {native['error']}")
    if native.get("skipped"):
        pytest.skip(native["skipped"])
    return native


@pytest.mark.parametrize("world", _worlds())
def test_collectives_on_torchmems_pool(tmp_path, world):
    """all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor on tensors of
    torchmem's pool (its small heap, a block over the small threshold, a several-granule block,
    a view 12 bytes into a block, bf16) give exactly the expected values on every rank; and an
    async all_gather's input, dropped at once while NCCL's stream lags behind a sleep, is not
    handed out again before NCCL read it (a reused block would put -1s into the output)."""
    report = run_world(tmp_path, "torchmem", "collectives", world)
    assert_all_right(report)
    assert report["checks"]["freed_input_not_reused_early"]


@pytest.mark.parametrize("world", _worlds())
def test_tensor_register_allocator_hook_works_or_fails_at_once_naming_it(tmp_path, world):
    """With TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1, torch's NCCL process group attaches
    trace trackers to the allocator when it is constructed, to register every segment with
    NCCL. Under torchmem either the collectives still give the right values, or
    init_process_group fails at once (before any collective) with a message naming
    TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK."""
    env = {HOOK: "1"}
    native_or_skip(tmp_path, "register_hook", world, env)
    report = run_world(tmp_path, "torchmem", "register_hook", world, env)
    if report["ok"]:
        assert_all_right(report)
        return
    assert report["phase"] == "init", f"failed late, at {report['phase']}: {report['error']}"
    assert HOOK in report["error"], f"the message does not name {HOOK}: {report['error']}"


def test_mempool_over_nccls_allocator(tmp_path):
    """torch.cuda.MemPool(backend.mem_allocator): NCCL's own allocator (ncclMemAlloc) under a
    torchmem pool. Tensors made in it lie in the pool's segments and every collective on them
    is right. Registering the pool with NCCL (register_mem_pool, which also attaches torch's
    allocator trace trackers) either works, and the collectives on registered memory are right,
    or fails at once naming what to change."""
    native = native_or_skip(tmp_path, "nccl_mempool")
    report = run_world(tmp_path, "torchmem", "nccl_mempool")
    if report.get("skipped"):
        pytest.skip(report["skipped"])
    assert report["checks"].get("pool_tensors_in_pools_segments"), json.dumps(report)[:4000]
    assert all(v for k, v in report["checks"].items() if k.startswith("pool_")), report["checks"]
    if report["ok"]:
        assert_all_right(report, "registered_")
        return
    assert report["phase"] == "register" and "registered_all_reduce_1024" in native["checks"], (
        f"failed at {report['phase']}: {report['error']}")
    assert HOOK in report["error"] or "register_mem_pool" in report["error"], (
        f"register_mem_pool failed without naming what to change: {report['error']}")


@pytest.mark.parametrize("implicit_pool", ["1", "0"])
def test_symmetric_memory(tmp_path, implicit_pool):
    """torch's symmetric memory under torchmem: symm_mem.empty tensors (through torch's implicit
    MemPool over the symmetric allocator with TORCH_SYMMMEM_IMPLICIT_POOL=1, where torch has it;
    straight from that allocator with 0), rendezvous, each peer's buffer read back with the
    values it wrote, and one_shot_all_reduce's sum where it runs natively. A failure must name
    what to change."""
    env = {"TORCH_SYMMMEM_IMPLICIT_POOL": implicit_pool}
    native = native_or_skip(tmp_path, "symm_mem", env=env)
    report = run_world(tmp_path, "torchmem", "symm_mem", env=env)
    if report["ok"]:
        assert report["checks"]["symm_peer_buffers"], report["checks"]
        if "symm_one_shot_all_reduce" in native["checks"]:
            assert report["checks"].get("symm_one_shot_all_reduce"), json.dumps(report)[:4000]
        return
    named = ("TORCH_SYMMMEM_IMPLICIT_POOL", "backend=cuda_malloc")
    assert any(n in report["error"] for n in named), (
        f"failed at {report['phase']} without naming what to change: {report['error']}\n{report.get('traceback')}")
