"""The stacks behind allocation history: what a block's context id stands for.

The allocator calls a context provider before each allocation (and, with
torch's context="all", before each free); the provider returns an integer id
that the core stores with the block and its trace entries. Snapshots turn ids
back into frames (and compile contexts). Two Python providers exist, one per
torch `stacks` mode of `_record_memory_history`, for simulated pools and replays:

- capture_stack(): Python frames only (stacks="python"), deduplicated in a
  table (Note [Stack table]);
- capture_stack_with_cpp(): Python, TorchScript and C++ frames (stacks="all",
  torch's default), one CapturedTraceback per call (Note [C++ stacks]).

The installed allocator uses neither: for both modes it gathers torch's own
CapturedTraceback in C++, before any Python runs, as PyTorch's allocator does
(Note [Torch's recorder], csrc/shim/torch_history.cpp); its ids carry
TORCH_FLAG and are resolved through the runtime. A Python-level walk has no
TorchScript frames (PyTorch's test_memory_snapshot_script needs them). A
peer-suite test that finds no C++ frames on a block is looking at another
test's block, which pytest keeps alive after that test failed: test order,
not unwinding (BENCHMARKS.md, Compatibility).

Note [Stack table]
Stacks repeat: a training loop allocates from the same few hundred call sites.
The provider walks the frames (sys._getframe, cheaper than
traceback.extract_stack, which reads source lines) into a flat tuple of
(id(code), line) ints and looks it up in a dict (hashing code objects
themselves is slow); only a new stack builds frame dicts, and the table keeps
its code objects alive so their ids cannot be reused. The table therefore grows
with distinct stacks, not with allocations. Ids are never reused, so a block
allocated long ago still finds its stack. Frames are innermost first, as in
torch's snapshots; torchmem's own frames are dropped and at most MAX_FRAMES kept.

Note [C++ stacks]
capture_stack_with_cpp() gives each call torch's own CapturedTraceback
(torch._C._profiler.gather_traceback: ~1 us, the unwinder torch's allocator
uses), under an id with CPP_FLAG set, for simulated pools and replays (the
installed allocator gathers in C++ instead: Note [Torch's recorder], whose
table the runtime prunes against its own pools). Nothing repeats, so this
table is pruned too: once it holds more than its threshold, all but the newest
KEEP_NEWEST ids are dropped (prune_cpp_stacks(referenced) also keeps the ids
it is given, for a caller that knows its pools' ids), and the threshold
becomes twice what is left (amortized cost per call stays constant). Tracebacks are symbolized
(addresses to names: slow, so in one batch) only when a snapshot reads them.

Note [Compile context]
torch's _record_memory_history(compile_context=True) tags each event with the
torch.compile region it ran in ("Torch-Compiled Region: 0/0", else "N/A").
Dynamo tells the allocator when a compiled frame starts and ends
(CUDAAllocator::pushCompileContext / popCompileContext, answered in
csrc/shim/install.cpp with a per-thread stack); while compile contexts are
recorded, the providers read the calling thread's innermost one and keep it
with the id.
"""

import os
import sys
import threading

import torch

from torchmem._loader import extension

NO_COMPILE_CONTEXT = "N/A"  # torch's value for an event outside any compiled region
MAX_FRAMES = 64
CPP_FLAG = 1 << 62
TORCH_FLAG = 1 << 61  # the C++ gatherer's ids (kTorchContextFlag in csrc/shim/callbacks.h)
KEEP_NEWEST = 1024
FIRST_PRUNE_AT = 1 << 16

