"""bench/lockstep.py: processes that take turns one segment at a time. Checked with small
Python workers in place of the GPU workloads: no two segments overlap, every worker runs all
of its segments, the turn order rotates, a failing or stuck worker is reported, and the
tables (bench/lockstep_tables.py) divide the right steps."""

import json
import os
import re
import subprocess
import sys
import types

import pytest

from bench_support import REPO, load_bench

lockstep = load_bench("lockstep")
lockstep_tables = load_bench("lockstep_tables")
SCRIPT = os.path.join(REPO, "bench", "lockstep.py")

# A worker: start-up, then SEGMENTS segments each behind a gate, logging when each ran.
WORKER = """
import sys, time
sys.path.insert(0, {bench!r})
from lockstep import Gate
name, log, segments, fail = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
gate = Gate(sys.argv[sys.argv.index("--lockstep") + 1])
for i in range(segments):
    gate.wait()
    start = time.monotonic()
    time.sleep(0.01)
    with open(log, "a") as f:
        f.write(f"{{name}} {{i}} {{start}} {{time.monotonic()}}\\n")
if fail == "exit":
    sys.exit(3)
if fail == "hang":
    time.sleep(60)
"""


def worker(tmp_path, name, segments, fail="none"):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(bench=f"{REPO}/bench"))
    return name, [sys.executable, str(script), name, str(tmp_path / "log"), str(segments), fail]


def segments(tmp_path):
    rows = [line.split() for line in (tmp_path / "log").read_text().splitlines()]
    return [(name, int(i), float(start), float(end)) for name, i, start, end in rows]


def test_segments_run_one_at_a_time_in_rotating_order(tmp_path):
    codes = lockstep.run_lockstep([worker(tmp_path, n, 4) for n in ("a", "b", "c")], timeout_s=30)
    assert codes == {"a": 0, "b": 0, "c": 0}
    ran = segments(tmp_path)
    assert sorted((n, i) for n, i, _, _ in ran) == [(n, i) for n in "abc" for i in range(4)]
    by_time = sorted(ran, key=lambda r: r[2])
    for earlier, later in zip(by_time, by_time[1:]):
        assert earlier[3] <= later[2], f"{earlier} overlaps {later}"
    turns = [[n for n, i, _, _ in by_time if i == k] for k in range(4)]
    assert turns[0] == ["a", "b", "c"] and turns[1] == ["b", "c", "a"] and turns[2] == ["c", "a", "b"]


def test_workers_of_different_lengths_and_a_failing_one(tmp_path):
    codes = lockstep.run_lockstep([worker(tmp_path, "short", 1), worker(tmp_path, "long", 3),
                                   worker(tmp_path, "bad", 2, fail="exit")], timeout_s=30)
    assert codes == {"short": 0, "long": 0, "bad": 3}
    assert sorted((n, i) for n, i, _, _ in segments(tmp_path)) == [
        ("bad", 0), ("bad", 1), ("long", 0), ("long", 1), ("long", 2), ("short", 0)]


def test_a_stuck_worker_is_named_and_killed(tmp_path):
    stuck = worker(tmp_path, "stuck", 1, fail="hang")
    with pytest.raises(TimeoutError, match="stuck did not reach a gate"):
        lockstep.run_lockstep([stuck], timeout_s=1)


def test_without_a_spec_the_gate_does_nothing():
    lockstep.Gate(None).wait()


def result(allocator, seed, steps, process):
    return {"workload": "llama_ckpt", "allocator": allocator, "seed": seed, "step_s": steps,
            "total_s": sum(steps), "lockstep": {"group": f"llama_ckpt/{seed}", "process": process}}


def tables(tmp_path, rows, *options):
    """The tables `python bench/lockstep.py table FILE [OPTIONS]` prints for `rows`, as its lines."""
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    proc = subprocess.run([sys.executable, SCRIPT, "table", str(path), *options], capture_output=True, text=True,
                          check=True)
    return proc.stdout.splitlines()


# One granule per call, every driver call 10 us (bench/gpu_probe.py's JSON run keys).
PROBE_RUN = {"granules_per_map": 1, "cuMemAddressReserve_us": 20, "cuMemCreate_us_per_granule": 10,
             "map_and_set_access_us_per_call": 10, "cuMemUnmap_us_per_call": 10, "cuMemRelease_us_per_granule": 10,
             "event_record_us": 1, "event_query_us": 1, "stream_wait_us": 1, "cudaMalloc_20MiB_us": 50,
             "cudaFree_20MiB_us": 50}


def warm_up_row(steps, **counts):
    """torchmem at 1.05x, one shape, whose first step made the driver calls in `counts` (the
    backend's counts by kind, and any other per-step counter) and every later step none."""
    plan = [dict({"num_plan_passes": 0, "plan_pass_us": 0, "create_calls": 0, "map_calls": 0,
                  "unmap_calls": 0, "release_calls": 0}, **counts)] + [{}] * (len(steps) - 1)
    calls = sum(v for k, v in counts.items() if k.endswith("_calls"))
    return dict(result("torchmem", 1, steps, "torchmem#0"), shapes=1, budget=1.05,
                driver_calls_per_step=[calls] + [0] * (len(steps) - 1), barriers_per_step=[0] * len(steps),
                plan_per_step=plan)


def test_paired_steps_divides_medians_of_the_same_step_within_a_group(tmp_path):
    rows = [result("native", 1, [1.0, 2.0], "native#0"), result("native", 1, [3.0, 2.0], "native#1"),
            result("torchmem", 1, [1.0, 1.0], "torchmem#0"), result("torchmem", 1, [3.0, 3.0], "torchmem#1"),
            result("native", 2, [4.0], "native#0"), result("torchmem", 2, [2.0], "torchmem#0"),
            result("expandable", 3, [1.0], "expandable#0")]  # no native in its group: not paired
    lines = tables(tmp_path, rows)
    # group 1: medians native [2, 2], torchmem [2, 2] -> 1, 1; group 2: 0.5: 3 steps of 3 processes,
    # geomean 0.5 ** (1/3)
    assert "| llama_ckpt none | torchmem | 3 | 3 | 0.794 (0.50-1.00) |" in lines
    paired = [line for line in lines if line.startswith("| llama_ckpt none |")]
    assert len(paired) == 1  # expandable had no native to pair with
    assert "| llama_ckpt | none | native | 3 | 0 |" in "\n".join(lines)


