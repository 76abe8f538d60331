"""On a GPU: CUDA IPC (Note [CUDA IPC], csrc/shim/ipc.cpp). torch.multiprocessing sends
CUDA tensors from a producer to a spawned consumer (ipc_scene.py): every value arrives,
a write in the consumer is seen by the producer, and the producer frees and empties its
cache afterwards without a fault. torchmem to torchmem on the vmm backend (granule
handles exported as file descriptors); on the cuda_malloc backend PyTorch's own handle
format, which a native consumer opens; a native producer's handles open under torchmem.
A vmm handle sent to a native consumer fails there with torch's own error."""

import json
import os
import subprocess
import sys

import pytest

from support import REPO

pytestmark = pytest.mark.gpu

SCENE = os.path.join(REPO, "tests", "gpu", "ipc_scene.py")


def run_scene(producer, consumer, conf=""):
    """`conf`: TORCHMEM_CONF of both processes (spawn passes the environment on)."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TORCHMEM_CONF=conf)
    proc = subprocess.run([sys.executable, SCENE, producer, consumer], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_shared(out):
    shown = json.dumps(out)  # pytest shortens a dict in the message
    assert "error" not in out["reply"], shown
    assert out["reply"]["data_ok"], shown
    assert out["write_seen"], shown
    assert out["consumer_exit"] == 0, shown
    assert out["allocated_after"] == 0, shown  # nothing left once the consumer let go


@pytest.fixture(scope="module")
def vmm_scene():
    """torchmem to torchmem on the vmm backend, run once for the two tests that read it."""
    return run_scene("torchmem", "torchmem")


def test_torchmem_to_torchmem_on_vmm(vmm_scene):
    out = vmm_scene
    assert_shared(out)
    assert out["reply"]["installed"]


def test_a_handle_opens_in_the_process_that_made_it(vmm_scene):
    # Descriptors are duplicated (dup), not taken over with pidfd_getfd, and the round
    # trip skips torch's own cudaIpcOpenEventHandle, which no process can do on its own
    # event (see ipc_scene.same_process_round_trip).
    out = vmm_scene
    assert out["same_process"] == {"ok": True, "distinct": True}, json.dumps(out)


def test_cuda_malloc_backend_speaks_pytorchs_format_both_ways():
    assert_shared(run_scene("torchmem", "native", conf="backend=cuda_malloc"))
    assert_shared(run_scene("torchmem", "torchmem", conf="backend=cuda_malloc"))


def test_a_native_producers_tensors_open_under_torchmem():
    assert_shared(run_scene("native", "torchmem"))


def test_a_vmm_handle_sent_to_a_native_consumer_fails_there_not_silently():
    out = run_scene("torchmem", "native")
    assert "shareable handle" in out["reply"].get("error", ""), json.dumps(out)
