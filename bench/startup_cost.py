"""Process start-up under torchmem: N processes at once, each `import torch`, install the
allocator (or not), make its first CUDA tensor and exit; seconds per phase.

Several processes starting together on a busy GPU (a peer-suite run's xdist workers) must not
start slower under torchmem. This times the pieces, for native, torchmem, and torchmem with
the monitor off, optionally beside `--load` busy processes (bench/empty_cache_fuzz.py's);
BENCHMARKS.md, Startup.

    python bench/startup_cost.py --procs 8 --load 4 --out startup.jsonl
"""

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
mode = sys.argv[1]
if mode != "native":
    import torchmem
    torchmem.install(warn_unsupported=False)
t2 = time.perf_counter()
x = torch.ones(1 << 20, device="cuda")
torch.cuda.synchronize()
t3 = time.perf_counter()
del x
print(json.dumps({"import_s": t1 - t0, "install_s": t2 - t1, "first_tensor_s": t3 - t2}))
sys.stdout.flush()
"""

MODES = {"native": {}, "torchmem": {}, "torchmem_no_monitor": {"TORCHMEM_CONF": "monitor=false"}}


def start_all(mode, procs):
    env = dict(os.environ, **MODES[mode])
    started = time.perf_counter()
    children = [subprocess.Popen([sys.executable, "-c", CHILD, "torchmem" if mode != "native" else "native"],
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for _ in range(procs)]
    rows = []
    for child in children:
        out, err = child.communicate(timeout=300)
        ended = time.perf_counter() - started
        row = json.loads(out.strip().splitlines()[-1]) if child.returncode == 0 and out.strip() else {
            "error": err.strip().splitlines()[-1:] or [f"rc {child.returncode}"]}
        row["wall_s"] = ended
        rows.append(row)
    return rows


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--procs", type=int, default=8)
    parser.add_argument("--load", type=int, default=0, help="busy processes on the GPU meanwhile")
    parser.add_argument("--modes", default="native,torchmem,torchmem_no_monitor")
    parser.add_argument("--out")
    args = parser.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from empty_cache_fuzz import busy_gpu, emit

    with busy_gpu(args.load):
        for mode in args.modes.split(","):
            rows = start_all(mode, args.procs)
            ok = [r for r in rows if "error" not in r]

            def worst(key):
                return round(max(r[key] for r in ok), 3) if ok else None

            emit({"bench": "startup_cost", "mode": mode, "procs": args.procs, "load": args.load,
                  "failed": len(rows) - len(ok), "last_exit_s": round(max(r["wall_s"] for r in rows), 3),
                  "max_import_s": worst("import_s"), "max_install_s": worst("install_s"),
                  "max_first_tensor_s": worst("first_tensor_s"),
                  "errors": [r["error"] for r in rows if "error" in r][:2]}, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
