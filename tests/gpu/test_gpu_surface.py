"""The Python surface on a real GPU: patched torch.cuda stats under Lightning and HF Trainer,
OOM hooks, snapshots of a training step in torch's memory_viz, leak checks, history cost.

Each test installs torchmem in a fresh interpreter (tests/support.py run_python):
the allocator can be swapped once per process, before CUDA initializes.
Lightning and transformers exist only on the GPU machine: those tests skip without them.
"""

import json
import os
import pickle
import subprocess
import sys

import pytest

from support import REPO, run_python

pytestmark = pytest.mark.gpu

PRELUDE = """
import json, os, sys, warnings
import torch
import torchmem
torchmem.install()
import torch.nn as nn
MiB = 1 << 20
"""


# History tests size the trace ring at install too; record_history() resizes it on live pools
# (snapshot.py Note [Live trace ring]).
HISTORY_ENV = {"TORCHMEM_CONF": "trace_capacity=200000"}


def _last_json(proc):
    return json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])


def test_patched_torch_functions_agree_with_torchmem():
    proc = run_python(PRELUDE + """
    assert torchmem.runtime.patch.is_patched(), "install() patches torch by default"
    xs = [torch.empty(n, dtype=torch.uint8, device="cuda") for n in (1000, 3 * MiB, 40 * MiB + 1)]
    rounded = sum(-(-x.numel() // 512) * 512 for x in xs)
    stats = torch.cuda.memory_stats()
    assert torch.cuda.memory_allocated() == torchmem.memory_allocated() == rounded == stats["allocated_bytes.all.current"]
    assert torch.cuda.max_memory_reserved() == torchmem.max_memory_reserved() >= rounded
    assert stats["requested_bytes.all.current"] == 1000 + 3 * MiB + 40 * MiB + 1
    del xs
    torch.cuda.reset_peak_memory_stats()
    assert torch.cuda.max_memory_allocated() == torch.cuda.memory_allocated() == 0
    assert "torchmem memory summary" in torch.cuda.memory_summary()
    before = torch.cuda.mem_get_info()[0]
    torch.cuda.empty_cache()
    assert torch.cuda.mem_get_info()[0] >= before
    print(json.dumps({"ratio": stats["torchmem.fragmentation_ratio"]}))
    """.replace("\n    ", "\n"))
    assert _last_json(proc)["ratio"] >= 1.0


def test_lightning_device_stats_monitor_logs_torchmem_figures():
    try:
        import lightning  # noqa: F401
        package = "lightning.pytorch"
    except ImportError:
        pytest.importorskip("pytorch_lightning")
        package = "pytorch_lightning"
    proc = run_python(PRELUDE + f"""
import {package} as pl
from {package}.callbacks import DeviceStatsMonitor
from {package}.loggers.logger import Logger

class Capture(Logger):
    def __init__(self):
        super().__init__()
        self.rows = []
    @property
    def name(self): return "capture"
    @property
    def version(self): return 0
    def log_hyperparams(self, *args, **kwargs): pass
    def log_metrics(self, metrics, step=None): self.rows.append(dict(metrics))

class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 10))
    def training_step(self, batch, _):
        x, y = batch
        return nn.functional.cross_entropy(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters())

data = torch.utils.data.TensorDataset(torch.randn(256, 256), torch.randint(0, 10, (256,)))
logger = Capture()
trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=6, logger=logger, log_every_n_steps=1,
                     callbacks=[DeviceStatsMonitor()], enable_checkpointing=False, enable_progress_bar=False)
trainer.fit(Tiny(), torch.utils.data.DataLoader(data, batch_size=32))
logged = {{}}
for row in logger.rows:
    for key, value in row.items():
        logged.setdefault(key.split("/")[-1], []).append(value)
final_peak = torchmem.max_memory_allocated()
assert logged.get("allocated_bytes.all.current"), sorted(logged)[:20]
assert all(0 < v <= final_peak for v in logged["allocated_bytes.all.peak"])
assert max(logged["reserved_bytes.all.peak"]) <= torchmem.max_memory_reserved()
assert all(v % (2 * MiB) == 0 for v in logged["reserved_bytes.all.current"])
assert "torchmem.fragmentation_ratio" in logged
print(json.dumps({{"rows": len(logger.rows), "peak": final_peak, "logged_peak": max(logged["allocated_bytes.all.peak"])}}))
""")
    result = _last_json(proc)
    assert result["rows"] >= 6 and result["logged_peak"] <= result["peak"]


