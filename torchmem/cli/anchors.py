"""The measured figures the demo and replay commands print beside a replay.

torchmem/data/anchors.jsonl holds, per bundled workload and allocator setting,
what the training run behind each bundled trace measured on the H200 (steps,
median step time, driver calls). The demo and `replay` read them here, one
module below both, so neither command imports the other.
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
