// callbacks.h: user code the runtime calls: the OOM callback and torch's OOM
// observers, the context provider that tags allocation history, and the
// compile regions and stacks that provider can gather (torch_history.cpp,
// compile_context.cpp). Defined in runtime.cpp unless noted.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "shim/runtime.h"

namespace torchmem::shim {

// Called after a failed allocation with no torchmem lock held; returns true if it
// freed memory (the allocation is retried, at most oom_hook_retries times).
using OomCallback = std::function<bool(int device, std::size_t requested)>;
void set_oom_callback(OomCallback callback);  // empty = none
// torch's OutOfMemoryObserver: (device, requested bytes, device total or the
// budget in force, device free), called in the order attached just before an
// OOM error is raised (after the OOM callback's retries), with no lock held.
using OomObserver = std::function<void(std::int64_t device, std::size_t requested, std::size_t total,
                                       std::size_t free)>;
void add_oom_observer(OomObserver observer);
// Called before each allocation; its value becomes the TraceEntry context.
using ContextProvider = std::function<std::uint64_t()>;
void set_context_provider(ContextProvider provider);
// Whether frees and empty_cache take a context from the provider as well
// (torch's context="all"); off by default: a free then costs no provider call.
void set_free_context(bool enabled);
// Note [Compile context] (torchmem/runtime/stacks.py, compile_context.cpp): the
// torch.compile region a thread runs; each thread keeps its own stack of them.
// current_compile_context() is the calling thread's innermost region, "" outside any.
void push_compile_context(const std::string& name);
void pop_compile_context();
std::string current_compile_context();
// Whether torchmem follows torch.compile regions itself (a global RecordFunction
// callback, as torch's own _record_memory_history(compile_context=True) adds).
void set_compile_context_recording(bool enabled);
// Note [Torch's recorder] (torch_history.cpp): torchmem's own history with
// stacks gathers each allocation's Python and TorchScript frames (and C++ ones
// with `cpp_frames`: stacks="all") in C++, as PyTorch's allocator does (torch's
// CapturedTraceback, before any Python runs), under ids with kTorchContextFlag
// set. With `enabled` the runtime's context provider becomes that gatherer
// (frees too with `free_stacks`; each context keeps its compile region with
// `compile_contexts`); without, the gatherer stops and the caller sets the
// provider it wants.
constexpr std::uint64_t kTorchContextFlag = std::uint64_t{1} << 61;
void record_torch_stacks(bool enabled, bool free_stacks, bool compile_contexts, bool cpp_frames);
struct StackFrame {
  std::string filename;
  std::string name;
  std::uint64_t line = 0;
};
// The frames (innermost first) of each id (none for an id the table does not hold), in one batch.
std::vector<std::vector<StackFrame>> symbolize_torch_contexts(const std::vector<std::uint64_t>& ids);
// The compile region kept with each id ("" when none was recorded), in one batch.
std::vector<std::string> torch_context_compile_contexts(const std::vector<std::uint64_t>& ids);

}  // namespace torchmem::shim
