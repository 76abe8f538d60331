"""The measured figures the demo and replay commands print beside a replay.

torchmem/data/anchors.jsonl holds, per bundled workload and allocator setting,
what the training run behind each bundled trace measured on the H200 (steps,
median step time, driver calls). The demo and `replay` read them here, one
module below both, so neither command imports the other; step_cost_us turns a
replay's driver time and device waits into host time on such a step.
"""

import json
import os


def load_anchors(path=None):
    """Rows of torchmem/data/anchors.jsonl: {workload: {conf: row}} (the first row per pair)."""
    path = path or os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data", "anchors.jsonl")
    anchors = {}
    if not os.path.isfile(path):
        raise FileNotFoundError(f"torchmem's measured figures are missing: {path} (a broken install? "
                                f"reinstall torchmem)")
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line:
                row = json.loads(line)
                anchors.setdefault(row["workload"], {}).setdefault(row["conf"], row)
    return anchors


def step_timing(anchor_rows):
    """(steps in the trace, median native step in ms) measured on the H200, or (None, None)."""
    native = anchor_rows.get("native")
    if not native or not native.get("n_steps"):
        return None, None
    return native["n_steps"], native["median_step_s"] * 1000


# Note [Barrier cost] A wait for the whole device costs the host more than the
# call: the kernels queued ahead of it drain first, and the GPU then idles
# while the host queues the next ones. The simulator charges the call alone
# (device_sync_us); the replay's step figures add BARRIER_DRAIN_STEPS of the
# workload's measured step per wait. Why a third: a least-squares fit of the
# H200's warm-up steps under a budget gives about a third of a step per wait.
# A wait drains only what the host queued ahead of it, so where a run measured
# the step's lag (the time from the host's last launch to the step's end:
# lockstep's enqueue_s), the drain per wait is at most that lag: a host-bound
# step, whose GPU keeps up with each launch, loses almost nothing to a wait
# however long the step (long gradient accumulation is the case). The model
# leaves out the planning pass (host time, reported apart: Note [Planning pass
# cost]). Driver calls themselves neither wait for the device nor slow its
# kernels (bench/vmm_busy_probe.py), so what they and the barriers add is host
# time: the step's time where the step is host-bound, and an upper bound where
# the GPU is the bottleneck and hides it. BENCHMARKS.md, The replay's time
# model against the GPU.
BARRIER_DRAIN_STEPS = 1 / 3


def step_cost_us(driver_us, barriers, step_ms, lag_ms=None):
    """Modeled host time of the driver calls plus the pipeline drained by `barriers` device waits
    (Note [Barrier cost]), in microseconds. `lag_ms`, where measured: the step's GPU work still
    queued when the host had launched it all, which bounds each wait's drain."""
    drain_ms = BARRIER_DRAIN_STEPS * step_ms
    if lag_ms is not None:
        drain_ms = min(drain_ms, max(0.0, lag_ms))
    return driver_us + barriers * drain_ms * 1000
