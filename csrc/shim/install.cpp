// install.cpp: swaps torch's CUDA allocator for torchmem's, in C++.
//
// Why C++ and not torch.cuda.memory.CUDAPluggableAllocator from Python: the pool
// hooks (begin/end allocate to pool, release pool) take std::function and
// std::pair by value, which a plain C function address from ctypes cannot
// provide; from here every hook is a lambda built with torch's own ABI. This,
// checkpoint.cpp and torch_history.cpp are the only files that include torch's
// allocator headers (each costs ~1 minute to compile). It also answers torch's
// stats and cacheInfo queries (Note [Answering torch's own queries]) and
// forwards CUDA graph trees' checkpoint calls to checkpoint.cpp, torch's C++
// history and snapshot to torch_history.cpp and CUDA IPC to ipc.cpp.
#include <torch/csrc/cuda/CUDAPluggableAllocator.h>

#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <string>
#include <vector>

#include "shim/allocation.h"
#include "shim/budget.h"
#include "shim/callbacks.h"
#include "shim/checkpoint.h"
#include "shim/device_stats.h"
#include "shim/ipc.h"
#include "shim/private_pools.h"
#include "shim/runtime.h"
#include "shim/torch_history.h"

namespace torchmem::shim {

namespace {

using torch::cuda::CUDAPluggableAllocator::CUDAPluggableAllocator;
using TorchDeviceStats = c10::cuda::CUDACachingAllocator::DeviceStats;

std::mutex install_mutex;

// The same cap as torchmem/runtime/snapshots.py MAX_TRACE_ENTRIES: torch's default
// max_entries (SIZE_MAX) would ask for an unbounded ring.
constexpr size_t kMaxTraceEntries = size_t{1} << 20;

void follow_torch_history(bool enabled, TorchRecorder recorder, size_t max_entries, TorchRecordContext when,
                          bool clear_history) {
  set_trace_capacity(enabled ? std::clamp<size_t>(max_entries, 1, kMaxTraceEntries) : 0);
  if (clear_history) clear_trace();
  follow_torch_recorder(enabled ? recorder : nullptr, when);
}

// Note [Answering torch's own queries] CUDAPluggableAllocator raises on
// getDeviceStats, resetPeakStats, resetAccumulatedStats and cacheInfo, which
// breaks torch.cuda.memory_stats / max_memory_allocated (and so Lightning's and
// HF's memory metrics) and cudnn.benchmark (cuDNN sizes its workspace with
// cacheInfo). torchmem's counters carry PyTorch's names and meanings
// (core/stats.h), so a subclass answers these from the pool. Everything else
// (the hooks, their std::function slots) is CUDAPluggableAllocator's.
//
// Note [Allocation without torch's bookkeeping] CUDAPluggableAllocator's own
// allocate/free go through two std::function calls, a mutex and an
// unordered_map insert and erase (a heap node per tensor) to remember each
// block's size, device and stream for the free. The pool remembers all three
// itself, so the subclass allocates straight into the runtime and frees through
// a device-tagged context (Note [Device-tagged deleter context], allocation.h).
// The churn microbenchmark measures the difference (BENCHMARKS.md, Allocator
// hot path).
class TorchmemAllocator final : public CUDAPluggableAllocator {
 public:
  using CUDAPluggableAllocator::CUDAPluggableAllocator;