def test_steady_table_compares_the_last_whole_cycles_with_native_in_the_fairest_group(tmp_path):
    """At a budget the warm-up (where the pool learns its layout) is left out: the timed steps from
    the first that made no driver call, in whole shape cycles, against the same steps of native
    with no budget."""
    native = dict(result("native", 1, [1.0] * 12, "native#0"), shapes=2)
    warm = [3.0] * 6 + [1.1] * 6  # slow while it learns, then 10% over native
    torchmem = dict(result("torchmem", 1, warm, "torchmem#0"), shapes=2, budget=1.05,
                    driver_calls_per_step=[900] * 6 + [0] * 6, barriers_per_step=[1] * 6 + [0] * 6)
    ran_out = dict(result("native", 1, [], "native#1"), budget=1.05, oom_at_step=3)
    table = "\n".join(tables(tmp_path, [native, torchmem, ran_out]))
    # quiet from timed step 6: its last 6 steps, three whole cycles of 2 shapes
    assert "| llama_ckpt | 1.05x | torchmem | 6 | 6 | 0 | 0 | 1.100 |" in table
    assert "| llama_ckpt | 1.05x | native | OOM | - | - | - | - |" in table
    assert "native | 4" not in table  # the unconstrained group is the baseline, not a row
    assert "| 1.100 | no budget (another group) |" in table
    # Where native fits the budget too, its own group (same pace, steps taken in turn) is the baseline.
    native_fits = dict(result("native", 1, [1.2] * 12, "native#1"), shapes=2, budget=1.05)
    (tmp_path / "fits").mkdir()
    table = "\n".join(tables(tmp_path / "fits", [native, torchmem, native_fits]))
    assert "| llama_ckpt | 1.05x | torchmem | 6 | 6 | 0 | 0 | 0.917 | the same budget |" in table
    # Where it does not, the budget group's own reference processes (native with no budget, taking
    # turns with torchmem's) come before the unconstrained group run minutes apart.
    reference = dict(result("native (no budget)", 1, [1.0] * 6 + [1.25] * 6, "native (no budget)#0"), shapes=2,
                     budget=1.05, reference=True, driver_calls_per_step=[5] * 12)
    (tmp_path / "reference").mkdir()
    table = "\n".join(tables(tmp_path / "reference", [native, torchmem, ran_out, reference]))
    assert "| llama_ckpt | 1.05x | torchmem | 6 | 6 | 0 | 0 | 0.880 | no budget, same group |" in table
    assert "native (no budget) | 6" not in table  # the reference is a baseline, not a steady row
    assert "torchmem#0" in table and "native (no budget)#0" not in table  # nor a warm-up row


def test_warmup_table_takes_out_planning_passes_and_barriers_before_pricing_a_call(tmp_path):
    """The warm-up's time over the same shapes once quiet, split: planning passes (their own
    counter), a third of a step per barrier, and the rest over the driver calls."""
    steps = [0.2, 0.1, 0.5] + [0.05] + [0.1, 0.05] * 2  # quiet from step 3: shape 0 takes 0.1 s, shape 1 0.05 s
    plan = [{"num_plan_passes": 0, "plan_pass_us": 0}] * 2  # two untimed warm-up steps come first
    plan += [{"num_plan_passes": 0, "plan_pass_us": 0}, {}, {"num_plan_passes": 1, "plan_pass_us": 300_000}, {}]
    plan += [{}] * 4
    torchmem = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=2, budget=1.05,
                    driver_calls_per_step=[1000, 0, 500, 0, 0, 0, 0, 0], barriers_per_step=[1, 0, 0, 0, 0, 0, 0, 0],
                    plan_per_step=plan)
    table = "\n".join(tables(tmp_path, [torchmem]))
    # added: (0.2-0.1) + (0.1-0.05) + (0.5-0.1) = 0.55 s; pass 300 ms; barrier 0.1/3 s
    # per call: (550 - 300 - 33.3) ms / 1,500 calls = 144.4 us
    # ("-": no process of its group made no call, so no drift to take out)
    assert "| llama_ckpt | 1.05x | torchmem | torchmem#0 | 3 | 1,500 | - | 1 | 1: 300 | 550 | - | 144.4 |" in table
    # With the calls by kind recorded, the calls are the backend's own count (it sees unmaps that
    # the step's driver_calls_per_step of older runs left out) and the unmaps among them are counted apart.
    plan = [dict(p, unmap_calls=0, map_calls=0) for p in plan]
    plan[2].update(unmap_calls=400, map_calls=700)
    plan[4].update(unmap_calls=100, map_calls=400)
    (tmp_path / "kinds").mkdir()
    table = "\n".join(tables(tmp_path / "kinds", [dict(torchmem, plan_per_step=plan)]))
    assert "| torchmem#0 | 3 | 1,600 | 500 | 1 |" in table


def test_warmup_table_bounds_a_barrier_s_drain_by_the_step_s_lag(tmp_path):
    """Note [Barrier cost]: where the run recorded when the host had queued each step (enqueue_s),
    a barrier drains at most the step's lag behind it; on a host-bound step (lag 2 ms of 100) that,
    not a third of the step, is taken out before pricing the calls."""
    steps = [0.2, 0.1, 0.5] + [0.05] + [0.1, 0.05] * 2  # as above: quiet from step 3
    plan = [{"num_plan_passes": 0, "plan_pass_us": 0}] * 3 + [{}, {"num_plan_passes": 1, "plan_pass_us": 300_000}]
    plan += [{}] * 5
    lags = [0.002 if i % 2 == 0 else 0.001 for i in range(len(steps))]  # shape 0: 2 ms, shape 1: 1 ms
    torchmem = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=2, budget=1.05,
                    driver_calls_per_step=[1000, 0, 500, 0, 0, 0, 0, 0], barriers_per_step=[1, 0, 0, 0, 0, 0, 0, 0],
                    plan_per_step=plan, enqueue_s=[step - lag for step, lag in zip(steps, lags)])
    # per call: (550 - 300 - 2) ms / 1,500 calls = 165.3 us (a third of the step would leave 144.4)
    assert "| torchmem#0 | 3 | 1,500 | - | 1 | 1: 300 | 550 | - | 165.3 |" in "\n".join(tables(tmp_path, [torchmem]))