def test_hf_trainer_memory_metrics(tmp_path):
    pytest.importorskip("transformers")
    proc = run_python(PRELUDE + f"""
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

class Data(torch.utils.data.Dataset):
    def __len__(self): return 64
    def __getitem__(self, i):
        ids = torch.randint(0, 256, (64,))
        return {{"input_ids": ids, "labels": ids}}

model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=128, n_head=2, vocab_size=256, n_positions=64))
args = TrainingArguments(output_dir={str(tmp_path)!r}, max_steps=5, per_device_train_batch_size=8,
                         skip_memory_metrics=False, report_to=[], save_strategy="no", logging_steps=1)
metrics = Trainer(model=model, args=args, train_dataset=Data()).train().metrics
keys = [k for k in metrics if "_mem_gpu_" in k]
assert "train_mem_gpu_alloc_delta" in metrics and "train_mem_gpu_peaked_delta" in metrics, metrics
assert metrics["train_mem_gpu_peaked_delta"] > 0
assert metrics["train_mem_gpu_alloc_delta"] + metrics["train_mem_gpu_peaked_delta"] <= torchmem.max_memory_allocated()
print(json.dumps({{k: metrics[k] for k in keys}}))
""")
    assert "train_mem_gpu_alloc_delta" in _last_json(proc)


def test_oom_hook_frees_a_cache_and_the_allocation_succeeds():
    proc = run_python("""
import json, warnings
import torch, torchmem
torchmem.install(limit="1GiB")
MiB = 1 << 20
cache = [torch.empty(700 * MiB, dtype=torch.uint8, device="cuda")]
calls = []
def drop_cache(device, requested, stats):
    calls.append((device, requested, stats["allocated_bytes.all.current"]))
    if not cache:
        return False
    cache.clear()
    return True
handle = torchmem.on_oom(drop_cache)
x = torch.empty(600 * MiB, dtype=torch.uint8, device="cuda")   # would OOM next to the cache
assert len(calls) == 1 and calls[0][1] >= 600 * MiB and calls[0][2] >= 700 * MiB
handle.remove()
def broken(device, requested, stats):
    raise KeyError("boom")
torchmem.on_oom(broken)
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
        torch.empty(900 * MiB, dtype=torch.uint8, device="cuda")
        raise SystemExit("expected an OOM")
    except torch.OutOfMemoryError as exc:
        assert str(exc).startswith("CUDA out of memory. Tried to allocate"), exc
assert any("boom" in str(w.message) for w in caught), [str(w.message) for w in caught]
stats = torchmem.memory_stats()
assert stats["torchmem.oom_hook_errors"] >= 1 and stats["num_ooms"] >= 1
print(json.dumps({"hook_calls": stats["torchmem.oom_hook_calls"]}))
""")
    assert _last_json(proc)["hook_calls"] >= 2


