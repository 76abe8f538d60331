// torch_history.cpp: torch's recorder and C++ snapshot over torchmem's pools
// (see the header).
//
// Note [Torch's recorder] torch::cuda::_record_memory_history passes the
// allocator a function that gathers the calling thread's Python, TorchScript
// and (with stacks "all") C++ frames into a CapturedTraceback. torchmem's
// pools store a 64-bit context per block and trace entry, so the recorder runs
// as the runtime's context provider: each context it returns is kept in a
// table under a fresh id with kTorchContextFlag set (apart from the Python
// provider's ids: torchmem/runtime/stacks.py), and torch_snapshot() hands the
// contexts back in torch's structs, where torch symbolizes them itself. Ids
// are never reused. The table is pruned like the Python side's C++ stacks:
// past its threshold, every id no live block and no trace entry of any device
// names is dropped (but the newest kKeepNewest, which an allocation on another
// thread may hold before its block exists), and the threshold becomes twice
// what is left.
#include "shim/torch_history.h"
#include "shim/allocation.h"
#include "shim/callbacks.h"
#include "shim/device_stats.h"
#include "shim/private_pools.h"

#include <torch/csrc/profiler/combined_traceback.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

namespace torchmem::shim {

namespace {

using TorchContext = std::shared_ptr<c10::GatheredContext>;
// torch's structs, by what SnapshotInfo holds: their namespace moved between
// torch versions (c10::cuda::CUDACachingAllocator, c10::CachingDeviceAllocator).
using TorchSegment = decltype(TorchSnapshot::segments)::value_type;
using TorchBlock = decltype(TorchSegment::blocks)::value_type;
using TorchTrace = decltype(TorchSnapshot::device_traces)::value_type::value_type;

constexpr std::uint64_t kKeepNewest = 1024;
constexpr std::size_t kFirstPruneAt = std::size_t{1} << 16;

struct Recorded {
  TorchContext context;
  std::string compile_context;  // "" when none was recorded (Note [Compile context])
};

struct RecorderState {
  std::mutex mutex;  // a leaf: held for table work only, never while calling torch or a pool
  TorchRecorder recorder = nullptr;
  TorchRecordContext when = TorchRecordContext::NEVER;
  bool compile_contexts = false;
  std::unordered_map<std::uint64_t, Recorded> contexts;
  std::uint64_t next = 1;
  std::size_t prune_at = kFirstPruneAt;
};

RecorderState& recorder_state() {
  static RecorderState* state = new RecorderState();  // never destroyed: frees may come at shutdown
  return *state;
}

// Every context id a live block or a trace entry of any device's pool names.
std::unordered_set<std::uint64_t> referenced_contexts() {
  std::unordered_set<std::uint64_t> ids;
  auto add = [&](const PoolSnapshot& snapshot) {
    for (const auto& segment : snapshot.segments) {
      for (const auto& block : segment.blocks) ids.insert(block.context);
    }
    for (const auto& entry : snapshot.trace) ids.insert(entry.context);
  };
  for (int device : devices()) {
    add(device_pool(device).snapshot());
    for (const auto& external : external_pool_snapshots(device)) add(external.second);  // MemPool(allocator=X)
  }
  return ids;
}

void prune_contexts() {
  const std::unordered_set<std::uint64_t> referenced = referenced_contexts();  // no table lock: takes pool locks
  RecorderState& state = recorder_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  const std::uint64_t newest = kTorchContextFlag | (state.next > kKeepNewest ? state.next - kKeepNewest : 1);
  for (auto it = state.contexts.begin(); it != state.contexts.end();) {
    it = (it->first < newest && !referenced.count(it->first)) ? state.contexts.erase(it) : std::next(it);
  }
  state.prune_at = std::max(kFirstPruneAt, 2 * state.contexts.size());
}

// The context provider while torch's recorder is followed (called with no torchmem lock held).
std::uint64_t record_torch_context() {
  RecorderState& state = recorder_state();
  TorchRecorder recorder = nullptr;
  bool with_compile_context = false;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    recorder = state.recorder;
    with_compile_context = state.compile_contexts;
  }
  if (recorder == nullptr) return 0;
  TorchContext context = recorder();
  if (!context) return 0;
  Recorded recorded{std::move(context), with_compile_context ? current_compile_context() : std::string()};
  std::uint64_t id = 0;
  bool due = false;
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    id = kTorchContextFlag | state.next++;
    state.contexts.emplace(id, std::move(recorded));
    due = state.contexts.size() > state.prune_at;
  }
  if (due) prune_contexts();
  return id;
}

