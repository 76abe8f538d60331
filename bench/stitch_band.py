"""Reclaims, modeled driver time and peak reserved of the bundled traces under budgets
of 1.02-1.2x their peak requested, for several stitch_above values (CPU replay; the table
in BENCHMARKS.md, Memory: why stitching starts at 95% of the budget).

    python bench/stitch_band.py
"""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)  # this checkout's torchmem
from torchmem.analysis import replay  # noqa: E402

TRACES = ("gpt2_train", "llama_ckpt_train", "kv_generate", "vision")
BUDGETS = (1.02, 1.05, 1.1, 1.2)  # x peak requested
BANDS = (0.8, 0.95, 0.98)


def main():
    for name in TRACES:
        path = os.path.join(ROOT, "torchmem", "data", "traces", f"trace_{name}.json.gz")
        peak = replay.replay(path, "torchmem").peak_requested
        for budget in BUDGETS:
            print(f"{name} at {budget}x")
            for band in BANDS:
                r = replay.replay(path, "torchmem", limit=int(peak * budget), config={"stitch_above": band})
                print(f"    stitch_above={band}: ooms {r.ooms} reclaims {r.reclaims:6d} steady driver calls "
                      f"{r.steady_driver_calls:6d} modeled {r.modeled_backend_us / 1e3:7.1f} ms peak reserved "
                      f"{r.peak_reserved / peak:.3f}x", flush=True)


if __name__ == "__main__":
    main()