def test_snapshot_of_a_training_step_renders_in_memory_viz(tmp_path):
    path = str(tmp_path / "step.pickle")
    run_python(PRELUDE + f"""
torchmem.record_history(stacks="python")
model = nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512)).cuda()
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    loss = model(torch.randn(64, 512, device="cuda")).square().mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
snap = torchmem.snapshot()
torchmem.dump_snapshot({path!r})
blocks = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
assert blocks and any(b["frames"] for b in blocks)
actions = {{e["action"] for e in snap["device_traces"][torch.cuda.current_device()]}}
assert {{"alloc", "free_requested", "segment_map"}} <= actions, actions
assert sum(s["total_size"] for s in snap["segments"]) == torch.cuda.memory_reserved()
""", env=HISTORY_ENV)
    with open(path, "rb") as f:
        assert f.read(2) == b"\x80\x04"
    from memory_viz_check import undo_like_memory_viz

    with open(path, "rb") as f:
        data = pickle.load(f)
    device = max(range(len(data["device_traces"])), key=lambda d: len(data["device_traces"][d]))
    assert undo_like_memory_viz(data, device) > 0
    for args in (["stats", path], ["trace_plot", path, "-o", str(tmp_path / "t.html")],
                 ["segment_plot", path, "-o", str(tmp_path / "s.html")]):
        proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", *args], cwd=REPO,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
    proc = subprocess.run([sys.executable, "-m", "torchmem", "stats", path], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "reserved_bytes" in proc.stdout, proc.stderr


def test_leak_check_catches_a_planted_leak_and_passes_a_clean_loop():
    run_python(PRELUDE + """
torchmem.record_history(stacks="python")
model = nn.Linear(1024, 1024).cuda()
def step(keep=None):
    out = model(torch.randn(256, 1024, device="cuda")).sum()
    out.backward()
    if keep is not None:
        keep.append(torch.empty(3 * MiB, dtype=torch.uint8, device="cuda"))
step()  # warm-up: cuBLAS workspaces and .grad live on (Note [Warm-up allocations])
with torchmem.leak_check() as report:
    for _ in range(5):
        step()
assert not report, str(report)
kept = []
try:
    with torchmem.leak_check():
        for _ in range(3):
            step(kept)
    raise SystemExit("the leak was not caught")
except torchmem.LeakError as exc:
    leaks = exc.report.leaks
    assert sorted(b.address for b in leaks) == sorted(t.data_ptr() for t in kept), (leaks, kept)
    assert all(b.frames and b.frames[0]["name"] == "step" for b in leaks)
print("ok")
""", env=HISTORY_ENV)


CHURN = """
import time
def churn(n=20000):
    live = [None] * 64
    torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(n):
        live[i % 64] = torch.empty((i * 7919) % (4 * MiB) + 512, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e6
churn(2000)
us = min(churn() for _ in range(5))
entries = len(torchmem.snapshot()["device_traces"][torch.cuda.current_device()])
print(json.dumps({"us_per_alloc": us, "entries": entries}))
"""


def test_record_history_cost_per_allocation():
    """Python-visible torch.empty cost with history off, events only, and Python stacks
    (each its own process: a pool's trace ring is sized when the pool is created)."""
    results = {}
    for mode, setup in (("off", ""), ("events", "torchmem.record_history(stacks=None)\n"),
                        ("python_stacks", "torchmem.record_history(stacks='python')\n")):
        results[mode] = _last_json(run_python(PRELUDE + setup + CHURN, env=HISTORY_ENV if setup else None))
    print("record_history cost (us per torch.empty, 64 live tensors):",
          {mode: round(r["us_per_alloc"], 3) for mode, r in results.items()})
    assert results["off"]["entries"] == 0
    assert results["events"]["entries"] > 0 and results["python_stacks"]["entries"] > 0


def test_probe_measures_the_driver_and_the_allocation_path():
    """torchmem.runtime.probe: the driver's costs on fresh memory outside every pool, and the
    allocation path's pair time through the installed pool, which keeps its memory whole."""
    proc = run_python("""
import json, torch
import torchmem
torchmem.install()
from torchmem.runtime import probe
x = torch.ones(1 << 20, device="cuda")
costs = probe.driver_costs(0, repeats=3, granules=4)
loaded = probe.driver_costs(0, repeats=2, granules=1, live_granules=8, evict_bytes=1 << 20)
pair = probe.allocation_pair_ns(iterations=2000)
print(json.dumps({"costs": costs, "loaded": loaded, "pair": pair, "x": float(x.sum()),
                  "allocated": torchmem.memory_allocated()}))
""")
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = _last_json(proc)
    assert out["costs"] and all(isinstance(v, float) and v >= 0 for v in out["costs"].values())
    assert any(name.startswith("map") for name in out["costs"]), sorted(out["costs"])
    # in a training process's conditions (Note [Probe conditions]): the same keys, the conditions named
    assert out["loaded"]["live_granules"] == 8 and out["loaded"]["evict_bytes"] == 1 << 20
    assert set(out["costs"]) <= set(out["loaded"]) and all(v >= 0 for v in out["loaded"].values())
    assert 0 < out["pair"] < 1e6
    assert out["x"] == float(1 << 20) and out["allocated"] == 4 << 20  # the pairs left nothing behind
