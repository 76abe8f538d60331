"""Reading and writing traces (torchmem/analysis/trace.py): the trace format, snapshot
pickles with their prologue, and clear errors for files that are not traces."""

import gzip
import json
import pickle

import numpy as np
import pytest

from torchmem.analysis import trace as trace_io
from torchmem.analysis.trace import ALLOC, FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, TraceError

MiB = 1 << 20


def small_events():
    return [
        [SEGMENT_ALLOC, 0x1000000, 20 * MiB, 0],
        [ALLOC, 0x1000000, 3 * MiB, 0],
        [ALLOC, 0x1300000, 5 * MiB, 0],
        [FREE_REQUESTED, 0x1000000, 3 * MiB, 0],
        [FREE_COMPLETED, 0x1000000, 3 * MiB, 0],
        [ALLOC, 0x1000000, 1 * MiB, 7],
    ]


def test_bundled_traces_load_with_their_readme_figures():
    paths = trace_io.bundled_traces()
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["trace_fsdp_accum.json.gz", "trace_fsdp_train.json.gz",
                                                     "trace_gpt2_train.json.gz",
                                                     "trace_kv_generate.json.gz", "trace_llama_ckpt_train.json.gz",
                                                     "trace_vision.json.gz"]
    gpt2 = trace_io.load(paths[2])
    assert gpt2.workload == "gpt2_train" and gpt2.device_name == "NVIDIA H200"
    assert len(gpt2) == 214_231 and gpt2.events.dtype == np.int64 and gpt2.events.shape[1] == 4
    assert gpt2.counts()["alloc"] == 71_337
    assert gpt2.recorded_peak_reserved() == 39_492 * MiB  # the README's native peak
    assert trace_io.bundled_trace("llama_ckpt") == paths[4]
    # the four recorded by torchmem's benchmarks (README rows)
    for name, events, peak_mib in (("kv_generate", 156_257, 3_880), ("vision", 25_885, 6_728),
                                   ("fsdp_train", 63_607, 27_320), ("fsdp_accum", 190_803, 3_112)):
        trace = trace_io.load(trace_io.bundled_trace(name))
        assert trace.workload == name and len(trace) == events
        assert trace.recorded_peak_reserved() == peak_mib * MiB
    with pytest.raises(ValueError, match="no bundled trace named 'bert'"):
        trace_io.bundled_trace("bert")


def test_figures_of_a_small_trace():
    t = trace_io.Trace(events=small_events(), workload="tiny")
    assert t.peak_requested() == 8 * MiB
    assert t.recorded_peak_reserved() == 20 * MiB
    assert t.counts()["free_completed"] == 1
    assert trace_io.Trace(events=[[ALLOC, 1, 512, 0]]).recorded_peak_reserved() is None


@pytest.mark.parametrize("name", ["t.json.gz", "t.json"])
def test_save_load_round_trip(tmp_path, name):
    original = trace_io.Trace(events=small_events(), workload="tiny", torch_version="2.11", device_name="H200")
    path = trace_io.save(original, tmp_path / name)
    with open(path, "rb") as f:
        assert (f.read(2) == b"\x1f\x8b") == name.endswith(".gz")
    loaded = trace_io.load(path)
    assert np.array_equal(loaded.events, original.events)
    assert (loaded.workload, loaded.torch_version, loaded.device_name) == ("tiny", "2.11", "H200")
    assert loaded.path == str(path)


def snapshot_dict():
    """A torch-style snapshot: one block allocated before recording and freed in it,
    one live block the trace never mentions, and ignored annotation entries."""
    trace = [
        {"action": "snapshot", "addr": 0, "size": 0, "stream": 0},
        {"action": "free_requested", "addr": 0x2000, "size": 4096, "stream": 0, "frames": []},
        {"action": "free_completed", "addr": 0x2000, "size": 4096, "stream": 0},
        {"action": "segment_alloc", "addr": 0x900000, "size": 2 * MiB, "stream": 0},
        {"action": "alloc", "addr": 0x900000, "size": 1000, "stream": 0, "frames": [{"filename": "x.py"}]},
        {"action": "user_defined", "addr": 0, "size": 0, "stream": 0},
    ]
    segments = [
        {"device": 0, "address": 0x0, "total_size": 2 * MiB, "stream": 0, "blocks": [
            {"address": 0x0, "size": 8192, "requested_size": 8000, "state": "active_allocated"},
            {"address": 0x2000, "size": 2 * MiB - 8192, "requested_size": 0, "state": "inactive"},
        ]},
        {"device": 0, "address": 0x900000, "total_size": 2 * MiB, "stream": 0, "blocks": [
            {"address": 0x900000, "size": 1024, "requested_size": 1000, "state": "active_allocated"},
        ]},
    ]
    return {"segments": segments, "device_traces": [trace, []], "allocator_settings": {}}


