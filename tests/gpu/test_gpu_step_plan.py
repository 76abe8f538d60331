"""On a GPU: Note [Step plan] with the real driver and real streams. A training
loop of the same shapes every step, under a budget close to its peak request,
stops making driver calls and device barriers once warm; its results equal those
of the same loop with the plan off; with FSDP-like weights gathered (written) on
a side stream, whose ranges the plan shares with the main stream's, it takes no
device barrier either and computes the same losses. Each case runs in a fresh interpreter
(the allocator swap is once per process)."""

import json
import textwrap

import pytest

from sim_pool import STITCHING_CONF
from support import run_python

pytestmark = pytest.mark.gpu

LOOP = """
import json, os, torch, torchmem
limit, plan, side = os.environ["TM_LIMIT"], os.environ["TM_PLAN"] == "on", os.environ["TM_SIDE"] == "side"
torchmem.install(limit=int(limit) if limit else None, step_plan=plan)
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(2048, 4096), torch.nn.GELU(),
                                                  torch.nn.Linear(4096, 2048)) for _ in range(12)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
gather = torch.cuda.Stream()
x = torch.randn(64, 512, 2048, device="cuda")

def counters():
    s = torchmem.memory_stats()
    return (s["num_device_alloc"] + s["num_device_free"] + 2 * s["torchmem.num_reclaims"],
            s["torchmem.num_device_barriers"])

per_step, losses = [], []
for step in range(14):
    before = counters()
    h = x
    for block in model:
        if side:  # a layer's gathered weights, on a stream of their own, freed after use
            with torch.cuda.stream(gather):
                w = torch.empty(2048 * 4096 * 2, device="cuda")
                # written at once: on a range the main stream's queued kernels still
                # read, an unordered handover would change the losses
                w.fill_(1.0)
            torch.cuda.current_stream().wait_stream(gather)
            h = block(h)
            del w
        else:
            h = block(h)
    loss = h.float().pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    losses.append(float(loss))
    after = counters()
    per_step.append([after[0] - before[0], after[1] - before[1]])
s = torchmem.memory_stats()
print("RESULT " + json.dumps({"per_step": per_step, "losses": losses, "plans": s["torchmem.num_plans"],
                              "hits": s["torchmem.num_plan_hits"], "peak_requested": s["requested_bytes.all.peak"],
                              "peak_reserved": s["reserved_bytes.all.peak"], "ooms": s["num_ooms"],
                              "stream_waits": s["torchmem.backend.stream_wait_calls"],
                              "lazy_pins": s["torchmem.num_lazy_pins"]}))
"""


# A plan is learnt once the pool stitches; under a limit the defaults keep this loop quiet
# without one, so the plan's own checks run STITCHING_CONF (tests/sim_pool.py).


def loop(limit="", plan="on", side="plain", conf=""):
    env = {"TM_LIMIT": limit, "TM_PLAN": plan, "TM_SIDE": side, "TORCHMEM_CONF": conf}
    proc = run_python(textwrap.dedent(LOOP), env=env, timeout=300)
    line = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
    assert line, proc.stdout + proc.stderr
    return json.loads(line[0][len("RESULT "):])


@pytest.fixture(scope="module")
def peak():
    return loop()["peak_requested"]


@pytest.mark.parametrize("side", ["plain", "side"])
def test_a_repeating_step_at_a_budget_makes_no_driver_call_once_warm(peak, side):
    budget = int(peak * 1.05)
    quiet = loop(str(budget), "on", side)  # the defaults
    assert quiet["ooms"] == 0 and quiet["peak_reserved"] <= budget
    assert quiet["per_step"][-4:] == [[0, 0]] * 4, quiet["per_step"]
    planned = loop(str(budget), "on", side, STITCHING_CONF)
    assert planned["ooms"] == 0
    assert planned["peak_reserved"] <= budget
    late = planned["per_step"][-4:]
    assert late == [[0, 0]] * 4, planned["per_step"]
    assert planned["lazy_pins"] >= 1  # Note [Lazy pins]: the losses below are computed under them
    # the same numbers as without a plan: where a tensor lives changes nothing it computes,
    # and a range handed between streams (Note [Reuse behind a stream wait]) waits for its old
    # stream's kernels
    online = loop(str(budget), "off", side, STITCHING_CONF)
    assert planned["losses"] == online["losses"] == quiet["losses"]
    if side == "side":
        assert planned["stream_waits"] > 0, "the streams never shared a range: the handover went untested"


def test_unconstrained_with_a_side_stream_takes_no_barrier_once_warm():
    result = loop("", "on", "side")
    assert [barriers for _, barriers in result["per_step"][-4:]] == [0] * 4, result["per_step"]
