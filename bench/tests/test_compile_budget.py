"""bench/compile_reduce_overhead.py's budget axis, without a GPU: its options are checked, the
rounds alternate the modes asked for, and a run that ran out of memory is kept out of the
medians and the ratios (the GPU run itself is the `compile` job of bench/gpu_run.sh)."""

import pytest

from bench_support import load_bench

compile_ro = load_bench("compile_reduce_overhead")


def run(mode, train, infer=0.004, reserved=4 << 30):
    return {"mode": mode, "train_step_s": train, "infer_step_s": infer, "peak_reserved": reserved}


def test_budgets_below_the_peak_and_modes_without_native_are_refused(capsys):
    with pytest.raises(SystemExit):
        compile_ro.parse_args(["--out", "x.json", "--budgets", "0.9"])
    assert "each must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        compile_ro.parse_args(["--out", "x.json", "--modes", "torchmem"])
    assert "must include native" in capsys.readouterr().err


def test_rounds_alternate_only_the_modes_asked_for():
    args = compile_ro.parse_args(["--out", "x.json", "--modes", "native", "torchmem", "--budgets", "1.05"])
    assert compile_ro.round_order(args, 0) == ("native", "torchmem")
    assert compile_ro.round_order(args, 1) == ("torchmem", "native")
    assert args.budgets == [1.05]


def test_a_run_out_of_memory_stays_out_of_the_medians_and_the_ratios():
    runs = [run("native", 0.010), run("native", 0.012), run("torchmem", 0.0105),
            {"mode": "torchmem", "oom": "train", "error": "CUDA out of memory"}]
    summary, ratios = compile_ro.medians_and_ratios(runs)
    assert summary["native"]["train_step_s"] == pytest.approx(0.011)
    assert summary["torchmem"]["train_step_s"] == pytest.approx(0.0105)
    assert ratios["torchmem"]["train_step_s"] == pytest.approx(0.0105 / 0.011)
    assert "torchmem_park" not in ratios
    # Native out of memory: nothing to divide by, so no ratio at all.
    summary, ratios = compile_ro.medians_and_ratios([{"mode": "native", "oom": "train", "error": "x"},
                                                     run("torchmem", 0.01)])
    assert "native" not in summary and ratios == {}
