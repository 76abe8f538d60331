"""bench/bench_table.py turns benchmark JSON lines into the Markdown tables of
BENCHMARKS.md; checked here on synthetic rows (the real ones come from the GPU)."""

import json
import os
import subprocess
import sys

from bench_support import REPO, load_bench


def row(workload, allocator, step, alloc=1000 << 20, reserved=1100 << 20):
    return {"workload": workload, "allocator": allocator, "peak_allocated": alloc, "peak_reserved": reserved,
            "device_used_peak": reserved + (50 << 20), "ratio": reserved / alloc, "median_step_s": step}


def test_tables_from_synthetic_results(tmp_path):
    rows = [row("gpt2", "native", 0.200, reserved=1630 << 20), row("gpt2", "native", 0.210, reserved=1630 << 20),
            row("gpt2", "torchmem", 0.190, reserved=1010 << 20), row("gpt2", "torchmem", 0.195, reserved=1010 << 20),
            {**row("vision", "native", 0.100), "host_speed": {"meta_s_per_alloc": 1.1e-6, "placement": {},
                                                                "launch_s": 4.25e-6, "cuda_s_per_alloc": 2.5e-6},
             "step_s": [0.1, 0.2, 0.1], "enqueue_s": [0.09, 0.05, 0.08], "allocs_per_step": [1200, 1300, 1250],
             "kernel_ms": [10.0, 12.5]},
            {"workload": "microbench", "allocator": "native", "mean_s_per_alloc": 2.7e-6,
             "rounds_s_per_alloc": [2.6e-6, 2.8e-6], "ratio": 1.1},
            {"workload": "microbench", "allocator": "torchmem", "mean_s_per_alloc": 2.5e-6,
             "rounds_s_per_alloc": [2.5e-6, 2.5e-6], "ratio": 1.0}]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_table.py"), str(path)],
                          capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    native = next(line for line in lines if line.startswith("| gpt2 | native |"))
    mine = next(line for line in lines if line.startswith("| gpt2 | torchmem |"))
    assert "| 2 | 1,000 | 1,630 |" in native and "| 1.630 |" in native and "| 1.000 |" in native
    assert "| 1.010 |" in mine
    assert "192.5 (5.0)" in mine and "| 0.939 | - | - | - | - |" in mine  # median 192.5 ms, spread 5 ms, vs native 205.0 ms
    assert any(line.startswith("| vision | native |") and line.endswith("| 1.000 | 1.10 / 4.25 / 2.50 | 0.80 | 1,250 | 22.5 |") for line in lines)
    assert any(line.startswith("| torchmem | 1 | 2.50 (0.00) | 1.000 |") for line in lines), proc.stdout
    assert any(line.startswith("| native | 1 | 2.70 (0.20) |") for line in lines), proc.stdout


def test_torchmem_with_options_is_its_own_row_after_the_known_ones(tmp_path):
    workloads = load_bench("gpu_workloads")
    args = workloads.parse_args(["--workload", "gpt2", "--allocator", "torchmem", "--out", "x",
                                 "--torchmem-conf", "backend=cuda_malloc"])
    assert workloads.allocator_label(args) == "torchmem[backend=cuda_malloc]"
    args = workloads.parse_args(["--workload", "gpt2", "--allocator", "torchmem", "--out", "x"])
    assert workloads.allocator_label(args) == "torchmem"
    rows = [row("gpt2", "torchmem[backend=cuda_malloc]", 0.300), row("gpt2", "torchmem", 0.150),
            row("gpt2", "native", 0.200)]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_table.py"), str(path)],
                          capture_output=True, text=True, check=True)
    first_table = proc.stdout.split("\n\n")[0].splitlines()
    names = [line.split("|")[2].strip() for line in first_table if line.startswith("| gpt2 |")]
    assert names == ["native", "torchmem", "torchmem[backend=cuda_malloc]"]
    variant = next(line for line in first_table if "cuda_malloc" in line)
    assert "| 1.500 |" in variant  # 300 ms against native's 200


def test_rounds_pair_with_native_by_seed(tmp_path):
    rows = [{**row("llama_ckpt", a, step), "seed": seed, "total_s": step * 8}
            for a, seed, step in (("native", 1, 0.100), ("torchmem", 1, 0.080), ("native", 2, 0.100),
                                  ("torchmem", 2, 0.125), ("expandable", 2, 0.110), ("torchmem", 3, 0.090))]
    path = tmp_path / "results.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "bench_table.py"), str(path)],
                          capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    # seed 3 has no native run: unpaired, left out; geomean of 0.8 and 1.25 is 1
    assert "| llama_ckpt | torchmem | 2 | 1.000 (0.80-1.25) | 1.000 (0.80-1.25) |" in lines, proc.stdout
    assert "| llama_ckpt | expandable | 1 | 1.100 (1.10-1.10) | 1.100 (1.10-1.10) |" in lines


