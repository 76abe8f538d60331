"""bench/fsdp_workload.py on the CPU: two ranks over gloo train a tiny Llama under FSDP2 with the
BatchSizeController on each, and report the same losses and micro-batches (the ranks agree);
the sweep's table compares a run's losses with native's at the same budget."""

import json
import os
import socket
import subprocess
import sys

import pytest

from bench_support import REPO, load_bench

pytest.importorskip("transformers")
SCRIPT = os.path.join(REPO, "bench", "fsdp_workload.py")
TINY = ["--device", "cpu", "--allocator", "native", "--steps", "2", "--layers", "2", "--hidden", "64",
        "--seq", "16", "--vocab", "256", "--global-batch", "8"]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch_two_ranks(args):
    """Each rank's last stdout line (its JSON report). The port is found free, then released
    before rank 0 binds it; if another process took it meanwhile, launch again on a new one."""
    for _attempt in range(3):
        env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
                   OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
        procs = [subprocess.Popen([sys.executable, SCRIPT, *args], cwd=REPO,
                                  env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                 for rank in range(2)]
        outputs = [proc.communicate(timeout=300) for proc in procs]
        if any("address already in use" in err.lower() for _, err in outputs):
            continue
        for proc, (_, stderr) in zip(procs, outputs):
            assert proc.returncode == 0, stderr[-4000:]
        return [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in outputs]
    pytest.fail("three ports in a row were taken before rank 0 bound them")


def test_two_ranks_train_under_fsdp2_with_the_controller():
    reports = launch_two_ranks([*TINY, "--controller", "--micro-batch", "2"])
    r0, r1 = reports
    assert (r0["rank"], r1["rank"], r0["world"]) == (0, 1, 2)
    assert len(r0["losses"]) == 2 and r0["losses"] == r1["losses"]  # all-reduced: one number per step
    assert all(4.0 < loss < 7.0 for loss in r0["losses"])  # ln(256) = 5.5 at random weights
    # the ranks agree on every step's micro-batch (the controller times a neighbouring split too)
    assert r0["micro_batches"] == r1["micro_batches"] and r0["micro_batches"][0] == 2 and r0["oom"] is None
    assert r0["params"] == r1["params"] > 0 and len(r0["step_s"]) == 2


def test_sweep_table_compares_losses_with_native():
    bench = load_bench("fsdp_workload")
    run = {"rank": 0, "losses": [2.0, 1.0], "micro_batches": [8, 8], "median_step_s": 0.5, "tokens_per_s": 100.0,
           "peak_reserved": 2 << 30, "counters": {"num_device_alloc": 7}, "oom": None}
    text = bench.table([(0.2, "native", [run]), (0.2, "torchmem", [dict(run, losses=[2.0, 1.001])]),
                        (0.2, "expandable", [])])
    native, mine, missing = text.splitlines()[1:]
    assert native.split()[-1] == "-" and "2.00" in native
    assert mine.split()[-1] == "1.00e-03" and "no report" in missing


def test_budgets_are_multiples_of_the_largest_ranks_peak_request():
    bench = load_bench("fsdp_workload")
    ranks = [{"peak_allocated": 10 << 30, "device_total": 100 << 30, "oom": None},
             {"peak_allocated": 12 << 30, "device_total": 100 << 30, "oom": None}]
    assert bench.budget_fractions(ranks, [1.05, 1.10, 20.0]) == pytest.approx([0.126, 0.132, 1.0])
    with pytest.raises(SystemExit, match="no peak request"):
        bench.budget_fractions([dict(ranks[0], oom="CUDA out of memory")], [1.05])


def test_sweep_falls_back_to_smaller_micro_batches_and_compares_time_per_sample(tmp_path, monkeypatch, capsys):
    """A run that runs out of memory is run again at each fallback micro-batch until one fits;
    the peak-request run never falls back (its micro-batch defines the budgets); torchmem's time
    per sample at its larger micro-batch is set beside the other allocator's at its own largest."""
    bench = load_bench("fsdp_workload")
    calls = []

    def fake_run(cmd, **kwargs):
        allocator = cmd[cmd.index("--allocator") + 1]
        frac = float(cmd[cmd.index("--limit-frac") + 1])
        micro = int([cmd[i + 1] for i, a in enumerate(cmd) if a == "--micro-batch"][-1])
        calls.append((allocator, frac, micro))
        fits = frac == 1.0 or allocator == "torchmem" or micro <= 4
        report = {"rank": 0, "global_batch": 32, "losses": [2.0] if fits else [], "oom": None if fits else "OOM",
                  "micro_batches": [micro] if fits else [], "median_step_s": (0.64 if micro == 8 else 0.8)
                  if fits else None, "tokens_per_s": 1.0, "peak_reserved": 1 << 30, "peak_allocated": 10 << 30,
                  "device_total": 100 << 30, "counters": {}}
        return subprocess.CompletedProcess(cmd, 0 if fits else 3, stdout=json.dumps(report) + "\n", stderr="")

    monkeypatch.setattr(bench.subprocess, "run", fake_run)
    assert bench.sweep(["--allocators", "torchmem", "native", "--budgets", "1.05", "--fallback-micro-batches",
                        "6", "4", "2", "--out", str(tmp_path / "f.jsonl"), "--micro-batch", "8"]) == 0
    assert [(a, m) for a, _, m in calls] == [("native", 8), ("torchmem", 8), ("native", 8), ("native", 6),
                                             ("native", 4)]
    out = capsys.readouterr().out
    assert "1.05x: torchmem at micro-batch 8 20.00 ms/sample, native at its largest that fits, 4, " \
           "25.00 ms/sample: 0.800x" in out
