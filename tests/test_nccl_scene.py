"""The NCCL scene's own arithmetic, without a GPU: its collectives case over gloo on the CPU, in
a world of two ranks, must find every expected value. So when a check fails on the GPU under
torchmem (tests/gpu/test_gpu_nccl.py), the memory is wrong, not the expectation."""

import json
import os
import subprocess
import sys

from support import REPO

SCENE = os.path.join(REPO, "tests", "gpu", "nccl_scene.py")


def test_the_collectives_scenes_expected_values_hold_over_gloo(tmp_path):
    store = str(tmp_path / "store")
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    procs = [subprocess.Popen([sys.executable, SCENE, "gloo", "collectives", str(rank), "2", store], cwd=REPO,
                              env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for rank in range(2)]
    for rank, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=300)
        report = json.loads(stdout.strip().splitlines()[-1])
        assert report["ok"] and report["rank"] == rank, (report, stderr[-3000:])
        assert len(report["checks"]) == 12 and all(report["checks"].values()), report["checks"]