def test_main_tags_each_result_with_its_group(tmp_path, monkeypatch):
    """main() end to end with a stand-in for gpu_workloads.py that writes a result line."""
    stand_in = tmp_path / "stand_in.py"
    stand_in.write_text(f"""
import json, sys
sys.path.insert(0, {REPO + '/bench'!r})
from lockstep import Gate
argv = sys.argv
value = lambda flag: argv[argv.index(flag) + 1]
gate = Gate(value("--lockstep"))
steps = []
for i in range(int(value("--steps"))):
    gate.wait()
    steps.append(0.1 if value("--allocator") == "native" else 0.09)
fraction = float(value("--memory-fraction")) if "--memory-fraction" in argv else None
# under a budget of 1.02x its peak request (1 GiB of 100), "native" runs out of memory
oom = 0 if fraction and fraction < 0.0103 and value("--allocator") == "native" else None
with open(value("--out"), "w") as f:
    f.write(json.dumps({{"workload": value("--workload"), "allocator": value("--allocator"),
                        "seed": int(value("--seed")), "step_s": [] if oom is not None else steps,
                        "total_s": 0 if oom is not None else sum(steps), "oom_at_step": oom,
                        "peak_requested": 1 << 30, "device_total": 100 << 30, "memory_fraction": fraction,
                        "driver_calls_per_step": [0] * len(steps), "barriers_per_step": [0] * len(steps)}}) + "\\n")
""")
    monkeypatch.setattr(lockstep, "worker_argv", lambda workload, allocator, seed, args, out, fraction=None,
                        budget_bytes=None: [
        sys.executable, str(stand_in), "--workload", workload, "--allocator", allocator, "--seed", str(seed),
        "--steps", str(args.steps), "--out", out] + (["--memory-fraction", str(fraction)] if fraction else []))
    out = tmp_path / "out.jsonl"
    assert lockstep.main(["--workload", "gpt2", "--allocators", "native", "torchmem", "--per-allocator", "2",
                          "--steps", "3", "--seeds", "1", "2", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 8
    assert {r["lockstep"]["group"] for r in rows} == {"gpt2/1/none", "gpt2/2/none"}
    assert sorted(r["lockstep"]["process"] for r in rows if r["seed"] == 1) == [
        "native#0", "native#1", "torchmem#0", "torchmem#1"]
    assert lockstep_tables.paired_steps(rows)[(("gpt2", None), "torchmem")]["geomean"] == pytest.approx(0.9)
    assert lockstep.main(["table", str(out), str(out)]) == 0

    # budgets: each seed's group again under budget x its peak request, as a memory fraction
    out = tmp_path / "budget.jsonl"
    assert lockstep.main(["--workload", "gpt2", "--allocators", "native", "torchmem", "--per-allocator", "1",
                          "--steps", "3", "--seeds", "1", "--budgets", "1.02", "1.5", "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    by_budget = {}
    for r in rows:
        by_budget.setdefault(r["budget"], []).append(r)
    assert set(by_budget) == {None, 1.02, 1.5}
    assert [r["memory_fraction"] for r in by_budget[1.02] if not r.get("reference")] == [pytest.approx(0.0102)] * 2
    assert [r["oom_at_step"] for r in by_budget[1.02] if r["allocator"] == "native"] == [0]
    paired = lockstep_tables.paired_steps(rows)
    assert (("gpt2", 1.02), "torchmem") not in paired  # native did not fit: nothing to pair with
    assert paired[(("gpt2", 1.5), "torchmem")]["geomean"] == pytest.approx(0.9)
    assert "| gpt2 | 1.02x | native | 1 | 1 | - |" in lockstep_tables.process_table(rows)
    # each budget group ran native with no budget beside the others: the same pace, a fair baseline
    references = [r for r in rows if r.get("reference")]
    assert [(r["budget"], r["allocator"], r["memory_fraction"]) for r in references] == [
        (1.02, "native (no budget)", None), (1.5, "native (no budget)", None)]
    assert "| 0.900 | no budget, same group |" in lockstep_tables.steady_table(rows)
    out = tmp_path / "no_reference.jsonl"
    assert lockstep.main(["--workload", "gpt2", "--allocators", "native", "torchmem", "--per-allocator", "1",
                          "--steps", "3", "--seeds", "1", "--budgets", "1.02", "--reference", "none",
                          "--out", str(out)]) == 0
    assert not any(json.loads(line).get("reference") for line in out.read_text().splitlines())


def test_a_run_that_ends_before_it_settles_says_so(tmp_path):
    """Its last steps still make driver calls: the steady figures are warm-up, and the table says
    "never" rather than passing them off as the step a long run repeats."""
    native = dict(result("native", 1, [1.0] * 8, "native#0"), shapes=4)
    torchmem = dict(result("torchmem", 1, [2.0] * 8, "torchmem#0"), shapes=4, budget=1.05,
                    driver_calls_per_step=[0, 900, 0, 0, 0, 0, 0, 14000], barriers_per_step=[0] * 8)
    table = "\n".join(tables(tmp_path, [native, torchmem]))
    assert "| llama_ckpt | 1.05x | torchmem | never | 4 | 14000 | 0 | 2.000 |" in table


def test_pooled_table_says_whether_the_steady_steps_resolve_the_line():
    """Per step, the mean over the allocator's processes over the baseline's, geomean over the
    steady steps with two standard errors either side; the verdict reads the interval, not the mean."""
    def at_budget(allocator, steps, process):
        return dict(result(allocator, 1, steps, process), budget=1.10, driver_calls_per_step=[0] * len(steps),
                    barriers_per_step=[0] * len(steps))

    native = [at_budget("native", [0.1] * 12, "native#0")]
    # Every step exactly 1% slower: no spread, so the interval is the point and lies under 1.03.
    steady = lockstep_tables.pooled_table(native + [at_budget("torchmem", [0.101] * 12, "torchmem#0")])
    assert "| llama_ckpt | 1.1x | 1 | torchmem | 1 | 12 | 1.010 (1.010-1.010) | the same budget | under |" in steady
    # The same mean with steps 0.9x and 1.1x in turn: the interval spans the line.
    noisy = [0.09, 0.11] * 6
    table = lockstep_tables.pooled_table(native + [at_budget("torchmem", noisy, "torchmem#0")])
    assert "| unresolved |" in table
    # Two processes pooled: their per-step mean (1.05x) is what is compared.
    table = lockstep_tables.pooled_table(native + [at_budget("torchmem", [0.100] * 12, "torchmem#0"),
                                            at_budget("torchmem", [0.110] * 12, "torchmem#1")])
    assert "| llama_ckpt | 1.1x | 1 | torchmem | 2 | 12 | 1.050 (1.050-1.050) | the same budget | over |" in table
    # A baseline from another group (run minutes apart) gets a ratio but no verdict.
    unconstrained = [dict(at_budget("native", [0.1] * 12, "native#0"), budget=None)]
    table = lockstep_tables.pooled_table(unconstrained + [at_budget("torchmem", [0.101] * 12, "torchmem#0")])
    assert "| no budget (another group) | - (another group) |" in table
    # A run shorter than its steady window, or of one step, gives no row and no error.
    table = lockstep_tables.pooled_table(native + [at_budget("torchmem", [0.1], "torchmem#0")])
    assert len(table.splitlines()) == 2


def test_added_noise_is_two_deviations_of_the_warm_up_sum():
    """Each warm-up step is as spread as the quiet steps of its shape; their variances add."""
    # quiet from step 2, two shapes: shape 0's quiet steps 0.1, 0.3 (variance 0.02), shape 1's 0.2, 0.2 (0)
    steps = [0.5, 0.5, 0.1, 0.2, 0.3, 0.2]
    by_shape = lockstep_tables.quiet_by_shape(steps, 2, 2)
    assert by_shape == {0: [0.1, 0.3], 1: [0.2, 0.2]}
    assert lockstep_tables.added_noise_ms(by_shape, 2) == pytest.approx(2 * 0.02 ** 0.5 * 1e3)
    assert lockstep_tables.added_noise_ms(lockstep_tables.quiet_by_shape([0.5, 0.1], 1, 1), 1) == 0  # one quiet step: no spread known


def test_warmup_table_reads_the_model_against_the_steps_spread(tmp_path):
    """An added time inside the quiet steps' spread gets no percentage: the model is either within
    that noise or off by a stated number of ms."""
    steps = [0.12, 0.08, 0.12, 0.10, 0.08, 0.12, 0.08]  # quiet from step 1, one shape, spread ~0.02 s
    plan = [{"num_plan_passes": 0, "plan_pass_us": 0, "create_calls": 0, "map_calls": 100,
             "unmap_calls": 0, "release_calls": 0}] + [{}] * 6
    row = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=1, budget=1.05,
               driver_calls_per_step=[100] + [0] * 6, barriers_per_step=[0] * 7, plan_per_step=plan)
    table = "\n".join(tables(tmp_path, [row]))
    assert "| 30 | - | - | 2 | within noise (±39 ms) |" in table  # added 0.12 - median 0.09; 100 maps: 2 ms
    plan[0]["map_calls"] = 10_000  # ~196 ms modeled against 30 ms added inside ±39 ms
    (tmp_path / "over").mkdir()
    table = "\n".join(tables(tmp_path / "over", [dict(row, plan_per_step=plan)]))
    assert "ms (added within ±39 ms) |" in table and "| 30 | - | - |" in table
    # --costs: the same maps at a probed GPU's price (bench/gpu_probe.py's JSON): 10,000 at 10 us = 100 ms
    probe = {"runs": [PROBE_RUN]}
    (tmp_path / "probe.json").write_text(json.dumps(probe))
    (tmp_path / "probed").mkdir()
    table = "\n".join(tables(tmp_path / "probed", [dict(row, plan_per_step=plan)], "--costs",
                             str(tmp_path / "probe.json")))
    assert "| 30 | - | - | 100 | +70 ms (added within ±39 ms) |" in table
    # An added time that stands out of the noise, modeled within it: the point error is stated too
    # (added 0.62 - 0.09 = 530 ms, past the ±39 ms; 27,000 maps are modeled at ~529 ms).
    (tmp_path / "out").mkdir()
    table = "\n".join(tables(tmp_path / "out", [dict(row, step_s=[0.62] + steps[1:], plan_per_step=[
        dict(plan[0], map_calls=27_000)] + plan[1:])]))
    assert re.search(r"\| [+-]\d+%, within noise \(±39 ms\) \|", table), table


def test_costs_run_prices_the_warm_up_at_the_probe_s_run_in_those_conditions(tmp_path):
    """--costs-run LIVE,MIB picks the probe's run timed with that many granules mapped and that much
    host memory walked (gpu_probe.py --live-granules, --evict-mib); one the probe lacks, or a run
    asked for with no probe, is refused before any table is printed."""
    row = warm_up_row([0.5, 0.1, 0.1, 0.1], map_calls=10_000)  # quiet from step 1
    run = PROBE_RUN
    loaded = dict(run, map_and_set_access_us_per_call=30, live_granules=5000, evict_bytes=64 << 20)
    (tmp_path / "probe.json").write_text(json.dumps({"runs": [run, loaded]}))
    for name, extra, model in (("plain", [], "| 400 | - | 40.0 | 100 | -75% |"),
                               ("loaded", ["--costs-run", "5000,64"], "| 400 | - | 40.0 | 300 | -25% |")):
        (tmp_path / name).mkdir()
        table = "\n".join(tables(tmp_path / name, [row], "--costs", str(tmp_path / "probe.json"), *extra))
        assert model in table, name
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    proc = subprocess.run([sys.executable, SCRIPT, "table", str(tmp_path / "rows.jsonl"), "--costs",
                           str(tmp_path / "probe.json"), "--costs-run", "5000,0"], capture_output=True, text=True)
    assert proc.returncode == 2 and not proc.stdout
    assert "with 5000 live granules and 0 bytes walked" in proc.stderr and "--live-granules" in proc.stderr
    alone = subprocess.run([sys.executable, SCRIPT, "table", str(tmp_path / "rows.jsonl"), "--costs-run", "5000,64"],
                           capture_output=True, text=True)
    assert alone.returncode == 2 and not alone.stdout and "--costs PROBE.json" in alone.stderr


def test_warmup_table_takes_out_what_the_same_steps_added_in_the_group_s_call_free_processes(tmp_path):
    """Processes that take turns share the machine's pace: where the group's call-free processes
    (the reference with no budget) also ran their first steps slower, that part of the warm-up's
    added time is the group's drift, not the allocator's, and the model is read against the rest."""
    steps = [0.30, 0.30] + [0.10] * 6  # quiet from step 2, one shape: 400 ms added
    plan = [{"num_plan_passes": 0, "plan_pass_us": 0, "create_calls": 0, "map_calls": 0, "unmap_calls": 0,
             "release_calls": 0}] * 8
    plan[0], plan[1] = dict(plan[0], map_calls=4999), dict(plan[1], map_calls=1)  # ~98 ms at the simulator's map + access
    torchmem = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=1, budget=1.05,
                    driver_calls_per_step=[4999, 1] + [0] * 6, barriers_per_step=[0] * 8, plan_per_step=plan)
    # two reference processes whose own first two steps took 150 and 170 ms over their later ones
    refs = [dict(result("native (no budget)", 1, [0.10 + extra, 0.10 + extra] + [0.10] * 6, f"native (no budget)#{i}"),
                 shapes=1, budget=1.05, reference=True, driver_calls_per_step=[0] * 8, barriers_per_step=[0] * 8)
            for i, extra in enumerate((0.075, 0.085))]
    ran_out = dict(result("native", 1, [0.2], "native#0"), shapes=1, budget=1.05, oom_at_step=1)  # no steps: left out
    other = dict(refs[0], lockstep={"group": "llama_ckpt/2", "process": "native (no budget)#9"})  # another group
    row = [line for line in tables(tmp_path, [torchmem, *refs, ran_out, other]) if "| torchmem#0 | 2 |" in line][0]
    cells = [c.strip() for c in row.strip("|").split("|")]
    assert cells[9:11] == ["400", "160"]  # added, and the drift: the mean of 150 and 170
    assert int(cells[12]) == pytest.approx(98, abs=1)  # the model: the maps alone
    # net 240 ms against the model's 98; the drift's noise: 2 x stdev(150, 170) / sqrt(2) = 20 ms
    assert cells[13] == "-59%"
    by_itself = [line for line in tables(tmp_path, [torchmem]) if "| torchmem#0 | 2 |" in line][0]
    assert "| 400 | - | 80.0 | 98 | -75% |" in by_itself  # alone: the whole 400 ms is the allocator's


def test_shape_table_gives_each_shapes_steady_step_and_enqueue_medians(tmp_path):
    """Two shapes in turn, quiet from timed step 2: shape 0's steady steps are 2, 4, 6 and shape 1's
    3, 5, 7; the table prints each one's median step and median enqueue, in ms, per process."""
    steps = [0.5, 0.5, 0.10, 0.20, 0.12, 0.22, 0.11, 0.21]
    row = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=2, budget=1.1,
               enqueue_s=[s - 0.01 for s in steps], driver_calls_per_step=[9, 9, 0, 0, 0, 0, 0, 0],
               barriers_per_step=[0] * 8)
    lines = tables(tmp_path, [row])
    shape_rows = [line for line in lines if line.startswith("| llama_ckpt | 1.1x | torchmem | torchmem#0 |")]
    assert shape_rows[-1].endswith("| 110.0 / 100.0; 210.0 / 200.0 |")
    no_enqueue = lockstep_tables.shape_table([dict(row, enqueue_s=[])])
    assert no_enqueue.splitlines()[-1].endswith("| 110.0 / -; 210.0 / - |")


def test_host_time_table_gives_the_pools_share_of_steady_steps(tmp_path):
    """time_host_ops counters per step (plan_per_step, warm-up steps included) over the steady
    steps only: per allocation and per step, beside the median enqueue."""
    steps = [0.5, 0.5, 0.10, 0.10]
    counters = [dict(host_alloc_ns=9_000_000, host_free_ns=9_000_000, host_plan_ns=1)] * 3  # warm-up, 2 noisy
    counters += [dict(host_alloc_ns=1_000_000, host_free_ns=500_000, host_plan_ns=300_000)] * 2
    row = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=1, budget=1.1, warmup=1,
               enqueue_s=[0.4, 0.4, 0.09, 0.07], driver_calls_per_step=[9, 9, 0, 0], barriers_per_step=[0] * 4,
               allocs_per_step=[1000] * 4, plan_per_step=counters)
    lines = tables(tmp_path, [row])
    timed = [line for line in lines if line.startswith("| llama_ckpt | 1.1x | torchmem | torchmem#0 | 2 |")]
    assert timed[-1] == "| llama_ckpt | 1.1x | torchmem | torchmem#0 | 2 | 1,000 + 500 (300) | 1.50 | 80.0 |"
    # Without the option every counter is 0: no table.
    quiet = [dict(c, host_alloc_ns=0, host_free_ns=0, host_plan_ns=0) for c in counters]
    assert "pool ns per allocation" not in "\n".join(tables(tmp_path, [dict(row, plan_per_step=quiet)]))