  // Note [Zero bytes, no block] As PyTorch's allocator: a 0-byte request gets a
  // null pointer and touches no pool (an empty tensor holds no memory; inside a
  // MemPool(allocator=X) it must not make X grow). The extern "C" exports, which
  // torch's base CUDAPluggableAllocator calls, still get a block (Note
  // [Zero-size requests], runtime.cpp): its bookkeeping is keyed by pointer.
  c10::DataPtr allocate(size_t size) override {
    const c10::DeviceIndex device = c10::cuda::current_device();
    const c10::Device where(c10::DeviceType::CUDA, device);
    if (size == 0) return {nullptr, nullptr, &delete_tagged_block, where};  // never deleted: null context
    void* ptr = allocate_or_throw(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
    return {ptr, tag_with_device(ptr, device), &delete_tagged_block, where};
  }

  c10::DeleterFnPtr raw_deleter() const override { return &delete_tagged_block; }

  void* raw_alloc(size_t size) override {
    if (size == 0) return nullptr;  // Note [Zero bytes, no block]
    const c10::DeviceIndex device = c10::cuda::current_device();
    return allocate_or_throw(size, device, c10::cuda::getCurrentCUDAStream(device).stream());
  }

  void* raw_alloc_with_stream(size_t size, cudaStream_t stream) override {
    if (size == 0) return nullptr;  // Note [Zero bytes, no block]
    return allocate_or_throw(size, c10::cuda::current_device(), stream);
  }

  // Called from Python (torch.cuda.caching_allocator_delete): may raise.
  void raw_delete(void* ptr) override {
    if (ptr != nullptr) deallocate(ptr, owning_device(ptr));
  }

  // torch.cuda.MemPool's destructor empties its own pool's cache; (0, 0) is
  // torch.cuda.empty_cache(). No `override`: older torch has emptyCache() alone.
  void emptyCache(c10::cuda::MempoolId_t mempool_id = {0, 0}) {
    empty_pool_cache(MempoolKey(mempool_id.first, mempool_id.second));
  }

  // Note [Caching off] (allocation.h): torch.cuda.caching_allocator_enable.
  void enable(bool value) override { set_caching_enabled(value); }
  bool isEnabled() const override { return caching_enabled(); }

  TorchDeviceStats getDeviceStats(c10::DeviceIndex device) override {
    PoolStats stats = device_stats(device);
    TorchDeviceStats out;
#define TORCHMEM_COPY_STAT_ARRAY(name)                      \
  for (int kind = 0; kind < kStatKinds; ++kind) {           \
    out.name[kind].current = stats.name[kind].current;      \
    out.name[kind].peak = stats.name[kind].peak;            \
    out.name[kind].allocated = static_cast<int64_t>(stats.name[kind].allocated); \
    out.name[kind].freed = static_cast<int64_t>(stats.name[kind].freed);         \
  }
    TORCHMEM_STAT_ARRAYS(TORCHMEM_COPY_STAT_ARRAY)
#undef TORCHMEM_COPY_STAT_ARRAY
    out.num_alloc_retries = static_cast<int64_t>(stats.num_alloc_retries);
    out.num_ooms = static_cast<int64_t>(stats.num_ooms);
    out.num_sync_all_streams = static_cast<int64_t>(stats.num_sync_all_streams);
    out.num_device_alloc = static_cast<int64_t>(stats.num_device_alloc);
    out.num_device_free = static_cast<int64_t>(stats.num_device_free);
    out.max_split_size = -1;  // torchmem splits any free block; native's "no max_split_size" reads -1
    return out;
  }

  // torch's C++ history (torch::cuda::_record_memory_history, and
  // torch._C._cuda_record_memory_history when torch.cuda.memory is not patched:
  // install(patch_torch=False)): torchmem's trace ring follows it, and torch's
  // context recorder runs for each allocation (Note [Torch's recorder],
  // torch_history.cpp), so snapshot() below gives torch's own frames. No
  // `override`: the parameter list differs between torch versions.
  void recordHistory(bool enabled, TorchRecorder recorder, size_t max_entries, TorchRecordContext when,
                     bool clear_history, const std::vector<std::string>& /*skip_actions*/) {
    follow_torch_history(enabled, recorder, max_entries, when, clear_history);
  }
  void recordHistory(bool enabled, TorchRecorder recorder, size_t max_entries, TorchRecordContext when,
                     bool clear_history) {
    follow_torch_history(enabled, recorder, max_entries, when, clear_history);
  }
  void recordHistory(bool enabled, TorchRecorder recorder, size_t max_entries, TorchRecordContext when) {
    follow_torch_history(enabled, recorder, max_entries, when, false);
  }

  // torch::cuda::_memory_snapshot_pickled and torch._C._cuda_memorySnapshot
  // (torch_history.cpp). No `override`: the parameters differ between torch
  // versions (none; a pool id; a pool id and include_traces), and whichever
  // one torch declares is the one that overrides.
  TorchSnapshot snapshot(c10::cuda::MempoolId_t mempool_id, bool include_traces) {
    return torch_snapshot(MempoolKey(mempool_id.first, mempool_id.second), include_traces);
  }
  TorchSnapshot snapshot(c10::cuda::MempoolId_t mempool_id) {
    return torch_snapshot(MempoolKey(mempool_id.first, mempool_id.second), true);
  }
  TorchSnapshot snapshot() { return torch_snapshot(MempoolKey(0, 0), true); }

  // Note [Compile context] (callbacks.h). No `override`: older torch lacks them.
  void pushCompileContext(std::string& md) { push_compile_context(md); }
  void popCompileContext() { pop_compile_context(); }

  // Note [CUDA IPC] (ipc.cpp): torch.multiprocessing's CUDA tensors.
  c10::cuda::CUDACachingAllocator::ShareableHandle shareIpcHandle(void* ptr) override {
    IpcShare share = share_ipc(ptr);
    return {share.offset, std::move(share.handle)};
  }
  std::shared_ptr<void> getIpcDevPtr(std::string handle) override { return open_ipc(handle); }

  // Note [Memory fraction] (budget.h)
  double getMemoryFraction(c10::DeviceIndex device) override { return memory_fraction(device); }

  // Called like native's: (device, requested bytes, device total or the
  // budget in force, device free) just before the OOM error is raised.
  void attachOutOfMemoryObserver(c10::cuda::CUDACachingAllocator::OutOfMemoryObserver observer) override {
    add_oom_observer([observer = std::move(observer)](int64_t device, size_t requested, size_t total,
                                                      size_t free) { observer(device, requested, total, free); });
  }

  // Note [Trace trackers] torch's NCCL process group attaches one to register
  // every segment with NCCL (TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK=1,
  // ProcessGroupNCCL.register_mem_pool). torchmem's segments are VMM ranges
  // whose granules move, which NCCL cannot keep registered, so none is
  // reported: collectives run on unregistered memory, as without the option.
  // Raising instead is no way out: the process group attaches it where an
  // exception ends the process (std::terminate).
  void attachAllocatorTraceTracker(c10::cuda::CUDACachingAllocator::AllocatorTraceTracker) override {
    TORCH_WARN_ONCE(
        "torchmem: TORCH_NCCL_USE_TENSOR_REGISTER_ALLOCATOR_HOOK / register_mem_pool have no effect under "
        "torchmem: its memory is not registered with NCCL (collectives work, unregistered). Unset the option to "
        "silence this (docs/compatibility.md, NCCL)");
  }

  // Private-pool reference counts (torch.cuda.MemPool, graph pools). No
  // `override`: which of these torch declares differs between versions; a
  // name torch does not declare is simply unused.
  // Note [External pool allocators] (private_pools.h): torch.cuda.MemPool(allocator=X)
  // passes X here. The functions hold X's shared_ptr, so X outlives the
  // MemPool and the Python object for as long as any block of it lives.
  void createOrIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                          std::shared_ptr<c10::cuda::CUDACachingAllocator::CUDAAllocator> allocator = nullptr) {
    std::shared_ptr<ExternalAllocator> external;
    if (allocator != nullptr && allocator.get() != this) {
      external = std::make_shared<ExternalAllocator>();
      external->allocate = [allocator](size_t size, CudaStream stream) {
        return allocator->raw_alloc_with_stream(size, stream);
      };
      external->free = [allocator](void* ptr) { allocator->raw_delete(ptr); };
    }
    incref_pool(device, MempoolKey(id.first, id.second), std::move(external));
  }
  void ensureExistsAndIncrefPool(c10::DeviceIndex device, c10::cuda::MempoolId_t id) {
    incref_pool(device, MempoolKey(id.first, id.second));
  }
  int getPoolUseCount(c10::DeviceIndex device, c10::cuda::MempoolId_t id) {
    return pool_use_count(device, MempoolKey(id.first, id.second));
  }
  // torch.cuda.MemPool's constructor calls these; torch's base class raises
  // in them. use_on_oom lends a MemPool(allocator=X)'s cached blocks to the
  // device pool on OOM (Note [External pool allocators]); a pool without an
  // allocator of its own lives inside the device pool, which never lends
  // private memory, and torchmem never split-limits: those flags are accepted
  // without effect. Both signatures (with and without the flag) have existed.
  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t id, bool use_on_oom) {
    set_use_on_oom(device, MempoolKey(id.first, id.second), use_on_oom);
  }
  void setUseOnOOM(c10::DeviceIndex device, c10::cuda::MempoolId_t id) {
    set_use_on_oom(device, MempoolKey(id.first, id.second), true);
  }
  void setNoSplit(c10::DeviceIndex /*device*/, c10::cuda::MempoolId_t /*id*/) {}

