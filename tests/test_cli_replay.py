"""`python -m torchmem replay` and `python -m torchmem demo` (CPU replay path):
output, JSON fields, --snapshot, and errors."""

import json
import pickle
import re
import subprocess
import sys

import pytest

from torchmem.analysis import trace as trace_io
from torchmem.cli import main
from sim_pool import STITCHING_CONF
from support import REPO

JSON_FIELDS = {"trace", "policy", "events", "peak_requested", "peak_reserved", "ratio", "ooms",
               "backend_calls", "modeled_backend_us"}


@pytest.fixture(scope="module")
def short_trace(tmp_path_factory):
    """The first 30,000 events of the gpt2 trace, as a trace file."""
    full = trace_io.load(trace_io.bundled_trace("gpt2"))
    part = trace_io.Trace(events=full.events[:30000], workload="gpt2_head", torch_version=full.torch_version)
    return str(trace_io.save(part, tmp_path_factory.mktemp("traces") / "gpt2_head.json.gz"))


def test_table_side_by_side(short_trace, capsys):
    assert main(["replay", short_trace]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0] == f"{short_trace}: 30,000 events"
    assert lines[1].split() == ["torchmem", "native", "expandable", "recorded"]
    labels = [line[:22].strip() for line in lines[2:]]
    for label in ("peak requested", "peak reserved", "ratio", "OOMs", "driver time in all"):
        assert label in labels
    ratio_row = next(line for line in lines if line.startswith("ratio"))
    ours, native, expandable, recorded = (float(x) for x in ratio_row.split()[1:])
    assert native == pytest.approx(recorded, rel=0.01) and ours <= expandable <= native