# ---- the per-sample table and "NAME@S" allocators (a smaller batch where native cannot fit a budget) ----


def budget_row(allocator, step_s, samples, seed=1, oom=None, budget=1.05):
    """One process's result under a budget, as gpu_workloads.py writes it (quiet from the first step)."""
    return {"workload": "gpt2", "allocator": allocator, "seed": seed, "budget": budget, "shapes": 1,
            "step_s": step_s, "samples_per_step": samples, "oom_at_step": oom,
            "driver_calls_per_step": [0] * len(step_s), "barriers_per_step": [0] * len(step_s)}


def table_rows(text):
    """The table's data rows as lists of cells."""
    return [[c.strip() for c in line.strip("|").split("|")] for line in text.splitlines()[2:]]


def test_batch_scale_reads_the_label():
    assert lockstep_tables.batch_scale("native@0.75") == ("native", 0.75)
    assert lockstep_tables.batch_scale("torchmem") == ("torchmem", 1.0)
    assert lockstep_tables.batch_scale("torchmem[backend=cuda_malloc]@0.5") == ("torchmem[backend=cuda_malloc]", 0.5)


def test_worker_argv_passes_the_batch_scale_and_options():
    args = types.SimpleNamespace(steps=12, shapes=4, kernel_time=False)
    argv = lockstep.worker_argv("gpt2", "torchmem:backend=cuda_malloc@0.5", 1, args, "out.jsonl", 0.25)
    assert argv[argv.index("--allocator") + 1] == "torchmem"
    assert argv[argv.index("--torchmem-conf") + 1] == "backend=cuda_malloc"
    assert argv[argv.index("--batch-scale") + 1] == "0.5"
    assert argv[argv.index("--memory-fraction") + 1] == "0.250000"
    plain = lockstep.worker_argv("gpt2", "native", 1, args, "out.jsonl")
    assert "--batch-scale" not in plain and "--torchmem-conf" not in plain


