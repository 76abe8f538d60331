"""Note [Budget rule] (csrc/shim/budget.h): the one rule every limit of a device goes
through, tested without torch, CUDA or a GPU: tests/cpp/budget_test.cpp builds a
Budget over a core Pool on a simulated device with plain g++ (as `make test-budget`)."""

import glob
import os
import shutil
import subprocess

import pytest

from support import REPO

CXX = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


@pytest.mark.skipif(CXX is None, reason="needs a C++17 compiler (g++)")
def test_budget_rule_on_a_simulated_device(tmp_path):
    sources = (["csrc/core/pool.cpp"] + sorted(glob.glob("csrc/core/detail/*.cpp", root_dir=REPO))
               + ["csrc/backend/sim_backend.cpp", "csrc/shim/budget.cpp", "tests/cpp/budget_test.cpp"])
    binary = tmp_path / "budget_test"
    subprocess.run([CXX, "-std=c++17", "-O1", "-pthread", "-Icsrc", *sources, "-o", str(binary)],
                   cwd=REPO, check=True, capture_output=True, text=True, timeout=600)
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stdout + proc.stderr