def test_json_lines_with_min_cap(short_trace, capsys):
    assert main(["replay", short_trace, short_trace, "--json", "--min-cap", "--policy", "all"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(r["trace"], r["policy"]) for r in records] == [(short_trace, "torchmem"), (short_trace, "native"),
                                                             (short_trace, "expandable")] * 2
    for r in records:
        assert JSON_FIELDS | {"min_cap", "min_cap_ratio"} <= set(r)
        assert r["events"] == 30000 and r["ooms"] == 0
        assert r["ratio"] == pytest.approx(r["peak_reserved"] / r["peak_requested"])
        assert r["min_cap_ratio"] == pytest.approx(r["min_cap"] / r["peak_requested"])
        assert isinstance(r["backend_calls"], dict) and "map_calls" in r["backend_calls"]


def test_json_without_min_cap_has_no_min_cap_fields(short_trace, capsys):
    assert main(["replay", short_trace, "--json", "--policy", "native"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["policy"] == "native" and "min_cap" not in record and "min_device" not in record


def test_min_device_in_the_table_and_the_json(short_trace, capsys):
    assert main(["replay", short_trace, "--min-device"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert any(line.startswith("min device (no limit)") for line in lines)
    ratio_row = next(line for line in lines if line.startswith("min device ratio"))
    ours, native = (float(x) for x in ratio_row.split()[3:5])
    assert 1.0 <= ours <= native
    assert main(["replay", short_trace, "--json", "--min-device", "--policy", "torchmem"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["min_device_ratio"] == pytest.approx(record["min_device"] / record["peak_requested"])
    assert "min_cap" not in record


def test_limit_and_config_options(short_trace, capsys):
    assert main(["replay", short_trace, "--json", "--policy", "torchmem", "--limit", "64MiB",
                 "--config", "reclaim_slack=0.01"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["limit"] == 64 << 20
    assert record["ooms"] > 0 and record["peak_reserved"] <= 64 << 20


def test_event_delay_models_a_lagging_gpu(capsys):
    # With events that stay pending (a GPU behind the host), stitching must not
    # wait for fences: alias reclaim keeps the ratio; without it memory grows.
    gpt2 = trace_io.bundled_trace("gpt2")
    ratios = {}
    for alias in ("1", "0"):
        assert main(["replay", gpt2, "--json", "--policy", "torchmem", "--event-delay", "10",
                     "--config", f"alias_reclaim={alias},stitch_above=0"]) == 0
        (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        ratios[alias] = record["ratio"]
    assert ratios["1"] <= 1.02 < 1.05 < ratios["0"], ratios
    assert main(["replay", gpt2, "--event-delay", "-1"]) == 2
    assert "--event-delay must be >= 0" in capsys.readouterr().err


def test_snapshot_at_peak_is_a_torch_memory_snapshot(short_trace, tmp_path, capsys):
    out = tmp_path / "peak.pickle"
    assert main(["replay", short_trace, "--policy", "torchmem", "--json", "--snapshot", str(out)]) == 0
    captured = capsys.readouterr()
    record = json.loads(captured.out.splitlines()[0])
    assert f"at event {record['peak_reserved_event']:,}" in captured.err
    with open(out, "rb") as f:
        assert f.read(2) == b"\x80\x04"  # pickle protocol 4
    with open(out, "rb") as f:
        snapshot = pickle.load(f)
    assert {"segments", "device_traces", "allocator_settings"} <= set(snapshot)
    assert snapshot["allocator_settings"]["replayed_event"] == record["peak_reserved_event"]
    mapped = sum(s["total_size"] for s in snapshot["segments"])
    assert 0 < mapped <= record["peak_reserved"]
    from torch.cuda import _memory_viz

    summary = _memory_viz.segsum(snapshot)  # PyTorch's own viewer reads it
    assert f"segments: {len(snapshot['segments'])}" in summary and "total_reserved" in summary


def test_snapshot_of_the_native_model(short_trace, tmp_path, capsys):
    out = tmp_path / "native.pickle"
    assert main(["replay", short_trace, "--policy", "native", "--json", "--snapshot", str(out)]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    with open(out, "rb") as f:
        snapshot = pickle.load(f)
    assert snapshot["allocator_settings"]["replayed_policy"] == "native"
    assert not any(s["is_expandable"] for s in snapshot["segments"])
    # At its peak event the native model holds exactly its peak in segments.
    assert sum(s["total_size"] for s in snapshot["segments"]) == record["peak_reserved"]
    from torch.cuda import _memory_viz

    assert f"segments: {len(snapshot['segments'])}" in _memory_viz.segsum(snapshot)


def test_replays_a_torch_snapshot_pickle(tmp_path, capsys):
    from test_trace import snapshot_dict

    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot_dict(), f, protocol=4)
    assert main(["replay", str(path), "--json"]) == 0
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    for r in records:
        assert (r["allocs"], r["frees"], r["unmatched_frees"], r["ooms"]) == (3, 1, 0, 0)
        assert r["peak_requested"] == 4096 + 8000
        assert r["recorded_peak_reserved"] == 4 << 20


def test_errors_name_the_problem(tmp_path, capsys):
    assert main(["replay", str(tmp_path / "nope.json.gz")]) == 2
    assert "nope.json.gz: no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert main(["replay", str(bad)]) == 2
    assert "'events' list" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["replay", str(bad), "--policy", "tlsf"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'tlsf'" in capsys.readouterr().err
    assert main(["replay", str(bad), "--limit", "lots"]) == 2
    assert "--limit" in capsys.readouterr().err
    assert main(["replay", str(bad), str(bad), "--snapshot", str(tmp_path / "x.pickle")]) == 2
    assert "give one TRACE" in capsys.readouterr().err


def test_module_entry_point_json(short_trace):
    proc = subprocess.run([sys.executable, "-m", "torchmem", "replay", short_trace, "--json"], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in proc.stdout.splitlines()]
    assert [r["policy"] for r in records] == ["torchmem", "native", "expandable"]


def test_demo_replays_gpt2_side_by_side(capsys):
    assert main(["demo", "--replay"]) == 0
    out = capsys.readouterr().out
    words = " ".join(out.split())
    assert "gpt2_train: GPT-2 124M training" in words and "214,231 allocator events" in words
    assert "1. With room to spare" in out and "2. Under a budget" in out
    assert "What the rows mean:" in out and "In short:" in out
    # the models against what the H200 measured: equal at the table's rounding, so no second figure
    assert "The models' peak reserved equal what the H200 measured" in out
    assert "at its min-cap. (replays took" in words  # the summary's last sentence, however it wraps


def test_limit_fraction_is_a_share_of_the_simulated_device(short_trace, capsys):
    assert main(["replay", short_trace, "--json", "--policy", "torchmem", "--limit", "0.5",
                 "--capacity", "64GiB"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["limit"] == 32 << 30
    assert main(["replay", short_trace, "--limit", "1.5"]) == 2
    assert "--limit 1.5: a bare number above 1 is bytes and must be whole" in capsys.readouterr().err


def test_torchmem_conf_applies_and_config_wins(short_trace, capsys, monkeypatch):
    monkeypatch.setenv("TORCHMEM_CONF", "limit=64MiB,reclaim_slack=0.5")
    assert main(["replay", short_trace, "--json", "--policy", "torchmem"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["limit"] == 64 << 20
    assert main(["replay", short_trace, "--json", "--policy", "torchmem", "--config", "limit=128MiB"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["limit"] == 128 << 20


def test_a_budget_that_causes_ooms_says_so_and_gives_no_ratio(short_trace, capsys):
    assert main(["replay", short_trace, "--limit", "64MiB"]) == 0
    out = capsys.readouterr().out
    ratio_row = next(line for line in out.splitlines() if line.startswith("ratio"))
    ours, native, expandable, recorded = ratio_row.split()[1:]
    assert ours == native == expandable == "OOM"
    # the recorded allocator's ratio divides by the trace's own peak, not the OOMing replay's
    trace = trace_io.load(short_trace)
    assert float(recorded) == pytest.approx(trace.recorded_peak_reserved() / trace.peak_requested(), abs=1e-3)
    for policy in ("torchmem", "native"):
        assert f"{policy}: OUT OF MEMORY:" in out
    assert "the trace does not fit" in out


def _write_trace(path, events):
    trace_io.save(trace_io.Trace(events=events, workload="broken"), path)
    return str(path)


@pytest.mark.parametrize("events, words", [
    ([[0, 4096, 1000, 0], [1, 8192, 0, 0], [1, 4096, 1000, 0]], ["event 1", "free of 0x2000", "not live"]),
    ([[0, 4096, 1000, 0], [1, 4096, 1000, 0], [1, 4096, 1000, 0]], ["event 2", "freed twice"]),
    ([[0, 4096, -5, 0]], ["event 0", "negative size -5"]),
    ([[0, 4096, 1000, 0], [0, 4096, 1000, 0]], ["event 1", "still live"]),
])
def test_broken_traces_are_refused_naming_the_entry(tmp_path, capsys, events, words):
    path = _write_trace(tmp_path / "broken.json", events)
    assert main(["replay", path]) == 2
    err = capsys.readouterr().err
    for word in words + ["--lenient"]:
        assert word in err


def test_lenient_skips_broken_entries_and_says_what(tmp_path, capsys):
    path = _write_trace(tmp_path / "broken.json", [[0, 4096, 1000, 0], [1, 8192, 0, 0], [0, 16384, -5, 0],
                                                   [1, 4096, 1000, 0]])
    assert main(["replay", path, "--lenient", "--json", "--policy", "torchmem"]) == 0
    captured = capsys.readouterr()
    (record,) = [json.loads(line) for line in captured.out.splitlines()]
    assert (record["events"], record["allocs"], record["frees"], record["unmatched_frees"]) == (2, 1, 1, 0)
    assert "skipped 2 entries" in captured.err and "unknown free: 1" in captured.err and "negative: 1" in captured.err


def test_bundled_traces_by_name_and_list(capsys):
    assert main(["replay", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in lines] == [trace_io.bundled_trace_names(p)[0] for p in trace_io.bundled_traces()]
    assert all(line.split()[-1] in trace_io.bundled_traces() for line in lines)
    assert main(["replay", "vision", "--json", "--policy", "native"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["trace"] == trace_io.bundled_trace("vision")
    assert main(["replay", "no_such_trace"]) == 2
    err = capsys.readouterr().err
    assert "neither a file nor a bundled trace" in err and "gpt2_train" in err
    assert main(["replay"]) == 2
    assert "--list" in capsys.readouterr().err


def test_a_device_wait_costs_a_third_of_the_step_in_the_time_model():
    """Note [Barrier cost]: the replay's step figures charge each wait for the whole device the
    pipeline it drains, a third of the workload's step (at most the step's lag where measured), on
    top of the simulated driver calls."""
    from torchmem.cli.anchors import BARRIER_DRAIN_STEPS, step_cost_us

    assert BARRIER_DRAIN_STEPS == pytest.approx(1 / 3)
    assert step_cost_us(5_000.0, 0, step_ms=90.0) == 5_000.0
    assert step_cost_us(5_000.0, 2, step_ms=90.0) == pytest.approx(5_000.0 + 2 * 30_000.0)
    # a measured lag bounds each wait's drain: a host-bound step's GPU has little queued
    assert step_cost_us(5_000.0, 2, step_ms=90.0, lag_ms=1.5) == pytest.approx(5_000.0 + 2 * 1_500.0)
    assert step_cost_us(5_000.0, 2, step_ms=90.0, lag_ms=80.0) == pytest.approx(5_000.0 + 2 * 30_000.0)


def test_planning_passes_are_shown_beside_the_driver_time(tmp_path, capsys):
    """Note [Planning pass cost]: a repeating step under a tight budget is planned, and the table
    says how many passes ran and what host time they took, apart from the driver time."""
    import numpy as np

    from torchmem.analysis import patterns

    events = np.asarray(patterns.training_steps(10, seed=0), dtype=np.int64)
    path = trace_io.save(trace_io.Trace(events=events, workload="steps"), tmp_path / "steps.json.gz")
    # a pool that stitches near its limit (Note [When to stitch]) plans the step
    assert main(["replay", str(path), "--limit", "1.02x", "--policy", "torchmem", "--event-delay", "10",
                 "--config", STITCHING_CONF]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("planning passes (host)"))
    found = re.fullmatch(r"planning passes \(host\)\s+(\d+) \(([\d,]+) ms\)", row.strip())
    assert found, row
    assert int(found[1]) >= 1


def test_under_a_limit_the_calls_after_the_peak_request_are_shown(short_trace, capsys):
    """The second half of a trace whose peak comes late still holds growth; under a budget the
    table also counts from the event where the live requested bytes peak, as the JSON does."""
    assert main(["replay", short_trace, "--limit", "1.05x", "--event-delay", "10"]) == 0
    row = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("after the peak request"))
    assert len(re.findall(r"[\d,]+ calls, \d+ waits", row)) == 3  # one per policy
    assert main(["replay", short_trace, "--limit", "1.05x", "--json", "--policy", "expandable"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["after_peak_driver_calls"] >= 0 and record["after_peak_barriers"] >= 0
    # with no limit there is no such row, and the JSON leaves it empty
    assert main(["replay", short_trace, "--json", "--policy", "torchmem"]) == 0
    (record,) = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert record["after_peak_driver_calls"] is None


def _probe(scale):
    """bench/gpu_probe.py's JSON for a GPU whose calls cost `scale` x the simulator's prices."""
    from torchmem._loader import _C

    sim = _C.sim_costs()
    run = {"granules_per_map": 1, "cuMemAddressReserve_us": sim["reserve_us"] * scale,
           "cuMemCreate_us_per_granule": sim["create_us"] * scale,
           "map_and_set_access_us_per_call": (sim["map_us"] + sim["set_access_us"]) * scale,
           "map_and_set_access_again_us_per_call": 1.0, "cuMemUnmap_us_per_call": sim["unmap_us"] * scale,
           "cuMemRelease_us_per_granule": sim["release_us"] * scale, "event_record_us": sim["event_record_us"] * scale,
           "event_query_us": sim["event_query_us"] * scale, "stream_wait_us": sim["stream_wait_us"] * scale,
           "cudaMalloc_20MiB_us": sim["segment_alloc_us"] * scale, "cudaFree_20MiB_us": sim["segment_free_us"] * scale}
    return {"gpu": "test", "runs": [dict(run, granules_per_map=16), run]}


def test_costs_price_the_same_calls_at_a_probed_gpus_figures(short_trace, tmp_path, capsys):
    # The time model prices calls at the simulator's H200 figures unless a GPU's own probe is given:
    # the same calls, every price doubled, double the modeled driver time
    from torchmem.analysis.call_costs import costs_from_probe

    probe = tmp_path / "probe.json"
    probe.write_text(json.dumps(_probe(2.0)))
    costs = costs_from_probe(str(probe))
    assert costs["create_us"] == pytest.approx(2 * costs_from_probe(_probe(1.0))["create_us"])
    assert costs["map_us"] == 0.0  # the probe times map and access together: set_access_us holds both
    records = {}
    for args in ([], ["--costs", str(probe)]):
        assert main(["replay", short_trace, "--json", "--policy", "torchmem", "--limit", "1.06x"] + args) == 0
        records[bool(args)] = json.loads(capsys.readouterr().out)
    assert records[True]["backend_calls"] == records[False]["backend_calls"]
    assert records[False]["modeled_backend_us"] > 0
    assert records[True]["modeled_backend_us"] == pytest.approx(2 * records[False]["modeled_backend_us"], rel=1e-6)


def test_costs_read_the_plain_run_unless_asked_for_a_probe_condition():
    """A probe with runs in a training process's conditions (--live-granules, --evict-mib: Note
    [Probe conditions]) still gives the plain run by default; asked for, the run of those
    conditions, and a condition it did not time is refused, naming the options that time it."""
    from torchmem.analysis.call_costs import costs_from_probe

    plain, loaded = _probe(1.0), _probe(3.0)["runs"][1]
    loaded.update(live_granules=5000, evict_bytes=64 << 20)
    older = dict(plain["runs"][1])  # an older probe's run: neither key, so both count as 0
    probe = {"runs": [plain["runs"][0], dict(loaded), dict(older, live_granules=0, evict_bytes=0)]}
    assert costs_from_probe(probe)["create_us"] == pytest.approx(costs_from_probe(_probe(1.0))["create_us"])
    chosen = costs_from_probe(probe, live_granules=5000, evict_bytes=64 << 20)
    assert chosen["create_us"] == pytest.approx(3 * costs_from_probe(probe)["create_us"])
    with pytest.raises(ValueError, match=r"with 5000 live granules and 0 bytes walked.*--live-granules"):
        costs_from_probe(probe, live_granules=5000)


def test_costs_cold_price_each_bursts_first_calls_at_the_evicted_run(short_trace, tmp_path, capsys):
    """--costs-cold LIVE,MIB (Note [Call bursts]): the same calls, and on top of --costs' prices,
    for the first call of each kind in each growth, what the probe's evicted run charges over them;
    asked for without a probe, or in another form, it is refused naming the fix."""
    from torchmem.analysis.call_costs import CALL_PRICES, costs_from_probe

    probe = _probe(1.0)
    evicted = dict(_probe(3.0)["runs"][1], live_granules=5000, evict_bytes=64 << 20)
    probe["runs"].append(evicted)
    path = tmp_path / "probe.json"
    path.write_text(json.dumps(probe))
    records = {}
    for cold in (False, True):
        args = ["--costs", str(path)] + (["--costs-cold", "5000,64"] if cold else [])
        assert main(["replay", short_trace, "--json", "--policy", "torchmem", "--limit", "1.06x"] + args) == 0
        records[cold] = json.loads(capsys.readouterr().out)
    warm, cold = records[False], records[True]
    assert cold["backend_calls"] == warm["backend_calls"] and cold["growths"] == warm["growths"] > 0
    # each kind: min(its calls, its bursts) calls at 3x instead of 1x the price
    prices = costs_from_probe(probe)
    bursts = {"create": warm["growths"], "map": warm["growths"], "unmap": warm["growths"] + warm["device_barriers"],
              "release": warm["growths"] + warm["device_barriers"]}
    premium = sum(min(warm["backend_calls"][f"{kind}_calls"], bursts[kind]) * 2 * sum(prices[k] for k in keys)
                  for kind, keys in CALL_PRICES.items())
    assert premium > 0
    assert cold["modeled_backend_us"] == pytest.approx(warm["modeled_backend_us"] + premium, rel=1e-6)
    assert cold["steady_backend_us"] >= warm["steady_backend_us"]
    assert main(["replay", short_trace, "--costs-cold", "5000,64"]) == 2
    assert "--costs PROBE.json" in capsys.readouterr().err
    assert main(["replay", short_trace, "--costs", str(path), "--costs-cold", "5000"]) == 2
    assert "--costs-cold '5000': give LIVE,MIB" in capsys.readouterr().err


def test_costs_that_are_not_a_probe_are_refused_naming_the_fix(short_trace, tmp_path, capsys):
    assert main(["replay", short_trace, "--costs", str(tmp_path / "none.json")]) == 2
    assert "--costs" in capsys.readouterr().err
    partial = tmp_path / "partial.json"
    partial.write_text(json.dumps({"runs": [{"granules_per_map": 16}]}))
    assert main(["replay", short_trace, "--costs", str(partial)]) == 2
    err = capsys.readouterr().err
    assert "one granule per call" in err and "gpu_probe.py" in err
    lacking = tmp_path / "lacking.json"
    lacking.write_text(json.dumps({"runs": [{"granules_per_map": 1, "cuMemCreate_us_per_granule": 9.0}]}))
    assert main(["replay", short_trace, "--costs", str(lacking)]) == 2
    assert "lacks cuMemAddressReserve_us" in capsys.readouterr().err


def test_repeat_last_step_shows_a_fixed_step_once_warm(capsys):
    """--repeat-last-step N: a recording of a few fixed-shape steps (FSDP2, 4 steps) run N
    steps longer, so its second half ("after warm-up") is a long run's steady state: under
    a budget torchmem makes no driver call and takes no barrier there. The recorded
    allocator never ran the added steps: its column is left out."""
    assert main(["replay", "fsdp_train", "--limit", "1.06x", "--event-delay", "10", "--policy", "torchmem",
                 "--repeat-last-step", "8"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("  ")[0].strip(): line.split()[-1] for line in out.splitlines()[2:] if "  " in line}
    assert rows["driver calls after warm-up"] == "0" and rows["device waits after warm-up"] == "0", out
    assert rows["OOMs"] == "0" and "recorded" not in out.splitlines()[1]
    from torchmem.analysis import patterns

    recorded = trace_io.load(trace_io.bundled_trace("fsdp_train")).events
    rows, period = patterns.repeat_last_step(recorded, 8)
    assert f": {len(rows):,} events" in out.splitlines()[0] and len(rows) > 8 * period


@pytest.mark.parametrize("argv, words", [
    (["gpt2", "--repeat-last-step", "2"], "does not repeat the one before it"),  # shapes that change
    (["fsdp_train", "--repeat-last-step", "-1"], "must be >= 0"),
])
def test_repeat_last_step_refusals_name_the_problem(argv, words, capsys):
    assert main(["replay"] + argv) == 2
    err = capsys.readouterr().err
    assert words in err and "replay wall time" not in err
