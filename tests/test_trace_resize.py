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


def test_a_free_and_a_release_carry_their_own_context():
    pool = make_pool(trace_capacity=100)
    a = pool.allocate(3 * MiB, context=11)
    pool.free(a, free_context=22)
    b = pool.allocate(MiB, context=33)
    pool.free(b)  # no free context: the allocation's
    assert pool.sequence() == 4
    pool.release_cached(context=44)
    by_action = {}
    for e in pool.snapshot()["trace"]:
        by_action.setdefault(e["action"], []).append(e["context"])
    assert by_action["alloc"] == [11, 33]
    assert by_action["free_requested"] == [22, 33]
    assert by_action["segment_map"] == [11, 33]  # mapped by the allocations (the small one in its own heap)
    assert set(by_action["segment_unmap"]) == {44}  # unmapped by the release
    assert pool.check_invariants() is None


CPP_GATHERER = "the runtime's C++ gatherer"


class _FakeRuntime:
    """Records what record_history() asks of the installed runtime."""

    def __init__(self):
        self.capacity = None
        self.cleared = 0
        self.provider = "unset"
        self.free_context = None
        self.sequences = {0: 0}

    def runtime_set_free_context(self, enabled):
        self.free_context = enabled

    def runtime_devices(self):
        return list(self.sequences)

    def runtime_sequence(self, device):
        return self.sequences[device]

    def runtime_set_trace_capacity(self, entries):
        self.capacity = entries

    def runtime_clear_trace(self):
        self.cleared += 1

    def runtime_set_context_provider(self, provider):
        self.provider = provider

    def runtime_record_torch_stacks(self, enabled, free_stacks, compile_contexts, cpp_frames=True):
        # with stacks: the runtime gathers in C++ and becomes its own provider (Note [Torch's recorder])
        if enabled:
            self.provider = CPP_GATHERER
            self.free_context = free_stacks
            self.cpp_frames = cpp_frames

    def runtime_set_compile_context_recording(self, enabled):
        self.compile_contexts = enabled


@pytest.fixture
def runtime(monkeypatch):
    import importlib

    stats = importlib.import_module("torchmem.runtime.stats")
    importlib.import_module("torchmem.runtime.snapshots")
    fake = _FakeRuntime()
    monkeypatch.setattr(stats, "_runtime", lambda: fake)
    return fake


def _torch_history(**kwargs):
    import importlib

    importlib.import_module("torchmem.runtime.snapshots").torch_record_memory_history(**kwargs)


def test_torch_modes_map_onto_ring_and_stacks(runtime):
    snapshot = sys.modules["torchmem.runtime.snapshots"]
    stacks = sys.modules["torchmem.runtime.stacks"]
    _torch_history(max_entries=1000)  # torch's defaults: enabled="all", context="all", stacks="all"
    assert runtime.capacity == 1000 and runtime.provider == CPP_GATHERER and runtime.cpp_frames
    _torch_history(max_entries=1000, stacks="python")  # Python and TorchScript frames, gathered in C++ too
    assert runtime.capacity == 1000 and runtime.provider == CPP_GATHERER and not runtime.cpp_frames
    _torch_history(enabled="state", stacks="python")  # stacks of live blocks, no events
    assert runtime.capacity == 0 and runtime.provider == CPP_GATHERER and not runtime.cpp_frames
    _torch_history(enabled="all", context=None, max_entries=7)  # events only
    assert runtime.capacity == 7 and runtime.provider is None
    _torch_history(enabled="all", context=None, compile_context=True)  # events tagged, no stacks
    assert runtime.provider is stacks.capture_compile_context and runtime.compile_contexts is True
    _torch_history(enabled=None, compile_context=True)
    assert runtime.capacity == 0 and runtime.provider is None and runtime.compile_contexts is False
    assert snapshot.history_settings() == {"enabled": False, "stacks": None, "max_entries": 0, "context": "all",
                                           "skip_actions": (), "compile_context": False}


def test_only_context_all_asks_for_free_stacks(runtime):
    for context, wanted in (("all", True), ("alloc", False), ("state", False), (None, False)):
        _torch_history(context=context)
        assert runtime.free_context is wanted, context
    _torch_history(enabled=None, context="all")
    assert runtime.free_context is False


def _core_trace():
    # what runtime_snapshot returns: an alloc (stack 1), its free (stack 2), an unmap at empty_cache (stack 3)
    return {"segments": [], "trace": [
        {"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "context": 1, "sequence": 1},
        {"action": "free_requested", "addr": 4096, "size": 512, "stream": 0, "context": 2, "sequence": 2},
        {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "context": 2, "sequence": 2},
        {"action": "segment_unmap", "addr": 0, "size": 2 << 20, "stream": 0, "context": 3, "sequence": 3}]}


def _shaped(snapshot):
    from torchmem.runtime.snapshot_format import to_torch_snapshot

    frames = {i: [{"filename": "t.py", "line": i, "name": name}]
              for i, name in ((1, "thealloc"), (2, "thefree"), (3, "empty_cache"))}
    core = _core_trace()
    return snapshot._shape_history(to_torch_snapshot(core, frames=frames), core, 0)["device_traces"][0]


def test_context_picks_which_events_show_stacks(runtime):
    snapshot = sys.modules["torchmem.runtime.snapshots"]
    names = lambda events: [e["frames"][0]["name"] if e["frames"] else None for e in events]
    _torch_history(context="all")
    assert names(_shaped(snapshot)) == ["thealloc", "thefree", "thefree", "empty_cache"]
    _torch_history(context="alloc")
    assert names(_shaped(snapshot)) == ["thealloc", None, None, None]
    _torch_history(context="state")
    assert names(_shaped(snapshot)) == [None] * 4
    _torch_history(enabled=None)


def test_skip_actions_leave_events_out(runtime):
    snapshot = sys.modules["torchmem.runtime.snapshots"]
    _torch_history(skip_actions=["free_requested", "segment_free"])  # torch's name for an unmap
    assert [e["action"] for e in _shaped(snapshot)] == ["alloc", "free_completed"]
    with pytest.raises(ValueError, match="skip_actions"):
        _torch_history(skip_actions="alloc")
    _torch_history(enabled=None)


def test_metadata_marks_the_events_after_it(runtime):
    snapshot = sys.modules["torchmem.runtime.snapshots"]
    _torch_history()
    runtime.sequences[0] = 1  # set after the alloc (sequence 1), before the free
    snapshot.set_memory_metadata("phase two")
    assert snapshot.get_memory_metadata() == "phase two"
    assert [e["user_metadata"] for e in _shaped(snapshot)] == ["", "phase two", "phase two", "phase two"]
    with pytest.raises(TypeError, match="str"):
        snapshot.set_memory_metadata(3)
    snapshot.set_memory_metadata("")
    snapshot._metadata["marks"].clear()
    _torch_history(enabled=None)


def test_torch_defaults_cap_the_ring_and_clear_history_clears(runtime):
    snapshot = sys.modules["torchmem.runtime.snapshots"]
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
