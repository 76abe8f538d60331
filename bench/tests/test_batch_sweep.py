"""bench/batch_sweep.py's plumbing on the CPU (--smoke: tiny HF GPT-2 and
Llama-under-FSDP2 models, a size limit for a budget): the child runs every
method (Lightning's tuner aside: the slowest to start, and the same plumbing),
the parent collects RESULT lines into JSON lines and Markdown tables. The
figures mean nothing here; the GPU run makes them."""

import json
import os
import subprocess
import sys

from bench_support import REPO


def test_smoke_sweep_runs_every_method_and_writes_the_tables(tmp_path):
    out, table = tmp_path / "sweep.jsonl", tmp_path / "sweep.md"
    env = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
    proc = subprocess.run(
        [sys.executable, os.path.join(REPO, "bench", "batch_sweep.py"), "--smoke", "--allocators", "native",
         "--methods", "sweep,throughput,accelerate", "--out", str(out), "--table", str(table)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = {(r["model"], r["method"]): r for r in map(json.loads, out.read_text().splitlines())}
    assert set(results) == {("gpt2", "sweep"), ("gpt2", "throughput"), ("gpt2", "accelerate"),
                            ("llama", "sweep"), ("llama", "throughput")}
    for model in ("gpt2", "llama"):
        sweep = results[model, "sweep"]
        assert [m for m, rate in sweep["by_micro"].items() if rate] == ["1", "2", "3"]  # 3 of 8 samples fit
        assert sweep["by_micro"]["4"] is None and sweep["micro"] in (1, 2, 3)
        controller = results[model, "throughput"]
        assert controller["micro"] <= 3 and controller["ooms"] >= 1 and controller["samples_per_s"] > 0
        assert controller["steps_to_settle"] <= len(controller["history"])
        assert any(d[1] == "settle" for d in controller["decisions"])
    assert "skipped" in results["gpt2", "accelerate"] or results["gpt2", "accelerate"]["micro"] <= 3
    text = table.read_text()
    assert "| gpt2 | native | throughput |" in text and "| llama | native | best fixed | " in text
    assert "vs best fixed" in text and "| llama | native | " in text.split("\n\n")[1]
    again = subprocess.run([sys.executable, os.path.join(REPO, "bench", "batch_sweep.py"), "--from", str(out)],
                           cwd=REPO, env=env, capture_output=True, text=True, timeout=60)
    assert again.returncode == 0 and again.stdout.strip() == text.split("\n\n5 runs")[0].strip()
