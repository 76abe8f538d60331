"""On a GPU: a process with torchmem installed publishes its figures, `top` and a Prometheus
scrape see them from other processes, and two processes share one GPU elastically (the owner
gets its share back from a borrower without an OOM, within a second). Every torchmem process
runs in its own interpreter (the allocator swap is once per process)."""

import json
import os
import subprocess
import sys
import time
import urllib.request

import pytest

from support import REPO

pytestmark = pytest.mark.gpu

HOLDER = r"""
import sys, torch, torchmem
torchmem.install()
x = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
y = torch.empty(256 << 20, dtype=torch.uint8, device="cuda"); del y
print("ready", flush=True)
sys.stdin.read()
"""


def _spawn(code, env):
    return subprocess.Popen([sys.executable, "-c", code], cwd=REPO, env=dict(os.environ, **env), text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc):
    out, err = proc.communicate(timeout=120)  # closes stdin: the holder's read() returns
    assert proc.returncode == 0, err
    return out


def test_installed_process_publishes_top_and_metrics_see_it(tmp_path):
    port = 19400 + os.getpid() % 500
    env = {"TORCHMEM_MONITOR_DIR": str(tmp_path), "TORCHMEM_CONF": f"metrics_port={port}"}
    proc = _spawn(HOLDER, env)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()
        time.sleep(1.0)  # one publishing interval
        out = subprocess.run([sys.executable, "-m", "torchmem", "top", "--json"], cwd=REPO,
                             env=dict(os.environ, **env), capture_output=True, text=True, timeout=120, check=True)
        snapshot = json.loads(out.stdout)
        rows = [(d, p) for d in snapshot["devices"] for p in d["processes"] if p["pid"] == proc.pid]
        assert len(rows) == 1, snapshot
        device, row = rows[0]
        assert row["live_bytes"] >= 1 << 30
        assert row["reserved_bytes"] >= row["live_bytes"] and row["cached_bytes"] >= 256 << 20
        assert row["device_total_bytes"] > row["reserved_bytes"]
        if device["nvml"] is not None:  # nvidia-ml-py present: NVML's totals beside torchmem's
            assert device["nvml"]["used"] >= row["reserved_bytes"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            text = response.read().decode()
        line = next(l for l in text.splitlines() if l.startswith("torchmem_live_bytes{"))
        assert f'pid="{proc.pid}"' in line and float(line.split()[-1]) >= 1 << 30
    finally:
        _finish(proc)
    assert not os.path.exists(os.path.join(tmp_path, f"{proc.pid}.rec"))


TENANT = r"""
import json, sys, time, torch, torchmem
from torchmem._loader import _C
torchmem.install()
total = torch.cuda.get_device_properties(0).total_memory
GiB = 1 << 30
role = sys.argv[1]
held, waits, crashed, max_live = [], [], None, 0
x = torch.empty(GiB, dtype=torch.uint8, device="cuda"); held.append(x)
print("ready", flush=True)
if role == "borrower":
    import select
    target, told, deadline = int(0.85 * total), False, time.monotonic() + 120
    while time.monotonic() < deadline and not select.select([sys.stdin], [], [], 0)[0]:
        limit = _C.runtime_limit(0)
        if limit and torchmem.memory_allocated() > limit:  # the controller's shrink at the next step
            while held and torchmem.memory_allocated() > limit:
                held.pop()
        elif torchmem.memory_allocated() + GiB <= target:
            try:
                held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
            except torch.OutOfMemoryError:
                pass  # at its limit: it stays at this size, as a controller would
        max_live = max(max_live, torchmem.memory_allocated())
        if not told and max_live >= 0.6 * total:
            print("borrowing", flush=True)
            told = True
        time.sleep(0.05)
else:
    sys.stdin.readline()  # the test says: claim your share now
    while torchmem.memory_allocated() + GiB <= int(0.45 * total):
        t0 = time.monotonic()
        try:
            held.append(torch.empty(GiB, dtype=torch.uint8, device="cuda"))
        except torch.OutOfMemoryError as exc:
            crashed = str(exc)[:300]
            break
        waits.append(time.monotonic() - t0)
print(json.dumps({"role": role, "waits": waits, "crashed": crashed, "max_live": max_live, "total": total,
                  "live": torchmem.memory_allocated(), "limit": _C.runtime_limit(0)}), flush=True)
"""


def test_two_processes_share_one_gpu(tmp_path):
    env = {"TORCHMEM_MONITOR_DIR": str(tmp_path), "TORCHMEM_CONF": "share=gputest,guarantee=48%"}
    owner = _spawn(TENANT.replace("sys.argv[1]", '"owner"'), env)
    borrower = _spawn(TENANT.replace("sys.argv[1]", '"borrower"'), env)
    try:
        assert owner.stdout.readline().strip() == "ready", owner.stderr.read()
        assert borrower.stdout.readline().strip() == "ready", borrower.stderr.read()
        assert borrower.stdout.readline().strip() == "borrowing", borrower.stderr.read()
        owner.stdin.write("claim\n")
        owner.stdin.flush()
        owner_result = json.loads(owner.stdout.readline())
        borrower.stdin.write("stop\n")
        borrower.stdin.flush()
        borrower_result = json.loads(borrower.stdout.readline())
    finally:
        for p in (owner, borrower):
            if p.poll() is None:
                p.stdin.close()
                p.wait(timeout=60)
    assert owner_result["crashed"] is None, owner_result
    assert max(owner_result["waits"]) < 1.0, owner_result["waits"]
    assert borrower_result["max_live"] >= 0.6 * borrower_result["total"]  # it had borrowed past its 48%
    assert owner_result["live"] + (1 << 30) > 0.45 * owner_result["total"]  # the owner got its share
    # it follows its limit within one of its steps (one 1 GiB tensor)
    assert borrower_result["live"] <= borrower_result["limit"] + (1 << 30)