_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep  # torchmem/
_table_lock = threading.Lock()
_stack_ids = {}     # tuple((code, line), ..., compile context) -> id
_stack_frames = {}  # id -> [{"filename", "line", "name"}, ...]
_stack_codes = {}   # id -> the code objects of the stack (Note [Stack table])
_compile_contexts = {}  # id -> compile context, where one was recorded (Note [Compile context])
_cpp_lock = threading.Lock()
_cpp_stacks = {}    # id -> CapturedTraceback, or its frames once symbolized (Note [C++ stacks])
_cpp_state = {"next": 1, "prune_at": FIRST_PRUNE_AT}
_torch_frames = {}  # TORCH_FLAG id -> frames, from the last symbolize() that named it
_torch_compile_contexts = {}  # TORCH_FLAG id -> compile region ("" none), the same batch
# The compiled module's compile-context query while contexts are recorded, else None
# (Note [Compile context]); torch's traceback gatherer once first used (Note [C++ stacks]).
_hooks = {"compile_context": None, "gather": None}


def record_compile_contexts(enabled, runtime=None):
    """Whether the providers keep the compile context of each allocation, and whether the
    installed allocator `runtime` follows torch.compile regions (Note [Compile context])."""
    if runtime is not None:
        runtime.runtime_set_compile_context_recording(bool(enabled))
    if enabled:
        _hooks["compile_context"] = extension().runtime_compile_context
    else:
        _hooks["compile_context"] = None


def _current_compile_context():
    query = _hooks["compile_context"]
    return (query() or None) if query is not None else None


def _intern(key, frames, codes, compile_context):
    """The stack table's id for `key`, adding the entry on first sight (Note [Stack table])."""
    stack_id = _stack_ids.get(key)  # dict reads are atomic under the GIL: the fast path takes no lock
    if stack_id is None:
        with _table_lock:
            stack_id = _stack_ids.get(key)
            if stack_id is None:
                stack_id = len(_stack_frames) + 1
                _stack_frames[stack_id] = frames()
                _stack_codes[stack_id] = codes  # keeps the ids in `key` from being reused
                if compile_context is not None:
                    _compile_contexts[stack_id] = compile_context
                _stack_ids[key] = stack_id
    return stack_id


def capture_stack():
    """Captures the calling Python stack into the stack table and returns its id (0 = no
    Python frames). This is the context provider record_history(stacks="python") installs;
    pass its result as `context=` to a simulated _C.Pool.allocate to get stacks there."""
    try:
        frame = sys._getframe(1)
    except ValueError:  # called straight from C++ on a thread with no Python frames (autograd's)
        frame = None
    key = []
    codes = []
    while frame is not None and len(codes) < MAX_FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_PACKAGE_DIR):
            key.append(id(code))
            key.append(frame.f_lineno)
            codes.append(code)
        frame = frame.f_back
    compile_context = _current_compile_context()
    if not codes and compile_context is None:
        return 0
    key.append(compile_context)
    key = tuple(key)
    return _intern(key, lambda: [{"filename": code.co_filename, "line": line, "name": code.co_name}
                                 for code, line in zip(codes, key[1:-1:2])], codes, compile_context)


def capture_compile_context():
    """The provider while compile contexts but no stacks are recorded (torch's context=None
    with compile_context=True): an id for the compile context alone, 0 outside any region."""
    compile_context = _current_compile_context()
    if compile_context is None:
        return 0
    return _intern((compile_context,), list, [], compile_context)


def capture_stack_with_cpp():
    """The context provider of record_history(stacks="all"): Python, TorchScript and C++
    frames of the calling thread (torch's CapturedTraceback), under a fresh id."""
    gather = _hooks["gather"]
    if gather is None:
        gather = _hooks["gather"] = torch._C._profiler.gather_traceback
    traceback = gather(python=True, script=True, cpp=True)
    compile_context = _current_compile_context()
    with _cpp_lock:
        stack_id = CPP_FLAG | _cpp_state["next"]
        _cpp_state["next"] += 1
        _cpp_stacks[stack_id] = traceback
        if compile_context is not None:
            _compile_contexts[stack_id] = compile_context
        due = len(_cpp_stacks) > _cpp_state["prune_at"]
    if due:
        prune_cpp_stacks(referenced=())  # no pool of the caller's is known here (Note [C++ stacks])
    return stack_id


