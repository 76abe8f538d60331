"""peer_memprobe: a pytest plugin that logs the device's memory around peer-suite tests.

For diagnosing a peer test that fails only after other tests of its worker
(test_device_memory_used): the order matters, so the plugin must say what state
a test starts from without changing it. Loaded by bench/gpu_run.sh's peer_order
job when MEMPROBE_OUT is set (`-p peer_memprobe`, this folder on PYTHONPATH).

Environment:
  MEMPROBE_OUT=PATH     one JSON line per logged test (appended)
  MEMPROBE_MODE=watch   (default) reads only: at the start and end of each test named in
                        MEMPROBE_TESTS (all tests when empty) the reserved and allocated bytes,
                        the torchmem.* counters, every segment's size and allocated bytes, and
                        the same at each torch.cuda.device_memory_used() call inside the test
                        (with the value it returned)
  MEMPROBE_MODE=steps   after each test, repeats test_device_memory_used's steps (empty_cache,
                        NVML reading, 512 MiB, empty_cache, NVML reading): changes the state
                        the next test starts from
  MEMPROBE_MODE=history for each test named in MEMPROBE_TESTS (all when empty), every
                        allocator event inside it (torch.cuda.memory._record_memory_history:
                        action, address, size, stream, the top Python frames), one line each,
                        then the segments it ends with: which stream asked for what, where
  MEMPROBE_TESTS="a b"  test names (the part after the last ::) to watch
"""

import gc
import json
import os

import pytest

OUT = os.environ.get("MEMPROBE_OUT", "")
MODE = os.environ.get("MEMPROBE_MODE", "watch")
WATCHED = set(os.environ.get("MEMPROBE_TESTS", "").split())
PROBE_BYTES = 512 * 1024**2


def _write(row):
    with open(OUT, "a") as f:
        f.write(json.dumps(row) + "\n")


def _state(device_used=None):
    """What the allocator holds, read without allocating or freeing anything (`device_used`: the
    NVML reading to use, torch.cuda.device_memory_used by default)."""
    import torch

    device_used = device_used or torch.cuda.device_memory_used

    segments = [
        {"pool": str(s.get("segment_pool_id")), "size": s["total_size"], "allocated": s["allocated_size"]}
        for s in torch.cuda.memory_snapshot()
    ]
    return {
        "reserved": torch.cuda.memory_reserved(),
        "allocated": torch.cuda.memory_allocated(),
        "device_used": device_used(),
        "counters": {k: v for k, v in torch.cuda.memory_stats().items() if k.startswith("torchmem.")},
        "segments": segments,
    }


def _steps(label):
    """test_device_memory_used's own steps (MEMPROBE_MODE=steps)."""
    import torch

    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    before = _state()
    x = torch.empty(PROBE_BYTES, dtype=torch.int8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    after = _state()
    del x
    torch.cuda.empty_cache()
    added = after["device_used"] - before["device_used"]
    _write({"test": label, "mode": "steps", "added_mib": added / 2**20,
            "would_pass": PROBE_BYTES // 32 <= added <= PROBE_BYTES * 32, "before": before, "after": after})


def _history_rows(test, snapshot):
    """One row per event of a torch memory snapshot's trace, then one with its segments."""
    for events in snapshot.get("device_traces", []):
        for e in events:
            frames = [f"{f.get('filename', '').rsplit('/', 1)[-1]}:{f.get('line')}:{f.get('name')}"
                      for f in (e.get("frames") or [])[:4]]
            yield {"test": test, "action": e.get("action"), "addr": e.get("addr"), "size": e.get("size"),
                   "stream": e.get("stream"), "frames": frames}
    yield {"test": test, "segments": [
        {"address": s["address"], "size": s["total_size"], "allocated": s["allocated_size"], "stream": s.get("stream")}
        for s in snapshot.get("segments", [])]}


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    name = item.nodeid.rsplit("::", 1)[-1]
    if not OUT or MODE not in ("watch", "history") or (WATCHED and name not in WATCHED):
        yield
        return
    import torch

    if MODE == "history":
        torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        try:
            yield
        finally:
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            for row in _history_rows(item.nodeid, snapshot):
                _write(row)
        return

    readings = []
    real = torch.cuda.device_memory_used

    def recording(*args, **kwargs):
        # the allocator's state at each reading the test takes: what it holds there, not after
        value = real(*args, **kwargs)
        readings.append({**_state(real), "device_used": value})
        return value

    start = _state()
    torch.cuda.device_memory_used = recording
    try:
        yield
    finally:
        torch.cuda.device_memory_used = real
        _write({"test": item.nodeid, "mode": "watch", "start": start, "end": _state(), "readings": readings})


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if OUT and MODE == "steps":
        try:
            _steps(item.nodeid)
        except Exception as e:  # noqa: BLE001 - a probe that fails is logged, the run goes on
            _write({"test": item.nodeid, "mode": "steps", "error": repr(e)})