def test_per_sample_table_compares_with_the_largest_native_batch_that_fit():
    rows = [
        budget_row("native", [0.1, 0.1], [16, 16], oom=1),  # ran out of memory at the drawn batch
        budget_row("native@0.75", [0.09, 0.09], [12, 12]),  # 7.5 ms per sample
        budget_row("native@0.5", [0.07, 0.07], [8, 8]),  # fits too, smaller: not the one compared
        budget_row("torchmem", [0.1, 0.12], [16, 16]),  # 6.875 ms per sample
        budget_row("torchmem", [0.11, 0.11], [16, 16]),  # 6.875 ms per sample
    ]
    cells = {row[3]: row for row in table_rows(lockstep_tables.per_sample_table(rows))}
    assert cells["native"][6] == "OOM"
    assert cells["native@0.75"][6] == "7.500" and cells["native@0.75"][7] == "-"
    assert cells["torchmem"][5] == "2"  # both processes
    assert cells["torchmem"][6] == "6.875"
    assert cells["torchmem"][7] == "0.917 (native@0.75)"
    # the table lists the baseline family from its largest batch down
    order = [row[3] for row in table_rows(lockstep_tables.per_sample_table(rows))]
    assert order.index("native") < order.index("native@0.75") < order.index("native@0.5")