def context_ids(core_snapshot):
    """Every context id a block or a trace entry of a core snapshot names."""
    ids = {block.get("context", 0) for segment in core_snapshot["segments"] for block in segment["blocks"]}
    ids.update(entry.get("context", 0) for entry in core_snapshot.get("trace", ()))
    return ids


def prune_cpp_stacks(referenced):
    """Drops C++ stacks no id in `referenced` names, but the newest KEEP_NEWEST (Note [C++ stacks])."""
    with _cpp_lock:
        newest = CPP_FLAG | max(1, _cpp_state["next"] - KEEP_NEWEST)
        for stack_id in [i for i in _cpp_stacks if i < newest and i not in referenced]:
            del _cpp_stacks[stack_id]
            _compile_contexts.pop(stack_id, None)
        _cpp_state["prune_at"] = max(FIRST_PRUNE_AT, 2 * len(_cpp_stacks))


def _outside_torchmem(frames):
    """`frames` less torchmem's own (its provider's), as Python stacks drop them."""
    return [dict(f) for f in frames if not str(f.get("filename", "")).startswith(_PACKAGE_DIR)]


def _symbolize_gathered(stack_ids):
    """Frames of the C++ gatherer's ids among `stack_ids`, from the runtime, in one batch."""
    wanted = sorted(i for i in set(stack_ids) if i & TORCH_FLAG and not i & CPP_FLAG)
    if not wanted:
        return

    runtime = extension()
    symbolized = runtime.runtime_symbolize_torch_contexts(wanted)
    regions = runtime.runtime_torch_context_compile_contexts(wanted)
    with _cpp_lock:
        for stack_id, frames, region in zip(wanted, symbolized, regions):
            _torch_frames[stack_id] = _outside_torchmem(frames)
            _torch_compile_contexts[stack_id] = region


def _symbolize_captured(stack_ids):
    """Frames of capture_stack_with_cpp's ids among `stack_ids` not symbolized yet, in one batch."""
    with _cpp_lock:
        pending = [(i, _cpp_stacks[i]) for i in set(stack_ids)
                   if i & CPP_FLAG and i in _cpp_stacks and not isinstance(_cpp_stacks[i], list)]
    if not pending:
        return

    symbolized = torch._C._profiler.symbolize_tracebacks([tb for _, tb in pending])
    with _cpp_lock:
        for (stack_id, _), frames in zip(pending, symbolized):
            _cpp_stacks[stack_id] = _outside_torchmem(frames)


def symbolize(stack_ids):
    """Turns the C++ stacks among `stack_ids` into frames, in one batch (symbolizing is the slow part)."""
    _torch_frames.clear()  # a snapshot's batch; the runtime's table is the one that keeps contexts
    _torch_compile_contexts.clear()
    _symbolize_gathered(stack_ids)
    _symbolize_captured(stack_ids)


def stack_frames(stack_id):
    """The frames ({filename, line, name}, innermost first) of a provider's id, or []."""
    if stack_id & CPP_FLAG:
        _symbolize_captured([stack_id])  # kept once symbolized; a snapshot's gathered batch stays
        found = _cpp_stacks.get(stack_id)
        return found if isinstance(found, list) else []
    if stack_id & TORCH_FLAG:
        if stack_id not in _torch_frames:
            _symbolize_gathered([stack_id])
        return _torch_frames.get(stack_id, [])
    return _stack_frames.get(stack_id, [])


def compile_context(stack_id):
    """The compile context recorded with a provider's id, or "N/A" (Note [Compile context])."""
    if stack_id & TORCH_FLAG and not stack_id & CPP_FLAG:
        if stack_id not in _torch_compile_contexts:
            _symbolize_gathered([stack_id])  # a snapshot batches them (symbolize)
        return _torch_compile_contexts.get(stack_id) or NO_COMPILE_CONTEXT
    return _compile_contexts.get(stack_id, NO_COMPILE_CONTEXT)
