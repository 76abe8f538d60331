"""The stacks behind allocation history (torchmem/runtime/stacks.py): C++ frames, their pruning, compile contexts."""

import pytest

import torchmem
from torchmem.runtime import stacks
from torchmem.runtime.snapshots import capture_stack
from sim_pool import MiB, make_pool


def _rand_like_frame():
    return stacks.capture_stack_with_cpp()


def test_stacks_all_records_python_and_cpp_frames():
    stack_id = _rand_like_frame()
    assert stack_id & stacks.CPP_FLAG
    frames = stacks.stack_frames(stack_id)
    names = " ".join(f["name"] for f in frames)
    assert "_rand_like_frame" in names                           # this Python frame
    assert "CapturedTraceback::gather" in names or "unwind" in names  # and C++ ones
    assert not any(f["filename"].startswith(stacks._PACKAGE_DIR) for f in frames)  # torchmem's own dropped
    assert stacks.stack_frames(stack_id) == frames  # symbolized once, kept


def _runtime():
    from torchmem._loader import extension

    return extension()


@pytest.fixture
def runtime(monkeypatch):
    # record_history drives the installed allocator's runtime; nothing here touches CUDA,
    # so the runtime stands in for an installed allocator on a machine without a GPU
    from torchmem.runtime import stats

    monkeypatch.setattr(stats, "_runtime", _runtime)
    return _runtime()


def _gathered_in_cpp():
    return _runtime().runtime_provider_context_now()  # what an allocation would be given


def _gathered_while_recording(runtime, compile_region=None, **history):
    """The provider's id for one allocation made while record_history(**history) is on."""
    torchmem.record_history(max_entries=16, **history)
    if compile_region:
        runtime.runtime_push_compile_context(compile_region)
    try:
        return _gathered_in_cpp()
    finally:
        if compile_region:
            runtime.runtime_pop_compile_context()
        torchmem.record_history(enabled=False)


def test_the_installed_allocators_stacks_all_are_gathered_in_cpp(runtime):
    # Note [Torch's recorder]: record_history(stacks="all") makes the runtime gather in C++
    stack_id = _gathered_while_recording(runtime, stacks="all")
    assert stack_id & runtime.runtime_torch_context_flag() and not stack_id & stacks.CPP_FLAG
    assert runtime.runtime_provider_context_now() == 0  # history off: no provider
    frames = stacks.stack_frames(stack_id)
    names = " ".join(f["name"] for f in frames)
    assert "_gathered_in_cpp" in names                # the Python frame
    assert "record_torch_context" in names            # and the C++ ones, from inside the runtime
    assert stacks.compile_context(stack_id) == stacks.NO_COMPILE_CONTEXT
    symbolized = runtime.runtime_symbolize_torch_contexts([stack_id, runtime.runtime_torch_context_flag() | (1 << 40)])
    assert symbolized[1] == []  # an id the table never held: no frames


def test_gathered_stacks_keep_their_compile_context(runtime):
    inside = _gathered_while_recording(runtime, "Torch-Compiled Region: 0/0", stacks="all", compile_context=True)
    assert stacks.compile_context(inside) == "Torch-Compiled Region: 0/0"


def test_python_stacks_are_gathered_in_cpp_too_without_cpp_frames(runtime):
    # torch's stacks="python" is CapturedTraceback::gather(python, script, no C++): a scripted
    # function's frame shows under its name (PyTorch's test_memory_snapshot_script)
    stack_id = _gathered_while_recording(runtime, stacks="python")
    assert stack_id & runtime.runtime_torch_context_flag()
    names = " ".join(f["name"] for f in stacks.stack_frames(stack_id))
    assert "_gathered_in_cpp" in names and "record_torch_context" not in names


def test_cpp_stacks_show_in_a_snapshot_of_the_blocks_that_hold_them():
    pool = make_pool()
    addr = pool.allocate(3 * MiB, 0, 0, _rand_like_frame())
    snap = torchmem.snapshot(pool=pool)
    live = [b for s in snap["segments"] for b in s["blocks"] if b["state"] == "active_allocated"]
    assert len(live) == 1 and "_rand_like_frame" in str(live[0]["frames"])
    pool.free(addr)


def test_pruning_keeps_what_is_referenced_and_the_newest(monkeypatch):
    monkeypatch.setattr(stacks, "KEEP_NEWEST", 2)
    ids = [stacks.capture_stack_with_cpp() for _ in range(6)]
    stacks.prune_cpp_stacks(referenced={ids[1]})
    kept = {i for i in ids if i in stacks._cpp_stacks}
    assert kept == {ids[1], ids[4], ids[5]}
    assert stacks.stack_frames(ids[0]) == []  # a pruned id reads as no stack
    assert stacks._cpp_state["prune_at"] >= stacks.FIRST_PRUNE_AT


def test_compile_context_goes_with_the_stack_only_while_recorded():
    from torchmem._loader import _C

    outside = capture_stack()
    stacks.record_compile_contexts(True)
    try:
        _C.runtime_push_compile_context("Torch-Compiled Region: 0/0")
        inside = capture_stack()
        inside_cpp = stacks.capture_stack_with_cpp()
        alone = stacks.capture_compile_context()
        _C.runtime_pop_compile_context()
        after = stacks.capture_compile_context()
    finally:
        stacks.record_compile_contexts(False)
    assert inside != outside  # same Python stack apart from the line, but tagged
    assert stacks.compile_context(inside) == "Torch-Compiled Region: 0/0"
    assert stacks.compile_context(inside_cpp) == "Torch-Compiled Region: 0/0"
    assert stacks.compile_context(alone) == "Torch-Compiled Region: 0/0" and stacks.stack_frames(alone) == []
    assert after == 0 and stacks.compile_context(outside) == "N/A"


def test_trace_entries_carry_their_compile_context():
    from torchmem._loader import _C

    pool = make_pool()
    stacks.record_compile_contexts(True)
    try:
        _C.runtime_push_compile_context("Torch-Compiled Region: 1/0")
        addr = pool.allocate(1000, 0, 0, capture_stack())
        _C.runtime_pop_compile_context()
    finally:
        stacks.record_compile_contexts(False)
    plain = pool.allocate(1000, 0, 0, capture_stack())
    from torchmem.runtime.snapshot_format import to_torch_snapshot

    trace = to_torch_snapshot(pool.snapshot(), frames=stacks.stack_frames,
                              compile_contexts=stacks.compile_context)["device_traces"][0]
    allocs = [e for e in trace if e["action"] == "alloc"]
    assert [e["compile_context"] for e in allocs] == ["Torch-Compiled Region: 1/0", "N/A"]
    pool.free(addr)
    pool.free(plain)


def test_record_history_rejects_unknown_stacks():
    with pytest.raises(ValueError, match="stacks must be 'python', 'all' or None"):
        torchmem.record_history(stacks="cpp")

