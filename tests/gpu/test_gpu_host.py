"""On a GPU: the pinned host pool and activation offload for real.

- data round-trips intact through pool buffers on several concurrent streams;
- a buffer freed while a copy from it still runs is not handed out again until
  the copy finished;
- offload gives gradients bitwise identical to no offload, with a lower peak;
- BatchSizeController(offload="auto") trains a tiny Llama at a budget where
  micro-batch 1 does not fit without offload.
Each test runs in a fresh interpreter (tests/support.py)."""

import json

import pytest

from support import run_python

pytestmark = pytest.mark.gpu


def last_json(proc):
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_round_trips_under_concurrent_streams():
    out = last_json(run_python("""
        import json, threading, torch
        from torchmem import host
        pool = host.HostPool(backend="cuda", chunk_mb=64)
        errors = []

        def worker(seed):
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                for i in range(40):
                    n = (1 << 14) * (1 + (seed * 7 + i) % 13)
                    src = pool.empty(n, torch.int32)
                    if not pool.is_pinned(src):
                        errors.append(("not pinned", seed, i))
                    src.copy_(torch.arange(n, dtype=torch.int32) * (seed + 1) + i)
                    dev = src.to("cuda", non_blocking=True)
                    del src                                  # freed while the copy may run
                    back = pool.empty(n, torch.int32)
                    back.copy_(dev, non_blocking=True)
                    stream.synchronize()
                    want = torch.arange(n, dtype=torch.int32) * (seed + 1) + i
                    if not torch.equal(back, want):
                        errors.append((seed, i))

        threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        torch.cuda.synchronize()
        pool.check()
        s = pool.stats()
        print(json.dumps({"errors": errors, "pinned": s["pinned_bytes"], "held": s["held_bytes"],
                          "hits": s["cache_hits"], "live": s["allocations.current"]}))
    """))
    assert out["errors"] == []
    assert out["pinned"] == out["held"] > 0
    assert out["hits"] > 0 and out["live"] == 0


def test_no_reuse_while_a_copy_runs():
    out = last_json(run_python("""
        import json, torch
        from torchmem import host
        pool = host.HostPool(backend="cuda")
        side = torch.cuda.Stream()
        n = 16 << 20
        a = pool.empty(n, torch.uint8, stream=side)
        a.fill_(1)
        ptr = a.data_ptr()
        with torch.cuda.stream(side):
            torch.cuda._sleep(200_000_000)                   # keep the stream busy
            dev = a.to("cuda", non_blocking=True)
        del a
        b = pool.empty(n, torch.uint8)                       # must not be a's block
        reused_early = b.data_ptr() == ptr
        b.fill_(2)
        side.synchronize()
        intact = bool((dev == 1).all())
        del b
        torch.cuda.synchronize()
        # a's copy finished: its block is reusable now (b's too: which comes first is the pool's choice)
        c, d = pool.empty(n, torch.uint8), pool.empty(n, torch.uint8)
        print(json.dumps({"reused_early": reused_early, "intact": intact,
                          "reused_after": ptr in (c.data_ptr(), d.data_ptr())}))
    """))
    assert not out["reused_early"] and out["intact"] and out["reused_after"]


@pytest.mark.parametrize("copies", ["native", "python"])
def test_offload_gradients_identical_and_peak_lower(copies):
    # Both ways of copying (Note [Offload copies]): torchmem._C's one-call copies and torch's.
    # y * y saves one tensor twice (Note [Shared storages]): with everything moved, its one
    # host copy serves both unpacks.
    out = last_json(run_python("""
        import json, torch
        import torchmem
        torch.manual_seed(0)
        width, layers = 1024, 8
        blocks = []
        for _ in range(layers):
            blocks += [torch.nn.Linear(width, 4 * width), torch.nn.GELU(), torch.nn.Linear(4 * width, width),
                       torch.nn.LayerNorm(width)]
        model = torch.nn.Sequential(*blocks).cuda()
        x = torch.randn(16, 512, width, device="cuda")

        def step(ctx):
            model.zero_grad(set_to_none=True)
            torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
            with ctx:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    y = model(x).float()
                    loss = (y * y).mean()
            loss.backward()
            torch.cuda.synchronize()
            return [p.grad.clone() for p in model.parameters()], torch.cuda.max_memory_allocated()

        import contextlib
        ref, peak_none = step(contextlib.nullcontext())
        off = torchmem.offload_activations(None)
        results = {}
        for name, budget in (("all", None), ("half", None)):
            if name == "half":
                off.set_budget(off.last_step["saved_bytes"] // 2)
            for _ in range(2):
                got, peak = step(off)
            results[name] = {"equal": all(torch.equal(a, b) for a, b in zip(ref, got)), "peak": peak,
                             "moved": off.last_step["offloaded_bytes"], "saved": off.last_step["saved_bytes"]}
        print(json.dumps({"peak_none": peak_none, "native": off._native is not None,
                          "shared_saves": off.measured.count(0), **results}))
    """, env={"TORCHMEM_OFFLOAD_COPIES": copies}))
    assert out["native"] == (copies == "native")
    assert out["shared_saves"] >= 1  # y * y
    for name in ("all", "half"):
        assert out[name]["equal"], name
        assert out[name]["peak"] < out["peak_none"], name
    assert out["all"]["moved"] == out["all"]["saved"]
    assert 0 < out["half"]["moved"] < out["all"]["moved"]
    assert out["all"]["peak"] < out["half"]["peak"]