  // CUDA graph trees (torch.compile mode="reduce-overhead"): csrc/shim/checkpoint.cpp.
  // The signatures are the same in every torch torchmem supports.
  std::shared_ptr<TorchAllocatorState> getCheckpointState(c10::DeviceIndex device,
                                                          c10::cuda::MempoolId_t id) override {
    return checkpoint_state(device, MempoolKey(id.first, id.second));
  }
  TorchCheckpointDelta setCheckpointPoolState(c10::DeviceIndex device,
                                              std::shared_ptr<TorchAllocatorState> state) override {
    return restore_checkpoint(device, state);
  }
  bool checkPoolLiveAllocations(c10::DeviceIndex device, c10::cuda::MempoolId_t id,
                                const std::unordered_set<void*>& expected_live_allocations) override {
    return pool_live_allocations_are(device, MempoolKey(id.first, id.second), expected_live_allocations);
  }

  void resetPeakStats(c10::DeviceIndex device) override { reset_peak_stats(device); }

  void resetAccumulatedStats(c10::DeviceIndex device) override { reset_accumulated_stats(device); }

  // The largest block torchmem can hand out without failing: a cached free
  // block, or new memory under the budget and the device's free memory.
  void cacheInfo(c10::DeviceIndex device, size_t* largest_block) override {
    Pool& pool = device_pool(device);
    PoolStats stats = pool.stats();
    MemInfo mem = device_mem_info(device);
    const auto reserved = static_cast<std::size_t>(stats.reserved_bytes[kStatAll].current);
    const std::size_t budget = pool.limit() ? pool.limit() : mem.total_bytes;
    const std::size_t headroom = std::min(budget > reserved ? budget - reserved : 0, mem.free_bytes);
    *largest_block = std::max(static_cast<std::size_t>(stats.largest_free_block), headroom);
  }
};

}  // namespace

