"""Reclaims, modeled driver time and peak reserved of the bundled traces under budgets
of 1.02-1.2x their peak, for several stitch_above values (CPU replay; BENCHMARKS.md).

    python bench/stitch_band.py
"""
import sys
from torchmem import replay as R
for name in ("gpt2_train","llama_ckpt_train","kv_generate","vision"):
    path="torchmem/data/traces/trace_"+name+".json.gz"
    base=R.replay(path,"torchmem")
    for f in (1.02, 1.05, 1.1, 1.2):  # budgets, x peak requested
        row=[]
        for sa in (0.8, 0.95, 0.98):
            r=R.replay(path,"torchmem",limit=int(base.peak_requested*f),config={"stitch_above":sa})
            bc=r.backend_calls
            row.append(f"sa={sa}: ooms {r.ooms} reclaims {r.reclaims:6d} steady_calls {r.steady_driver_calls:6d} model_ms {r.modeled_backend_us/1e3:7.1f} peakres {r.peak_reserved/base.peak_requested:.3f}")
        print(name, f); [print("   ", x) for x in row]
