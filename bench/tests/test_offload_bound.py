"""bench/offload_bench.py's PCIe lower bound on an offload step (pcie_bound,
bound_fields, bound_text), on worked numbers; CPU only. The bench is a script,
not a package module, so it is imported by path; it imports torch only in main()."""

import pytest

from bench_support import load_bench

GiB = 1 << 30
bench = load_bench("offload_bench")


def test_gpt2_worked_numbers():
    # A worked example from an H200 run: GPT-2 none 59.9 ms at 12.40 GiB, keep 0.75 at 10.05 GiB
    # with 2.34 GiB moved, 55.2 GB/s, a forward of about 20 ms: 2.35 GiB must leave first,
    # 45.7 ms, bound 85.6 ms.
    lowered = round(2.35 * GiB)
    bound, estimate = bench.pcie_bound(59.9e-3, 20e-3, 35e-3, lowered, round(2.34 * GiB), 55.2e9, 55.2e9)
    assert lowered / 55.2e9 == pytest.approx(45.71e-3, abs=0.01e-3)
    assert bound == pytest.approx(59.9e-3 + 45.71e-3 - 20e-3, abs=0.01e-3)
    assert bound * 1e3 == pytest.approx(85.6, abs=0.05)
    assert 91.7e-3 / bound == pytest.approx(1.07, abs=0.005)
    # backward side: 2.34 GiB back in 45.52 ms against a 35 ms backward adds 10.52 ms
    assert estimate - bound == pytest.approx(round(2.34 * GiB) / 55.2e9 - 35e-3, abs=1e-9)
    assert estimate * 1e3 == pytest.approx(96.13, abs=0.05)


def test_llama_worked_numbers():
    # Llama: 1.23 GiB must leave before the peak, 23.9 ms against a ~13 ms forward: at least 49.8 ms.
    bound, estimate = bench.pcie_bound(38.9e-3, 13e-3, 26e-3, round(1.23 * GiB), round(1.64 * GiB), 55.2e9, 55.2e9)
    assert bound * 1e3 == pytest.approx(49.83, abs=0.02)
    assert 72.1e-3 / bound == pytest.approx(1.45, abs=0.005)
    # 1.64 GiB back at 55.2 GB/s is 31.9 ms against a 26 ms backward
    assert (estimate - bound) * 1e3 == pytest.approx(5.90, abs=0.02)


def test_each_side_uses_its_own_direction():
    # 1e9 bytes down at 50 GB/s (20 ms) vs a 5 ms forward; 2e9 back at 40 GB/s (50 ms) vs a 30 ms backward
    bound, estimate = bench.pcie_bound(0.1, 0.005, 0.030, 1e9, 2e9, 50e9, 40e9)
    assert bound == pytest.approx(0.1 + 0.015)
    assert estimate == pytest.approx(0.1 + 0.015 + 0.020)
    # swapping the bandwidths changes both sides
    bound2, estimate2 = bench.pcie_bound(0.1, 0.005, 0.030, 1e9, 2e9, 40e9, 50e9)
    assert bound2 == pytest.approx(0.1 + 0.020)
    assert estimate2 == pytest.approx(0.1 + 0.020 + 0.010)


def test_no_lowering_or_fast_enough_pcie_bounds_at_the_no_offload_step():
    # peak not lowered (or higher than no offload): nothing had to leave first
    assert bench.pcie_bound(0.06, 0.02, 0.04, 0, 0, 55e9, 55e9) == (0.06, 0.06)
    assert bench.pcie_bound(0.06, 0.02, 0.04, -GiB, 0, 55e9, 55e9) == (0.06, 0.06)
    # the transfer fits inside the forward and the backward: no extra time either side
    bound, estimate = bench.pcie_bound(0.06, 0.02, 0.04, 0.5e9, 1e9, 55e9, 55e9)
    assert bound == 0.06 and estimate == 0.06
    # the estimate is never below the bound
    bound, estimate = bench.pcie_bound(0.06, 0.02, 0.04, 5e9, 0, 55e9, 55e9)
    assert estimate == bound > 0.06
    with pytest.raises(ValueError):
        bench.pcie_bound(0.06, 0.02, 0.04, GiB, GiB, 0, 55e9)


def test_row_fields_and_summary_text():
    none_row = {"mode": "none", "step_s": 59.9e-3, "peak_bytes": round(12.40 * GiB)}
    row = {"mode": "torchmem keep 0.75", "step_s": 91.7e-3, "peak_bytes": round(10.05 * GiB),
           "moved_bytes": round(2.34 * GiB), "saved_bytes": round(9.10 * GiB)}
    split = {"t_fwd_s": 20e-3, "t_bwd_s": 35e-3, "t_opt_s": 4.9e-3}
    bw = {"d2h": 55.2e9, "h2d": 55.2e9}
    fields = bench.bound_fields(row, none_row, split, bw, row["moved_bytes"])
    assert set(fields) == {"bound_ms", "estimate_ms", "step_over_bound", "lowered_bytes", "estimate_moved_bytes"}
    assert fields["lowered_bytes"] == round(12.40 * GiB) - round(10.05 * GiB)
    assert fields["bound_ms"] == pytest.approx(85.6, abs=0.05)
    assert fields["step_over_bound"] == pytest.approx(91.7 / fields["bound_ms"])
    assert fields["estimate_ms"] == pytest.approx(96.13, abs=0.05)
    text = bench.bound_text(fields)
    assert text == "   bound 85.6 ms (x1.07), estimate 96.1 ms"
    assert ";" not in text  # bench/gpu_run.sh joins the rows on ';'


def test_module_imports_without_torch_at_module_level():
    # the pure functions must not need torch (nor CUDA) to be importable
    assert not hasattr(bench, "torch")
