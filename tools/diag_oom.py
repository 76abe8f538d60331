"""Diagnostic: one OOM under a torchmem budget, with faulthandler on, so a crash
on the OOM path shows where it happens. Run under cuda-gdb for a C++ backtrace:
  cuda-gdb -batch -ex run -ex bt --args python3 tools/diag_oom.py [vmm|cuda_malloc] [hooks]"""

import faulthandler
import sys

faulthandler.enable()
import torch  # noqa: E402

import torchmem  # noqa: E402

backend = sys.argv[1] if len(sys.argv) > 1 else "vmm"
torchmem.install(limit="1GiB", backend=backend, patch_torch="hooks" in sys.argv)
print("installed", backend, flush=True)
keep = torch.empty(256 << 20, dtype=torch.uint8, device="cuda")
print("allocated 256 MiB", flush=True)
try:
    torch.empty(900 << 20, dtype=torch.uint8, device="cuda")
    print("NO OOM", flush=True)
except torch.OutOfMemoryError as exc:
    print("OOM OK:", str(exc)[:120], flush=True)
again = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")
print("recovered", again.numel(), flush=True)