def test_snapshot_pickle_with_prologue(tmp_path):
    path = tmp_path / "snap.pickle"
    with open(path, "wb") as f:
        pickle.dump(snapshot_dict(), f, protocol=4)
    t = trace_io.load(path)
    assert t.device == 0 and t.prologue == 2
    # Prologue first: the block freed in the trace, then the untouched live one.
    assert t.events[:2].tolist() == [[ALLOC, 0x2000, 4096, 0], [ALLOC, 0x0, 8000, 0]]
    assert [int(a) for a in t.events[2:, 0]] == [FREE_REQUESTED, FREE_COMPLETED, SEGMENT_ALLOC, ALLOC]
    # Reserved before recording: 4 MiB at the end minus the 2 MiB segment made during it.
    assert t.initial_reserved == 2 * MiB
    assert t.recorded_peak_reserved() == 4 * MiB
    assert t.peak_requested() == 4096 + 8000  # the 4096 B block is freed before the 1000 B alloc
    with pytest.raises(TraceError, match="device 1 has no recorded events"):
        trace_io.load(path, device=1)


def test_snapshot_pickle_refuses_code(tmp_path):
    path = tmp_path / "evil.pickle"
    with open(path, "wb") as f:
        pickle.dump({"device_traces": [[]], "x": np.int64(3)}, f, protocol=4)  # needs numpy's classes
    with pytest.raises(TraceError, match="cannot be read as a memory snapshot.*refusing to load"):
        trace_io.load(path)


def test_snapshot_without_history_says_how_to_record(tmp_path):
    path = tmp_path / "nohist.pickle"
    with open(path, "wb") as f:
        pickle.dump({"segments": []}, f, protocol=4)
    with pytest.raises(TraceError, match="_record_memory_history"):
        trace_io.load(path)


def test_unreadable_files_give_clear_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="trace file not found: .*missing.json.gz"):
        trace_io.load(tmp_path / "missing.json.gz")
    with pytest.raises(TraceError, match="is a directory"):
        trace_io.load(tmp_path)
    empty = tmp_path / "empty.json"
    empty.write_bytes(b"")
    with pytest.raises(TraceError, match="the file is empty"):
        trace_io.load(empty)
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x00\x01binary")
    with pytest.raises(TraceError, match="not a trace"):
        trace_io.load(garbage)
    truncated = tmp_path / "cut.json.gz"
    truncated.write_bytes(gzip.compress(b'{"events": []}')[:12])
    with pytest.raises(TraceError, match="does not decompress"):
        trace_io.load(truncated)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"events": [1, 2')
    with pytest.raises(TraceError, match="not valid JSON"):
        trace_io.load(bad_json)
    no_events = tmp_path / "noevents.json"
    no_events.write_text(json.dumps({"workload": "x"}))
    with pytest.raises(TraceError, match="'events' list"):
        trace_io.load(no_events)
    bad_rows = tmp_path / "rows.json"
    bad_rows.write_text(json.dumps({"events": [[0, 1, 2]]}))
    with pytest.raises(TraceError, match=r"\[action, addr, size, stream\]"):
        trace_io.load(bad_rows)
    bad_action = tmp_path / "action.json"
    bad_action.write_text(json.dumps({"events": [[0, 1, 2, 0], [42, 1, 2, 0]]}))
    with pytest.raises(TraceError, match="event 1 has unknown action code 42"):
        trace_io.load(bad_action)
