"""A kernel on a side stream still reads a tensor that was allocated on the
default stream and freed there without record_stream, while the host forces
the pool to stitch that tensor's granules (Note [Device barrier] in
csrc/core/pool.h). Under an allocator that unmaps on the free stream's fence
alone this is an illegal-address fault; under torchmem it must run clean.

Run by tests/gpu/test_gpu_stream_safety.py; also runnable by hand against any
torchmem build: `python tests/gpu/stream_safety_scene.py [record_stream]`.
Prints one JSON line of figures; exits non-zero on any CUDA error."""

import json
import sys

import torch

import torchmem

MiB = 1 << 20
record = len(sys.argv) > 1 and sys.argv[1] == "record_stream"

# x + keep + y = 130 MiB live; z (96 MiB) cannot fit in x's hole, so under a
# 170 MiB budget most of its granules must come from x's.
torchmem.install(limit="170MiB")
side = torch.cuda.Stream()
warm = torch.ones(1024, device="cuda") * 2  # load the kernels first: lazy loading would make the host wait
torch.cuda._sleep(1000)
torch.cuda.synchronize()
del warm

x = torch.ones(64 * MiB // 4, device="cuda")
keep = torch.empty(2 * MiB, dtype=torch.uint8, device="cuda")
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    torch.cuda._sleep(1_500_000_000)  # ~1 s of GPU time before the read below
    y = x * 2
    if record:
        x.record_stream(side)
before = torchmem.memory_stats()
del x  # freed on its allocation stream (the default one), which is idle
z = torch.empty(96 * MiB, dtype=torch.uint8, device="cuda")
z.fill_(7)
torch.cuda.synchronize()
after = torchmem.memory_stats()
# Reductions, not z == 7: a 96 MiB bool tensor would not fit the budget.
ok = int(z.min()) == 7 == int(z.max())
if record:
    ok = ok and float(y.min()) == 2.0 == float(y.max())  # with record_stream, x's data was protected
print(json.dumps({
    "record_stream": record,
    "reclaims": after["torchmem.num_reclaims"] - before["torchmem.num_reclaims"],
    "backend": {k: after.get(k, 0) - before.get(k, 0) for k in after if k.startswith("torchmem.backend.")},
    "data_ok": ok,
}))
sys.exit(0 if ok else 3)
