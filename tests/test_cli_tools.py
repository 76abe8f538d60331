"""`python -m torchmem stats | plot | convert`: tables, a PNG that opens, a lossless round trip, clear errors."""

import gzip
import json
import pickle
import subprocess
import sys

import pytest

from torchmem.cli import main
from support import REPO

MiB = 1 << 20


def _write_trace(path):
    """A small trace in the shared format: two segments, allocations inside them, frees."""
    base, second = 1 << 40, (1 << 40) + (64 * MiB)
    events = [
        [3, base, 20 * MiB, 0],
        [0, base, 3 * MiB, 0],
        [0, base + 3 * MiB, 5 * MiB + 100, 0],
        [3, second, 2 * MiB, 0],
        [0, second, 1000, 0],
        [1, base, 3 * MiB, 0],
        [2, base, 3 * MiB, 0],
        [0, base + 9 * MiB, 4 * MiB, 0],
        [1, second, 1000, 0],
        [2, second, 1000, 0],
        [4, second, 2 * MiB, 0],
    ]
    with gzip.open(path, "wt") as f:
        json.dump({"workload": "tiny", "torch": "test", "device": 0, "actions": {}, "events": events}, f)
    return events


def test_help_everywhere(capsys):
    proc = subprocess.run([sys.executable, "-m", "torchmem", "--help"], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and all(name in proc.stdout for name in ("stats", "plot", "convert"))
    for command in ("stats", "plot", "convert"):
        with pytest.raises(SystemExit) as info:
            main([command, "--help"])
        assert info.value.code == 0 and "usage:" in capsys.readouterr().out


def test_convert_round_trip_and_stats(tmp_path, capsys):
    trace_path, snap_path, back_path = tmp_path / "t.json.gz", tmp_path / "s.pickle", tmp_path / "back.json.gz"
    events = _write_trace(trace_path)
    assert main(["convert", str(trace_path), str(snap_path)]) == 0
    with open(snap_path, "rb") as f:
        assert f.read(2) == b"\x80\x04"
    with open(snap_path, "rb") as f:
        snap = pickle.load(f)
    # end state: one segment of 20 MiB holding two live blocks, tiled with free gaps
    assert [s["total_size"] for s in snap["segments"]] == [20 * MiB]
    live = [b for b in snap["segments"][0]["blocks"] if b["state"] == "active_allocated"]
    assert [b["requested_size"] for b in live] == [5 * MiB + 100, 4 * MiB]
    assert main(["convert", str(snap_path), str(back_path)]) == 0
    with gzip.open(back_path, "rt") as f:
        assert json.load(f)["events"] == events

    capsys.readouterr()
    assert main(["stats", str(snap_path), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["all"]["reserved_bytes"] == 20 * MiB and figures["all"]["blocks_live"] == 2
    assert figures["trace_entries"] == len(events)
    assert main(["stats", str(trace_path)]) == 0
    out = capsys.readouterr().out
    assert "peak requested" in out and "11 events" in out
    assert main(["stats", str(trace_path), "--json"]) == 0
    figures = json.loads(capsys.readouterr().out)
    assert figures["peak_requested"] == 5 * MiB + 100 + 1000 + 4 * MiB
    assert figures["peak_reserved_recorded"] == 22 * MiB


def test_converted_snapshot_passes_torch_memory_viz(tmp_path):
    trace_path, snap_path = tmp_path / "t.json.gz", tmp_path / "s.pickle"
    _write_trace(trace_path)
    assert main(["convert", str(trace_path), str(snap_path)]) == 0
    proc = subprocess.run([sys.executable, "-m", "torch.cuda._memory_viz", "stats", str(snap_path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "total_reserved: 20.0MiB" in proc.stdout, proc.stderr


def test_plot_writes_a_png_that_opens(tmp_path, capsys):
    import matplotlib.image

    trace_path, png = tmp_path / "t.json.gz", tmp_path / "out.png"
    _write_trace(trace_path)
    assert main(["plot", str(trace_path), "-o", str(png), "--no-replay", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    image = matplotlib.image.imread(str(png))
    assert image.shape[0] > 300 and image.shape[1] > 600
    assert summary["peak_reserved_recorded"] == 22 * MiB
    assert summary["ratio_recorded"] == pytest.approx(22 * MiB / (9 * MiB + 1100))
    snap_path, png2 = tmp_path / "s.pickle", tmp_path / "snap.png"
    assert main(["convert", str(trace_path), str(snap_path)]) == 0
    assert main(["plot", str(snap_path), "-o", str(png2)]) == 0
    said = capsys.readouterr().out.splitlines()[-1]  # in words: the snapshot has history, so a timeline
    assert said.startswith(f"wrote {png2}: timeline of 11 events; peak requested 0.009 GiB; recorded allocator")
    assert matplotlib.image.imread(str(png2)).ndim == 3


def test_plot_draws_the_layout_that_replay_snapshot_writes(tmp_path, capsys):
    import matplotlib.image

    from torchmem.analysis import trace as trace_io

    snap, png = tmp_path / "peak.pickle", tmp_path / "layout.png"
    assert main(["replay", "vision", "--policy", "native", "--json", "--snapshot", str(snap)]) == 0
    record = json.loads(capsys.readouterr().out.splitlines()[0])
    assert main(["plot", str(snap), "-o", str(png), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    snapshot = trace_io.read_snapshot(str(snap))
    assert summary["segments"] == len(snapshot["segments"]) and summary["reserved"] == record["peak_reserved"]
    assert summary["active_allocated_bytes"] + summary["inactive_bytes"] == summary["reserved"]
    assert matplotlib.image.imread(str(png)).ndim == 3


@pytest.mark.parametrize("argv, words", [
    (["stats", "/no/such/file.pickle"], ["FILE", "/no/such/file.pickle"]),
    (["stats"], ["no FILE given", "no torchmem allocator", "snapshot", "torchmem top"]),
    (["plot", "/no/such.json.gz", "-o", "x.png"], ["FILE"]),
    (["plot", "{trace}", "-o", "out.jpg"], ["--output", ".png"]),
    (["plot", "{trace}", "-o", "/no/dir/out.png"], ["--output", "does not exist"]),
    (["convert", "/no/such.pickle", "o.json.gz"], ["IN"]),
    (["convert", "{trace}", "out.json.gz"], ["OUT", ".pickle"]),
    (["convert", "{junk}", "out.pickle"], ["junk.json", "not valid JSON"]),
])
def test_errors_name_the_bad_argument(tmp_path, capsys, argv, words):
    trace_path, junk = tmp_path / "t.json.gz", tmp_path / "junk.json"
    _write_trace(trace_path)
    junk.write_text("{not json")
    argv = [a.format(trace=trace_path, junk=junk) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    for word in words:
        assert word in err
