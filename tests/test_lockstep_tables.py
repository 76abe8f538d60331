"""bench/lockstep.py's per-sample table and its "NAME@S" allocators, on rows made up here (CPU).

The lockstep itself needs a GPU (bench/gpu_run.sh, job lockstep); what it prints from its rows
is plain arithmetic, checked here so that a figure copied into BENCHMARKS.md means what its
column says.
"""

import os
import sys
import types

import pytest

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)

import lockstep  # noqa: E402  (bench/lockstep.py)


def budget_row(allocator, step_s, samples, seed=1, oom=None, budget=1.05):
    """One process's result under a budget, as gpu_workloads.py writes it (quiet from the first step)."""
    return {"workload": "gpt2", "allocator": allocator, "seed": seed, "budget": budget, "shapes": 1,
            "step_s": step_s, "samples_per_step": samples, "oom_at_step": oom,
            "driver_calls_per_step": [0] * len(step_s), "barriers_per_step": [0] * len(step_s)}


def table_rows(text):
    """The table's data rows as lists of cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def test_batch_scale_reads_the_label():
    assert lockstep.batch_scale("native@0.75") == ("native", 0.75)
    assert lockstep.batch_scale("torchmem") == ("torchmem", 1.0)
    assert lockstep.batch_scale("torchmem[backend=cuda_malloc]@0.5") == ("torchmem[backend=cuda_malloc]", 0.5)


def test_worker_argv_passes_the_batch_scale_and_options():
    args = types.SimpleNamespace(steps=12, shapes=4, kernel_time=False)
    argv = lockstep.worker_argv("gpt2", "torchmem:backend=cuda_malloc@0.5", 1, args, "out.jsonl", 0.25)
    assert argv[argv.index("--allocator") + 1] == "torchmem"
    assert argv[argv.index("--torchmem-conf") + 1] == "backend=cuda_malloc"
    assert argv[argv.index("--batch-scale") + 1] == "0.5"
    assert argv[argv.index("--memory-fraction") + 1] == "0.250000"
    plain = lockstep.worker_argv("gpt2", "native", 1, args, "out.jsonl")
    assert "--batch-scale" not in plain and "--torchmem-conf" not in plain


def test_per_sample_table_compares_with_the_largest_native_batch_that_fit():
    rows = [
        budget_row("native", [0.1, 0.1], [16, 16], oom=1),  # ran out of memory at the drawn batch
        budget_row("native@0.75", [0.09, 0.09], [12, 12]),  # 7.5 ms per sample
        budget_row("native@0.5", [0.07, 0.07], [8, 8]),  # fits too, smaller: not the one compared
        budget_row("torchmem", [0.1, 0.12], [16, 16]),  # 6.875 ms per sample
        budget_row("torchmem", [0.11, 0.11], [16, 16]),  # 6.875 ms per sample
    ]
    cells = {row[3]: row for row in table_rows(lockstep.per_sample_table(rows))}
    assert cells["native"][6] == "OOM"
    assert cells["native@0.75"][6] == "7.500" and cells["native@0.75"][7] == "-"
    assert cells["torchmem"][5] == "2"  # both processes
    assert cells["torchmem"][6] == "6.875"
    assert cells["torchmem"][7] == "0.917 (native@0.75)"
    # the table lists the baseline family from its largest batch down
    order = [row[3] for row in table_rows(lockstep.per_sample_table(rows))]
    assert order.index("native") < order.index("native@0.75") < order.index("native@0.5")


def test_per_sample_table_needs_a_fitting_native_for_a_ratio():
    rows = [budget_row("native", [0.1], [16], oom=0), budget_row("torchmem", [0.1], [16])]
    cells = {row[3]: row for row in table_rows(lockstep.per_sample_table(rows))}
    assert cells["torchmem"][6] == "6.250" and cells["torchmem"][7] == "-"


def test_per_sample_table_counts_only_the_steady_steps():
    # a warm-up step with driver calls, then quiet: the warm-up's time and samples are left out
    row = budget_row("torchmem", [0.5, 0.1, 0.1, 0.1], [16, 16, 16, 16])
    row["driver_calls_per_step"] = [900, 0, 0, 0]
    native = budget_row("native@0.5", [0.06] * 4, [8] * 4)
    cells = {r[3]: r for r in table_rows(lockstep.per_sample_table([row, native]))}
    assert cells["torchmem"][6] == "6.250"
    assert cells["torchmem"][7] == "0.833 (native@0.5)"


def test_rows_without_samples_are_left_out():
    old = budget_row("torchmem", [0.1], [16])
    del old["samples_per_step"]
    assert table_rows(lockstep.per_sample_table([old])) == []


@pytest.mark.parametrize("bad", ["native@0", "native@1.5", "native@x"])
def test_a_bad_batch_scale_is_refused_before_anything_runs(bad, capsys):
    with pytest.raises(SystemExit):
        lockstep.main(["--workload", "gpt2", "--allocators", "native", bad, "--out", "unused.jsonl"])
    assert "batch scale" in capsys.readouterr().err


def test_gpu_workloads_scales_the_drawn_batch_and_names_the_row():
    import gpu_workloads  # bench/gpu_workloads.py: imports torch only when it runs a workload

    assert gpu_workloads.scale_batch((16, 512), 0.75) == (12, 512)
    assert gpu_workloads.scale_batch((1, 128), 0.5) == (1, 128)  # never below one sample
    assert gpu_workloads.scale_batch((4, 100, 20), 1.0) == (4, 100, 20)
    args = gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x",
                                     "--batch-scale", "0.5"])
    assert gpu_workloads.allocator_label(args) == "native@0.5"
    args = gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "torchmem", "--out", "x",
                                     "--torchmem-conf", "backend=cuda_malloc"])
    assert gpu_workloads.allocator_label(args) == "torchmem[backend=cuda_malloc]"
    with pytest.raises(SystemExit):
        gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x", "--batch-scale", "0"])


def test_the_smaller_batch_runs_only_under_a_budget(monkeypatch, tmp_path, capsys):
    seen = []

    def fake_run(commands, timeout_s):
        seen.append([name for name, _ in commands])
        return {name: 1 for name, _ in commands}  # as if every worker failed: nothing is read back

    monkeypatch.setattr(lockstep, "run_lockstep", fake_run)
    args = types.SimpleNamespace(workload="gpt2", allocators=["native", "native@0.75", "torchmem"], per_allocator=1,
                                 steps=12, shapes=4, kernel_time=False, timeout=1.0, reference="native",
                                 out=str(tmp_path / "out.jsonl"))
    lockstep.run_group(args, seed=1)
    lockstep.run_group(args, seed=1, budget=1.05, fraction=0.2)
    assert seen[0] == ["native#0", "torchmem#0"]
    assert seen[1] == ["native#0", "native@0.75#0", "torchmem#0", "native (no budget)#0"]