def test_per_sample_table_needs_a_fitting_native_for_a_ratio():
    rows = [budget_row("native", [0.1], [16], oom=0), budget_row("torchmem", [0.1], [16])]
    cells = {row[3]: row for row in table_rows(lockstep_tables.per_sample_table(rows))}
    assert cells["torchmem"][6] == "6.250" and cells["torchmem"][7] == "-"


def test_per_sample_table_counts_only_the_steady_steps():
    # a warm-up step with driver calls, then quiet: the warm-up's time and samples are left out
    row = budget_row("torchmem", [0.5, 0.1, 0.1, 0.1], [16, 16, 16, 16])
    row["driver_calls_per_step"] = [900, 0, 0, 0]
    native = budget_row("native@0.5", [0.06] * 4, [8] * 4)
    cells = {r[3]: r for r in table_rows(lockstep_tables.per_sample_table([row, native]))}
    assert cells["torchmem"][6] == "6.250"
    assert cells["torchmem"][7] == "0.833 (native@0.5)"


def test_rows_without_samples_are_left_out():
    old = budget_row("torchmem", [0.1], [16])
    del old["samples_per_step"]
    assert table_rows(lockstep_tables.per_sample_table([old])) == []


@pytest.mark.parametrize("bad", ["native@0", "native@1.5", "native@x"])
def test_a_bad_batch_scale_is_refused_before_anything_runs(bad, capsys):
    with pytest.raises(SystemExit):
        lockstep.main(["--workload", "gpt2", "--allocators", "native", bad, "--out", "unused.jsonl"])
    assert "batch scale" in capsys.readouterr().err


def test_gpu_workloads_scales_the_drawn_batch_and_names_the_row():
    gpu_workloads = load_bench("gpu_workloads")  # imports torch only when it runs a workload

    assert gpu_workloads.scale_batch((16, 512), 0.75) == (12, 512)
    assert gpu_workloads.scale_batch((1, 128), 0.5) == (1, 128)  # never below one sample
    assert gpu_workloads.scale_batch((4, 100, 20), 1.0) == (4, 100, 20)
    args = gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x",
                                     "--batch-scale", "0.5"])
    assert gpu_workloads.allocator_label(args) == "native@0.5"
    args = gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "torchmem", "--out", "x",
                                     "--torchmem-conf", "backend=cuda_malloc"])
    assert gpu_workloads.allocator_label(args) == "torchmem[backend=cuda_malloc]"
    with pytest.raises(SystemExit):
        gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x", "--batch-scale", "0"])


def test_the_smaller_batch_runs_only_under_a_budget(monkeypatch, tmp_path, capsys):
    seen = []

    def fake_run(commands, timeout_s):
        seen.append([name for name, _ in commands])
        return {name: 1 for name, _ in commands}  # as if every worker failed: nothing is read back

    monkeypatch.setattr(lockstep, "run_lockstep", fake_run)
    args = types.SimpleNamespace(workload="gpt2", allocators=["native", "native@0.75", "torchmem"], per_allocator=1,
                                 steps=12, shapes=4, kernel_time=False, timeout=1.0, reference="native",
                                 out=str(tmp_path / "out.jsonl"))
    lockstep.run_group(args, seed=1)
    lockstep.run_group(args, seed=1, budget=1.05, fraction=0.2)
    assert seen[0] == ["native#0", "torchmem#0"]
    assert seen[1] == ["native#0", "native@0.75#0", "torchmem#0", "native (no budget)#0"]