def test_workload_script_validates_arguments():
    script = os.path.join(REPO, "bench", "gpu_workloads.py")
    proc = subprocess.run([sys.executable, script, "--workload", "gpt2", "--allocator", "torchmem", "--out", "x",
                           "--record-trace", "t.json.gz"], capture_output=True, text=True)
    assert proc.returncode == 2 and "--record-trace needs --allocator native" in proc.stderr
    proc = subprocess.run([sys.executable, script, "--workload", "nope", "--allocator", "native", "--out", "x"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "invalid choice" in proc.stderr


def test_workloads_cycle_through_shapes_and_warm_up_on_each():
    """The warm-up defaults to one step per shape (every shape warmed once), 3 with a fresh shape
    each step; --steps must exceed it. Seen through the script's own argument errors (exit 2);
    a command line that parses goes on to CUDA, which it is not shown."""
    script = os.path.join(REPO, "bench", "gpu_workloads.py")

    def run(*extra):
        return subprocess.run([sys.executable, script, "--workload", "gpt2", "--allocator", "native", "--out", "x",
                               *extra], capture_output=True, text=True, timeout=120,
                              env=dict(os.environ, CUDA_VISIBLE_DEVICES=""))  # no workload runs, GPU or not

    too_few = "--steps must exceed --warmup"
    assert too_few in run("--steps", "4").stderr  # 4 shapes: 4 warm-up steps
    assert too_few in run("--shapes", "0", "--steps", "3").stderr  # a fresh shape every step, as before --shapes
    fine = run("--shapes", "0", "--steps", "4", "--memory-fraction", "0.5")
    assert too_few not in fine.stderr and "--memory-fraction" not in fine.stderr
    proc = run("--memory-fraction", "1.5")
    assert proc.returncode == 2 and "--memory-fraction must be in (0, 1]" in proc.stderr


def test_kernel_time_sums_each_entry_device_time_once():
    class Entry:  # a key_averages() entry as torch >= 2.4 writes it, and one as older torch did
        def __init__(self, **fields):
            self.__dict__.update(fields)

    import torch

    workloads = load_bench("gpu_workloads")
    entries = [Entry(self_device_time_total=1500.0), Entry(self_device_time_total=0.0),
               Entry(self_cuda_time_total=250.0)]
    assert workloads.device_ms(entries) == 1.75
    # with host activity profiled, an operator's self device time repeats its kernels': left out
    kernel = Entry(self_device_time_total=400.0, device_type=torch.autograd.DeviceType.CUDA)
    launcher = Entry(self_device_time_total=400.0, device_type=torch.autograd.DeviceType.CPU)
    assert workloads.device_ms([kernel, launcher]) == 0.4
    assert workloads.device_ms([]) == 0.0
    args = workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x", "--kernel-time"])
    assert args.kernel_time


def test_workloads_record_the_process_own_speed():
    import torch

    workloads = load_bench("gpu_workloads")
    speed = workloads.host_speed(torch)
    assert 0 < speed["meta_s_per_alloc"] < 1e-3 and isinstance(speed["placement"]["cpu"], int)
    from torchmem.analysis.patterns import sizes_and_slots

    sizes, slots = sizes_and_slots("random", 2_000)
    probe = workloads.cuda_speed(torch, sizes, slots, device="cpu")  # the GPU's probe, run on the CPU
    assert 0 < probe["launch_s"] < 1e-3 and 0 < probe["cuda_s_per_alloc"] < 1e-3


def test_share_scenario_offers_the_runs_modes_only_on_request():
    scenario = load_bench("share_scenario")
    assert scenario.parse_args([]).modes == "elastic,static,static_torchmem"
    assert scenario.parse_args(["--modes", "elastic_granules,static_torchmem_runs"]).modes
    proc = subprocess.run([sys.executable, os.path.join(REPO, "bench", "share_scenario.py"), "--modes", "elastic,nope"],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown mode(s) ['nope']" in proc.stderr


def test_churn_times_the_meta_baseline_and_says_where_it_ran():
    import torch

    churn = load_bench("churn_microbench")
    where = churn.placement()
    assert isinstance(where["cpu"], int) and where["allowed"] >= 1
    live = [None] * 4
    rounds = churn.timed_rounds(2, [512, 1024, 2048], [0, 1, 2], live,
                                lambda size: torch.empty(size, dtype=torch.uint8, device="meta"))
    assert len(rounds) == 2 and all(r > 0 for r in rounds)
    assert [t.numel() for t in live[:3]] == [512, 1024, 2048]
