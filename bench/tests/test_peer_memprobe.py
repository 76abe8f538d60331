"""bench/peer_memprobe.py: the pytest plugin that logs the device's memory around peer tests,
driven here with a stand-in for torch.cuda (CPU): what a watched test reads is logged with the
allocator's state at each reading, and the plugin leaves torch as it found it."""

import json
import sys
import types

import pytest

from bench_support import load_bench


class FakeCuda:
    """torch.cuda's reads the plugin uses; `used` moves as a test allocates."""

    def __init__(self):
        self.used, self.reserved = 1000, 0

    def device_memory_used(self):
        return self.used

    def memory_reserved(self):
        return self.reserved

    def memory_allocated(self):
        return self.reserved

    def memory_stats(self):
        return {"torchmem.num_allocs": 7, "allocated_bytes.all.current": self.reserved}

    def memory_snapshot(self):
        return [{"segment_pool_id": (0, 0), "total_size": self.reserved, "allocated_size": self.reserved}]

    def synchronize(self):
        pass

    def empty_cache(self):
        pass


@pytest.fixture
def probe(tmp_path, monkeypatch):
    fake = types.SimpleNamespace(cuda=FakeCuda())
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setenv("MEMPROBE_OUT", str(tmp_path / "probe.jsonl"))
    monkeypatch.setenv("MEMPROBE_MODE", "watch")
    monkeypatch.setenv("MEMPROBE_TESTS", "test_device_memory_used")
    return load_bench("peer_memprobe"), fake, tmp_path / "probe.jsonl"


def run_hook(plugin, nodeid, body):
    """Drives the plugin's pytest_runtest_call around `body`, as pytest does."""
    wrapper = plugin.pytest_runtest_call(types.SimpleNamespace(nodeid=nodeid))
    next(wrapper)
    body()
    with pytest.raises(StopIteration):
        next(wrapper)


def test_a_watched_test_is_logged_with_the_state_at_each_reading(probe):
    plugin, torch, out = probe
    real = torch.cuda.device_memory_used

    def body():  # test_device_memory_used's shape: read, allocate 512, read
        torch.cuda.device_memory_used()
        torch.cuda.used, torch.cuda.reserved = 1512, 512
        torch.cuda.device_memory_used()

    run_hook(plugin, "test_cuda.py::TestCudaMallocAsync::test_device_memory_used", body)
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["device_used"] for r in row["readings"]] == [1000, 1512]
    assert [r["reserved"] for r in row["readings"]] == [0, 512]
    assert row["readings"][1]["segments"] == [{"pool": "(0, 0)", "size": 512, "allocated": 512}]
    assert row["start"]["device_used"] == 1000 and row["end"]["device_used"] == 1512
    assert row["readings"][0]["counters"] == {"torchmem.num_allocs": 7}
    assert torch.cuda.device_memory_used == real  # put back


def test_other_tests_are_not_logged(probe):
    plugin, torch, out = probe
    run_hook(plugin, "test_cuda.py::TestCuda::test_to_non_blocking", lambda: torch.cuda.device_memory_used())
    assert not out.exists()


class FakeMemory:
    """torch.cuda.memory's history: records while on, gives the events in a snapshot."""

    def __init__(self):
        self.recording, self.events = False, []

    def _record_memory_history(self, enabled="all", **kwargs):
        self.recording = enabled is not None

    def _snapshot(self):
        return {"device_traces": [list(self.events)],
                "segments": [{"address": 4096, "total_size": 2 << 20, "allocated_size": 1 << 20, "stream": 7}]}


def test_history_mode_logs_each_event_of_a_watched_test_and_stops_recording(tmp_path, monkeypatch):
    fake = types.SimpleNamespace(cuda=FakeCuda())
    fake.cuda.memory = FakeMemory()
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setenv("MEMPROBE_OUT", str(tmp_path / "probe.jsonl"))
    monkeypatch.setenv("MEMPROBE_MODE", "history")
    monkeypatch.setenv("MEMPROBE_TESTS", "test_randint_generation_for_large_numel")
    plugin = load_bench("peer_memprobe")
    memory = fake.cuda.memory

    def body():  # a 32 MiB allocation on stream 7, seen from the test's frame
        assert memory.recording
        memory.events.append({"action": "alloc", "addr": 4096, "size": 32 << 20, "stream": 7,
                              "frames": [{"filename": "/x/test_cuda.py", "line": 1531, "name": "test_randint"}]})

    run_hook(plugin, "test_cuda.py::TestCuda::test_randint_generation_for_large_numel", body)
    assert not memory.recording  # put back
    event, segments = [json.loads(line) for line in (tmp_path / "probe.jsonl").read_text().splitlines()]
    assert event["action"] == "alloc" and event["size"] == 32 << 20 and event["stream"] == 7
    assert event["frames"] == ["test_cuda.py:1531:test_randint"]
    assert segments["segments"] == [{"address": 4096, "size": 2 << 20, "allocated": 1 << 20, "stream": 7}]
    run_hook(plugin, "test_cuda.py::TestCuda::test_to_non_blocking", lambda: None)
    assert len((tmp_path / "probe.jsonl").read_text().splitlines()) == 2  # not watched: nothing more