LLAMA = """
import json, torch
from transformers import LlamaConfig, LlamaForCausalLM
torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=8192)
cfg._attn_implementation = "sdpa"
SEQ = 8192
"""


def test_controller_offload_auto_trains_where_micro_batch_1_does_not_fit():
    pytest.importorskip("transformers")
    measured = last_json(run_python(LLAMA + """
import torchmem
model = LlamaForCausalLM(cfg).cuda()
ids = torch.randint(0, 2048, (1, SEQ), device="cuda")

def peak(ctx):
    model.zero_grad(set_to_none=True)
    torch.cuda.synchronize(); base = torch.cuda.memory_allocated(); torch.cuda.reset_peak_memory_stats()
    with ctx:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated()

import contextlib
none = peak(contextlib.nullcontext())
off = torchmem.offload_activations(None)
with_off = peak(off)
print(json.dumps({"none": none, "offload": with_off}))
"""))
    assert measured["offload"] < measured["none"]
    # A budget half way: micro-batch 1 needs more, with offload it fits (optimizer state added on top).
    budget = (measured["none"] + measured["offload"]) // 2 + (64 << 20)
    out = last_json(run_python(LLAMA + f"""
import torchmem
torchmem.install(limit={budget})
model = LlamaForCausalLM(cfg).cuda()
opt = torch.optim.SGD(model.parameters(), lr=1e-2)
ctl = torchmem.BatchSizeController(2, model=model, optimizer=opt, offload="auto", quantum=1)
gen = torch.Generator(device="cuda").manual_seed(0)

def loss_fn(mb):
    with torch.autocast("cuda", dtype=torch.bfloat16):
        return model(input_ids=mb, labels=mb).loss

losses = []
for step in range(6):
    ids = torch.randint(0, 2048, (2, SEQ), device="cuda", generator=gen)
    loss = ctl.run(loss_fn, ids)
    ctl.step()
    losses.append(loss.item())
events = [e["event"] for e in ctl.events]
print(json.dumps({{"losses": losses, "events": events, "micro": ctl.micro_batch,
                  "reasons": [e["reason"] for e in ctl.events if e["event"] == "offload"]}}))
"""))
    assert len(out["losses"]) == 6 and all(l == l for l in out["losses"])  # trained to the end, no NaN
    assert "offload" in out["events"] and out["micro"] == 1
    assert out["reasons"][0].startswith("offload on")


def test_torch_pinned_allocations_go_to_the_pool_once_installed():
    out = last_json(run_python("""
        import json, torch
        from torchmem import host
        host.install_torch_host_allocator()
        pool = host.default_pool()
        a = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        b = torch.randn(4096).pin_memory()
        loader = torch.utils.data.DataLoader(torch.arange(64.0).view(16, 4), batch_size=4, pin_memory=True)
        batch = next(iter(loader))
        live = pool.stats()["allocations.current"]
        side = torch.cuda.Stream()
        with torch.cuda.stream(side):
            torch.cuda._sleep(100_000_000)
            dev = a.to("cuda", non_blocking=True)   # torch records `side` on the pool's block
        ptr = a.data_ptr()
        del a
        again = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
        print(json.dumps({"pinned": [b.is_pinned(), batch.is_pinned(), again.is_pinned()],
                          "owned": [pool.owns(b), pool.owns(batch)], "live": live,
                          "reused_early": again.data_ptr() == ptr,
                          "torch_num_host_alloc": torch.cuda.host_memory_stats()["num_host_alloc"],
                          "pool_num_host_alloc": pool.stats()["num_host_alloc"]}))
    """))
    assert all(out["pinned"]) and all(out["owned"])
    assert out["live"] >= 3 and not out["reused_early"]
    assert out["torch_num_host_alloc"] == out["pool_num_host_alloc"] >= 1