TorchContext context_for(std::uint64_t id) {
  if ((id & kTorchContextFlag) == 0) return nullptr;  // none, or the Python provider's
  RecorderState& state = recorder_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  auto found = state.contexts.find(id);
  return found == state.contexts.end() ? nullptr : found->second.context;
}

// What torch's recorder gathers: stacks "all" adds C++ frames; "python" keeps the Python and
// TorchScript frames (a scripted function's own name, which a Python-level walk cannot see).
std::shared_ptr<c10::GatheredContext> gather_all_frames() { return torch::CapturedTraceback::gather(true, true, true); }
std::shared_ptr<c10::GatheredContext> gather_python_frames() {
  return torch::CapturedTraceback::gather(true, true, false);
}

TorchTrace::Action torch_action(TraceAction action, bool vmm) {
  switch (action) {
    case TraceAction::kAlloc: return TorchTrace::ALLOC;
    case TraceAction::kFreeRequested: return TorchTrace::FREE_REQUESTED;
    case TraceAction::kFreeCompleted: return TorchTrace::FREE_COMPLETED;
    // mapped granules read as torch's expandable segments do (torchmem/runtime/snapshot_format.py)
    case TraceAction::kSegmentMap: return vmm ? TorchTrace::SEGMENT_MAP : TorchTrace::SEGMENT_ALLOC;
    case TraceAction::kSegmentUnmap: return vmm ? TorchTrace::SEGMENT_UNMAP : TorchTrace::SEGMENT_FREE;
    case TraceAction::kOom: return TorchTrace::OOM;
  }
  return TorchTrace::ALLOC;
}

c10::cuda::MempoolId_t torch_key(MempoolKey key) { return {key.first, key.second}; }

}  // namespace

void follow_torch_recorder(TorchRecorder recorder, TorchRecordContext when) {
  const bool recording = recorder != nullptr && when != TorchRecordContext::NEVER;
  {
    RecorderState& state = recorder_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.recorder = recording ? recorder : nullptr;
    state.when = recording ? when : TorchRecordContext::NEVER;
    state.compile_contexts = false;  // torch's C++ path records compile contexts in its own way
  }
  set_context_provider(recording ? ContextProvider(&record_torch_context) : ContextProvider());
  set_free_context(recording && when == TorchRecordContext::ALL);
}

void record_torch_stacks(bool enabled, bool free_stacks, bool compile_contexts, bool cpp_frames) {
  {
    RecorderState& state = recorder_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    state.recorder = !enabled ? nullptr : cpp_frames ? &gather_all_frames : &gather_python_frames;
    state.when = !enabled ? TorchRecordContext::NEVER : free_stacks ? TorchRecordContext::ALL : TorchRecordContext::ALLOC;
    state.compile_contexts = enabled && compile_contexts;
  }
  if (!enabled) return;  // the caller sets the provider it wants
  set_context_provider(ContextProvider(&record_torch_context));
  set_free_context(free_stacks);
}

std::vector<std::vector<StackFrame>> symbolize_torch_contexts(const std::vector<std::uint64_t>& ids) {
  std::vector<TorchContext> held(ids.size());  // kept alive while symbolizing, outside the table lock
  std::vector<torch::CapturedTraceback*> tracebacks;
  std::vector<std::size_t> slot(ids.size(), SIZE_MAX);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    held[i] = context_for(ids[i]);
    if (auto* traceback = dynamic_cast<torch::CapturedTraceback*>(held[i].get())) {
      slot[i] = tracebacks.size();
      tracebacks.push_back(traceback);
    }
  }
  std::vector<std::vector<StackFrame>> out(ids.size());
  if (tracebacks.empty()) return out;
  const torch::SymbolizedTracebacks symbolized = torch::symbolize(tracebacks);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    if (slot[i] == SIZE_MAX) continue;
    for (std::uint64_t index : symbolized.tracebacks.at(slot[i])) {
      const auto& frame = symbolized.all_frames.at(index);
      out[i].push_back(StackFrame{frame.filename, frame.funcname, frame.lineno});
    }
  }
  return out;
}

