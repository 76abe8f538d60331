"""On a GPU: backed_fit (Note [Backed placement]) with the real driver and real
streams. A loop whose shapes change every step, under a budget close to its peak
request, with weights written on a side stream and freed after use: with the option
on, requests are moved to cached backing (counted), the run stays under its budget
with no OOM, and every loss equals the loss of the same loop with the option off
(where a tensor lives changes nothing it computes, and a moved block is never handed
to a stream before the old one's kernels are done with it). Each case runs in a
fresh interpreter (the allocator swap is once per process)."""

import json
import textwrap

import pytest

from support import run_python

pytestmark = pytest.mark.gpu

LOOP = """
import json, os, torch, torchmem
limit, backed = os.environ["TM_LIMIT"], os.environ["TM_BACKED"] == "on"
# stitching in the top 5% of the limit, where placement by size or on backing differs most
torchmem.install(limit=int(limit) if limit else None, backed_fit=backed, step_plan=False, stitch_above_limit=0.95)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(1024, 3072), torch.nn.GELU(),
                                                  torch.nn.Linear(3072, 1024)) for _ in range(8)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gather = torch.cuda.Stream()
lengths = [517, 1023, 301, 1900, 777, 1411, 233, 1650, 960, 1201, 409, 1777]
losses = []
for step, length in enumerate(lengths):
    x = torch.randn(16, length, 1024, device="cuda")
    h = x
    for block in model:
        with torch.cuda.stream(gather):  # a layer's gathered weights, written on their own stream
            w = torch.empty(1024 * 3072 + 7 * length, device="cuda")
            w.fill_(1.0)
        torch.cuda.current_stream().wait_stream(gather)
        h = block(h) + w[:1024].view(1, 1, 1024)
        del w
    loss = h.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(loss))
s = torchmem.memory_stats()
print("RESULT " + json.dumps({"losses": losses, "moves": s["torchmem.num_backed_moves"],
                              "peak_requested": s["requested_bytes.all.peak"],
                              "peak_reserved": s["reserved_bytes.all.peak"], "ooms": s["num_ooms"]}))
"""


def loop(limit="", backed="off"):
    proc = run_python(textwrap.dedent(LOOP), env={"TM_LIMIT": limit, "TM_BACKED": backed}, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[0][len("RESULT "):])


def test_backed_placement_at_a_budget_computes_the_same_losses():
    peak = loop()["peak_requested"]
    budget = int(peak * 1.05)
    backed = loop(str(budget), "on")
    assert backed["ooms"] == 0
    assert backed["peak_reserved"] <= budget
    assert backed["moves"] > 0, "no request was moved: the placement went untested"
    online = loop(str(budget), "off")
    assert online["moves"] == 0
    assert backed["losses"] == online["losses"]