def test_a_known_peak_request_runs_only_the_budget_groups(monkeypatch, tmp_path):
    # --peak-request: a workload whose processes take minutes to start (torch.compile) runs each
    # budget group alone, every process told its budget in bytes (B x the peak) rather than a fraction
    seen = []

    def fake_run(commands, timeout_s):
        seen.append({name: argv for name, argv in commands})
        return {name: 1 for name, _ in commands}

    monkeypatch.setattr(lockstep, "run_lockstep", fake_run)
    lockstep.main(["--workload", "compile", "--allocators", "native", "torchmem", "--per-allocator", "1",
                   "--seeds", "1", "--budgets", "1.3", "1.5", "--peak-request", str(10 << 30),
                   "--out", str(tmp_path / "out.jsonl")])
    assert len(seen) == 2  # no unconstrained group
    for group, budget in zip(seen, (1.3, 1.5)):
        argv = group["torchmem#0"]
        assert argv[argv.index("--memory-budget") + 1] == str(int(budget * (10 << 30)))
        assert "--memory-fraction" not in argv
        reference = group["native (no budget)#0"]
        assert "--memory-budget" not in reference and "--memory-fraction" not in reference


@pytest.mark.parametrize("argv", [["--peak-request", "1000"], ["--budgets", "1.3", "--peak-request", "0"]])
def test_a_peak_request_without_budgets_or_bytes_is_refused(argv, capsys):
    with pytest.raises(SystemExit):
        lockstep.main(["--workload", "compile", "--allocators", "native", "--out", "unused.jsonl"] + argv)
    assert "--peak-request" in capsys.readouterr().err


def test_gpu_workloads_takes_a_budget_in_bytes_or_a_fraction_not_both():
    gpu_workloads = load_bench("gpu_workloads")
    args = gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x",
                                     "--memory-budget", str(8 << 30)])
    assert args.memory_budget == 8 << 30 and args.memory_fraction is None
    for bad in (["--memory-budget", "0"], ["--memory-budget", "100", "--memory-fraction", "0.5"]):
        with pytest.raises(SystemExit):
            gpu_workloads.parse_args(["--workload", "gpt2", "--allocator", "native", "--out", "x"] + bad)


# ---- an OOM the card made, not the budget (gpu_workloads' oom_room) ----

GB = 10**9


def ran_out(fraction, reserved, requested, device_free, total=100 * GB):
    room = {"device_free": device_free, "reserved": reserved, "requested": requested}
    return {"oom_at_step": 1, "memory_fraction": fraction, "device_total": total, "oom_room": room}


def test_card_was_full_tells_a_full_card_from_a_budget_and_from_the_allocator():
    # no budget: the card had no room for the request, or (the allocator's own failure) it had
    assert lockstep_tables.card_was_full(ran_out(None, 13 * GB, 2 * GB, 1 * GB))
    assert not lockstep_tables.card_was_full(ran_out(None, 13 * GB, 2 * GB, 30 * GB))
    # a budget of 25 GB: 12 GB left in it, 1 GB on the card -> the card; 1 GB left in it -> the budget
    assert lockstep_tables.card_was_full(ran_out(0.25, 13 * GB, 2 * GB, 1 * GB))
    assert not lockstep_tables.card_was_full(ran_out(0.25, 24 * GB, 2 * GB, 1 * GB))
    assert not lockstep_tables.card_was_full(ran_out(0.25, 24 * GB, 2 * GB, 50 * GB))
    # nothing to read: a row from before oom_room, a message with no size, a run that fit
    assert not lockstep_tables.card_was_full({"oom_at_step": 1, "memory_fraction": None, "device_total": 100 * GB})
    assert not lockstep_tables.card_was_full(ran_out(None, 13 * GB, 0, 1 * GB))
    assert not lockstep_tables.card_was_full(dict(ran_out(None, 13 * GB, 2 * GB, 1 * GB), oom_at_step=None))


def full_card(row):
    return dict(row, memory_fraction=0.25, device_total=100 * GB,
                oom_room={"device_free": GB, "reserved": 5 * GB, "requested": 2 * GB})


def test_per_sample_table_gives_no_ratio_when_a_larger_native_batch_met_a_full_card():
    rows = [full_card(budget_row("native", [0.1], [16], oom=0)),
            budget_row("native@0.75", [0.09, 0.09], [12, 12]),
            budget_row("torchmem", [0.1, 0.1], [16, 16])]
    cells = {row[3]: row for row in table_rows(lockstep_tables.per_sample_table(rows))}
    assert cells["native"][6] == "OOM (card full)"
    assert cells["torchmem"][6] == "6.250"
    assert cells["torchmem"][7] == "- (a larger native batch met a full card)"
    # the same native OOM under its budget: the ratio stands
    rows[0] = budget_row("native", [0.1], [16], oom=0)
    cells = {row[3]: row for row in table_rows(lockstep_tables.per_sample_table(rows))}
    assert cells["native"][6] == "OOM" and cells["torchmem"][7] == "0.833 (native@0.75)"


def test_process_and_steady_tables_say_which_ooms_were_the_cards():
    torchmem_full = full_card(budget_row("torchmem", [], [], oom=1))
    native_budget = budget_row("native", [], [], oom=2)
    rows = [dict(r, total_s=0.0) for r in (torchmem_full, native_budget, budget_row("torchmem", [0.1] * 4, [16] * 4))]
    process = {row[2]: row for row in table_rows(lockstep_tables.process_table(rows))}
    assert process["torchmem"][4] == "1 (1 card full)" and process["native"][4] == "1"
    steady = [row for row in table_rows(lockstep_tables.steady_table(rows)) if row[3].startswith("OOM")]
    assert sorted(row[3] for row in steady) == ["OOM", "OOM (card full)"]
    assert lockstep_tables.card_full_note(rows).startswith("1 process(es) ran out of device memory that their budget")
    assert lockstep_tables.card_full_note(rows[1:]) == ""


def test_gpu_workloads_reads_the_room_left_at_an_oom():
    gpu_workloads = load_bench("gpu_workloads")
    cuda = types.SimpleNamespace(mem_get_info=lambda: (GB, 80 * GB),
                                 memory_stats=lambda: {"reserved_bytes.all.current": 13 * GB})
    error = RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79 GiB")
    room = gpu_workloads.room_at_oom(types.SimpleNamespace(cuda=cuda), error)
    assert room == {"device_free": GB, "reserved": 13 * GB, "requested": 2 << 30}


def varying_row(allocator, calls, barriers=None, oom=None, seed=1):
    """A process with a new shape every step (--shapes 0): its calls at every step, warm-up included."""
    return dict(budget_row(allocator, [0.1] * len(calls), [16] * len(calls), seed=seed, oom=oom), shapes=0,
                calls_every_step=calls, barriers_every_step=barriers or [0] * len(calls))