std::vector<std::string> torch_context_compile_contexts(const std::vector<std::uint64_t>& ids) {
  std::vector<std::string> out(ids.size());
  RecorderState& state = recorder_state();
  std::lock_guard<std::mutex> lock(state.mutex);
  for (std::size_t i = 0; i < ids.size(); ++i) {
    auto found = state.contexts.find(ids[i]);
    if (found != state.contexts.end()) out[i] = found->second.compile_context;
  }
  return out;
}

TorchSnapshot torch_snapshot(MempoolKey key, bool include_traces) {
  TorchRecordContext when = TorchRecordContext::NEVER;
  {
    RecorderState& state = recorder_state();
    std::lock_guard<std::mutex> lock(state.mutex);
    when = state.when;
  }
  // As torch's: trace entries carry stacks only when it records them for allocations too.
  const bool trace_contexts = when == TorchRecordContext::ALLOC || when == TorchRecordContext::ALL;
  const bool only_one_pool = key != MempoolKey(0, 0);
  TorchSnapshot out{};  // value-initialized: torch pickles config_metadata's scalars too
  for (int device : devices()) {
    const bool vmm = backend_name(device) == "vmm";
    // torch names private pools by its own keys; blocks parked for a pool's graphs are free to torch
    const PrivatePoolNames names = private_pool_names(device);
    const PoolSnapshot snapshot = device_pool(device).snapshot();
    // the device pool's segments, then each MemPool(allocator=X)'s (Note [External pool allocators])
    struct Listed {
      const SegmentInfo* segment;
      MempoolKey owner;
      bool external;  // X's segment: plain, not mapped granules
    };
    std::vector<Listed> all;
    for (const auto& segment : snapshot.segments) {
      all.push_back(Listed{&segment, names.key_of(segment.pool), false});
    }
    const auto externals = external_pool_snapshots(device);
    for (const auto& [external_key, external] : externals) {
      for (const auto& segment : external.segments) all.push_back(Listed{&segment, external_key, true});
    }
    for (const Listed& listed : all) {
      const SegmentInfo& segment = *listed.segment;
      const MempoolKey owner_key = listed.owner;
      if (only_one_pool && owner_key != key) continue;
      TorchSegment info;
      info.device = static_cast<c10::DeviceIndex>(device);
      info.address = static_cast<size_t>(segment.addr);
      info.total_size = segment.size;
      info.stream = reinterpret_cast<decltype(info.stream)>(segment.stream);  // void* or cudaStream_t
      info.is_large = !segment.small_heap;
      info.is_expandable = vmm && !listed.external;
      info.owner_private_pool_id = torch_key(owner_key);
      for (const auto& block : segment.blocks) {
        const bool is_parked = names.parked.count(block.addr) != 0;
        TorchBlock b;
        b.size = block.size;
        b.requested_size = std::min(block.requested, block.size);
        b.allocated = block.state == BlockState::kAllocated && !is_parked;
        b.active = block.state != BlockState::kInactive && !is_parked;
        if (b.allocated) {
          b.context_when_allocated = context_for(block.context);
          info.allocated_size += block.size;
          info.requested_size += b.requested_size;
        }
        if (b.active) info.active_size += block.size;
        info.blocks.push_back(std::move(b));
      }
      out.segments.push_back(std::move(info));
    }
    std::vector<TorchTrace> trace;
    if (include_traces) trace.reserve(snapshot.trace.size());
    for (const TraceEntry& entry : snapshot.trace) {
      if (!include_traces) break;
      const MempoolKey owner_key = names.key_of(entry.pool);
      if (only_one_pool && owner_key != key) continue;
      using TraceStream = decltype(std::declval<TorchTrace&>().stream_);  // void* or cudaStream_t
      TorchTrace te(torch_action(entry.action, vmm), static_cast<c10::DeviceIndex>(device),
                    static_cast<size_t>(entry.addr), entry.size, reinterpret_cast<TraceStream>(entry.stream),
                    torch_key(owner_key), c10::approx_time_t{0},
                    trace_contexts ? context_for(entry.context) : nullptr);
      // torch reads time_.t_ once the allocator converted its clock; the pool has no clock,
      // and its operation sequence orders events the same way (torchmem/runtime/snapshot_format.py).
      te.time_.t_ = static_cast<time_t>(entry.sequence);
      trace.push_back(std::move(te));
    }
    // torch indexes device_traces by device
    if (out.device_traces.size() <= static_cast<size_t>(device)) out.device_traces.resize(device + 1);
    out.device_traces[device] = std::move(trace);
  }
  return out;
}

}  // namespace torchmem::shim