bool torch_allocator_initialized() {
  auto* current = c10::cuda::CUDACachingAllocator::allocator.load();
  return current != nullptr && current->initialized();
}

void install(const RuntimeConfig& config) {
  check_config(config);  // a bad value is named before any other error
  std::lock_guard<std::mutex> lock(install_mutex);
  if (is_installed()) {
    configure(config);  // throws if the config differs from the one in force
    return;
  }
  if (torch_allocator_initialized()) {
    throw std::runtime_error(
        "torchmem.install(): PyTorch's CUDA allocator is already initialized, and an initialized allocator "
        "cannot be swapped. It initializes on the first CUDA tensor or torch.cuda call; call "
        "torchmem.install() right after `import torch`, before anything touches CUDA.");
  }
  configure(config);
  auto created = std::make_shared<TorchmemAllocator>(
      [](size_t size, int device, cudaStream_t stream) { return allocate_or_throw(size, device, stream); },
      [](void* ptr, size_t, int device, cudaStream_t) { deallocate(ptr, device); });
  TorchmemAllocator* allocator = created.get();
  allocator->init(0);  // as createCustomAllocator does; torch's lazy CUDA init calls init(n) again
  // Pools are made lazily per device at first use, so init has nothing to do;
  // it is still set so torch's lazy CUDA init has a hook to call.
  allocator->set_init_fn([](int) {});
  allocator->set_reset_fn([] { empty_cache(); });
  allocator->set_memory_fraction_fn([](double fraction, int device) { set_memory_fraction(fraction, device); });
  allocator->set_base_alloc_fn([](void* ptr, size_t* size) { return base_allocation(ptr, size); });
  allocator->set_record_stream_fn([](void* ptr, cudaStream_t stream) { record_stream(ptr, stream); });
  allocator->set_begin_allocate_to_pool(
      [](int device, c10::cuda::MempoolId_t id, std::function<bool(cudaStream_t)> filter) {
        begin_allocate_to_pool(device, MempoolKey(id.first, id.second), std::move(filter));
      });
  allocator->set_end_allocate_to_pool_fn(
      [](int device, c10::cuda::MempoolId_t id) { end_allocate_to_pool(device, MempoolKey(id.first, id.second)); });
  allocator->set_release_pool(
      [](int device, c10::cuda::MempoolId_t id) { release_pool(device, MempoolKey(id.first, id.second)); });
  torch::cuda::CUDAPluggableAllocator::changeCurrentAllocator(
      std::static_pointer_cast<c10::cuda::CUDACachingAllocator::CUDAAllocator>(created));
  // Note [Registering for kCUDA] changeCurrentAllocator swaps the allocator
  // torch.cuda and tensor creation use, but c10's per-device-type registry
  // (c10::GetAllocator(kCUDA), which torch.accelerator.memory_stats and other
  // device-generic code ask) still holds the native allocator, which never
  // initializes, so those answered "no stats". The highest priority keeps a
  // later registration from quietly taking the slot back. Nothing here
  // touches CUDA (Note [Lazy install], docs/compatibility.md).
  c10::SetAllocator(c10::DeviceType::CUDA, allocator, std::numeric_limits<uint8_t>::max());
  mark_installed();
}

}  // namespace torchmem::shim
