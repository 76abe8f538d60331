"""Resizing a live pool's trace ring (Pool::set_trace_capacity, clear_trace) on the
simulated pool, and the mapping of torch's _record_memory_history options onto
record_history() (snapshot.py Note [Live trace ring]) with a stand-in runtime."""

import sys

import pytest

from tests.sim_pool import MiB, make_pool


def _churn(pool, n):
    for _ in range(n):
        pool.free(pool.allocate(MiB + 512))


def _sequences(pool):
    return [e["sequence"] for e in pool.snapshot()["trace"]]


def test_a_pool_made_without_a_trace_starts_one_later():
    pool = make_pool(trace_capacity=0)
    _churn(pool, 3)
    assert pool.snapshot()["trace"] == []
    pool.set_trace_capacity(100)
    _churn(pool, 2)
    actions = [e["action"] for e in pool.snapshot()["trace"]]
    assert actions.count("alloc") == 2 and actions.count("free_completed") == 2
    assert pool.check_invariants() is None


def test_shrinking_keeps_the_newest_entries_in_order():
    pool = make_pool(trace_capacity=50)
    _churn(pool, 10)
    before = _sequences(pool)
    assert len(before) > 8
    pool.set_trace_capacity(4)
    assert _sequences(pool) == before[-4:]
    _churn(pool, 3)  # the shrunk ring keeps wrapping correctly
    after = _sequences(pool)
    assert len(after) == 4 and after == sorted(after) and after[-1] > before[-1]


def test_growing_keeps_every_entry_and_then_holds_more():
    pool = make_pool(trace_capacity=3)
    _churn(pool, 5)  # the ring has wrapped
    wrapped = _sequences(pool)
    assert len(wrapped) == 3
    pool.set_trace_capacity(1000)
    assert _sequences(pool) == wrapped
    _churn(pool, 5)
    grown = _sequences(pool)
    assert grown[:3] == wrapped and len(grown) > 3 and grown == sorted(grown)


def test_capacity_zero_stops_and_drops_and_clear_keeps_recording():
    pool = make_pool(trace_capacity=100)
    _churn(pool, 2)
    pool.clear_trace()
    assert pool.snapshot()["trace"] == []
    _churn(pool, 1)
    assert len(pool.snapshot()["trace"]) > 0  # clear does not stop recording
    pool.set_trace_capacity(0)
    _churn(pool, 2)
    assert pool.snapshot()["trace"] == []


class _FakeRuntime:
    """Records what record_history() asks of the installed runtime."""

    def __init__(self):
        self.capacity = None
        self.cleared = 0
        self.provider = "unset"

    def runtime_set_trace_capacity(self, entries):
        self.capacity = entries

    def runtime_clear_trace(self):
        self.cleared += 1

    def runtime_set_context_provider(self, provider):
        self.provider = provider


@pytest.fixture
def runtime(monkeypatch):
    import importlib

    stats = importlib.import_module("torchmem.stats")
    importlib.import_module("torchmem.snapshot")
    fake = _FakeRuntime()
    monkeypatch.setattr(stats, "_runtime", lambda: fake)
    return fake


def _torch_history(**kwargs):
    import importlib

    importlib.import_module("torchmem.snapshot").torch_record_memory_history(**kwargs)


def test_torch_modes_map_onto_ring_and_stacks(runtime):
    snapshot = sys.modules["torchmem.snapshot"]
    _torch_history(max_entries=1000)  # torch's defaults: enabled="all", context="all"
    assert runtime.capacity == 1000 and runtime.provider is snapshot.capture_stack
    _torch_history(enabled="state")  # stacks of live blocks, no events
    assert runtime.capacity == 0 and runtime.provider is snapshot.capture_stack
    _torch_history(enabled="all", context=None, max_entries=7)  # events only
    assert runtime.capacity == 7 and runtime.provider is None
    _torch_history(enabled=None)
    assert runtime.capacity == 0 and runtime.provider is None
    assert snapshot.history_settings() == {"enabled": False, "stacks": None, "max_entries": 0}


def test_torch_defaults_cap_the_ring_and_clear_history_clears(runtime):
    snapshot = sys.modules["torchmem.snapshot"]
    _torch_history(max_entries=sys.maxsize, clear_history=True)
    assert runtime.capacity == snapshot.MAX_TRACE_ENTRIES and runtime.cleared == 1
    _torch_history(enabled=True)  # the legacy boolean form
    assert runtime.capacity == snapshot.MAX_TRACE_ENTRIES and runtime.cleared == 1


@pytest.mark.parametrize("kwargs, word", [
    ({"enabled": "sometimes"}, "enabled"),
    ({"context": "cpp"}, "context"),
    ({"stacks": "cpp"}, "stacks"),
    ({"max_entries": "many"}, "max_entries"),
])
def test_torch_bad_options_raise_naming_the_option(runtime, kwargs, word):
    with pytest.raises(ValueError, match=word):
        _torch_history(**kwargs)
    assert runtime.capacity is None  # nothing changed