def test_after_warmup_table_counts_the_second_half_of_every_step_against_expandable():
    rows = [varying_row("expandable", [40, 20, 10, 10, 4, 6]),
            varying_row("torchmem", [900, 300, 8, 0, 4, 3], barriers=[1, 0, 0, 0, 0, 1]),
            varying_row("native", [], oom=2)]
    cells = {row[3]: row for row in table_rows(lockstep_tables.after_warmup_table(rows))}
    assert cells["expandable"][4:] == ["6", "20", "0", "1.00"]
    assert cells["torchmem"][4:] == ["6", "7", "1", "0.35"]  # steps 3-5: 0 + 4 + 3, the warm-up's 1,208 left out
    assert cells["native"][5] == "OOM"
    quiet = [varying_row("expandable", [8, 0, 0, 0]), varying_row("torchmem", [50, 0, 0, 2])]
    assert [row[7] for row in table_rows(lockstep_tables.after_warmup_table(quiet))] == ["equal (0)", "over (theirs 0)"]


def test_expandable_calls_are_counted_by_page_not_by_mapped_range():
    gpu_workloads = load_bench("gpu_workloads")
    stats = {"reserved_bytes.large_pool.allocated": 3 * (20 << 20), "reserved_bytes.large_pool.freed": 20 << 20,
             "reserved_bytes.small_pool.allocated": 5 * (2 << 20), "reserved_bytes.small_pool.freed": 0,
             "num_device_alloc": 2}  # two mapped ranges, eight pages
    assert gpu_workloads.expandable_page_calls(stats) == 2 * (3 + 1 + 5)


def test_warmup_table_says_how_many_growths_the_calls_came_in(tmp_path):
    """num_growths (Note [Map groups]): where the run recorded it, the warm-up's driver calls are
    shown with the bursts they came in; older runs, without it, show the calls alone."""
    steps = [0.12, 0.08, 0.12, 0.10, 0.08, 0.12, 0.08]
    plan = [{"num_plan_passes": 0, "plan_pass_us": 0, "create_calls": 50, "map_calls": 50,
             "unmap_calls": 0, "release_calls": 0, "num_growths": 4}] + [{}] * 6
    row = dict(result("torchmem", 1, steps, "torchmem#0"), shapes=1, budget=1.05,
               driver_calls_per_step=[100] + [0] * 6, barriers_per_step=[0] * 7, plan_per_step=plan)
    assert "| 1 | 100 in 4 growths | 0 | 0 |" in "\n".join(tables(tmp_path, [row]))
    del plan[0]["num_growths"]
    (tmp_path / "old").mkdir()
    assert "| 1 | 100 | 0 | 0 |" in "\n".join(tables(tmp_path / "old", [dict(row, plan_per_step=plan)]))


def test_costs_cold_prices_each_growth_s_first_calls_at_the_evicted_run(tmp_path):
    """--costs-cold LIVE,MIB (lockstep_tables.cold_burst_us): where a run recorded its growths, the
    first create and map of each growth (and the first unmap and release of each growth or barrier)
    cost the probe's evicted prices, the rest its idle ones; runs without growths are priced as
    before, and the option needs the probe."""
    # quiet from step 1: 400 ms added
    row = warm_up_row([0.5, 0.1, 0.1, 0.1], create_calls=100, map_calls=10_000, num_growths=100)
    plan = row["plan_per_step"]
    idle = PROBE_RUN
    evicted = dict(idle, cuMemCreate_us_per_granule=510, map_and_set_access_us_per_call=510, evict_bytes=64 << 20)
    (tmp_path / "probe.json").write_text(json.dumps({"runs": [idle, evicted]}))
    probe = ["--costs", str(tmp_path / "probe.json")]
    # idle: 10,100 calls at 10 us = 101 ms; cold: + 100 creates and 100 maps at 500 us more = +100 ms
    for name, rows, extra, model in (("idle", [row], [], "| 101 | -75% |"),
                                     ("cold", [row], ["--costs-cold", "0,64"], "| 201 | -50% |")):
        (tmp_path / name).mkdir()
        assert model in "\n".join(tables(tmp_path / name, rows, *probe, *extra)), name
    del plan[0]["num_growths"]  # an older run: the growths unknown, no cold calls
    (tmp_path / "old").mkdir()
    assert "| 101 | -75% |" in "\n".join(tables(tmp_path / "old", [row], *probe, "--costs-cold", "0,64"))
    (tmp_path / "rows.jsonl").write_text(json.dumps(row) + "\n")
    alone = subprocess.run([sys.executable, SCRIPT, "table", str(tmp_path / "rows.jsonl"), "--costs-cold", "0,64"],
                           capture_output=True, text=True)
    assert alone.returncode == 2 and not alone.stdout and "--costs PROBE.json" in alone.stderr


def test_warmup_table_reads_twin_processes_on_their_mean(tmp_path):
    """Two processes of one group with the same calls get a row for their mean: the added times
    averaged, each one's own spread divided by sqrt(2), the model against that."""
    quiet = [0.08, 0.12, 0.10, 0.08, 0.12, 0.08]  # median 0.09
    rows = [dict(warm_up_row([0.60] + quiet, map_calls=40_000), lockstep={"group": "g", "process": "torchmem#0"}),
            dict(warm_up_row([0.40] + quiet, map_calls=40_000), lockstep={"group": "g", "process": "torchmem#1"})]
    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps({"runs": [PROBE_RUN]}))
    table = "\n".join(tables(tmp_path, rows, "--costs", str(probe)))
    # added 600 - 90 = 510 and 400 - 90 = 310 ms (each ±39 ms), their mean 410 ms within
    # ±sqrt(2 x 39^2) / 2 = ±28 ms; 40,000 maps at 10 us = 400 ms: -2%
    assert "| llama_ckpt | 1.05x | torchmem | mean of 2 | | | | | | 410 (net of drift) | | | 400 | -2%, within noise (±28 ms) |" in table, table
    # One process alone: no mean row.
    (tmp_path / "one").mkdir()
    assert "mean of" not in "\n".join(tables(tmp_path / "one", rows[:1], "--costs", str(probe)))
