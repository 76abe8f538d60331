// runtime.h: the installed allocator as plain C++: per-device pools, the
// config they are built from, and the Python-facing callbacks.
//
// This header includes no torch and no CUDA headers, so the pybind11 bindings
// (csrc/bindings/runtime_bindings_cuda.cpp) stay quick to compile. The torch-
// facing parts live in runtime.cpp (the allocation path, the OOM error),
// install.cpp (CUDAPluggableAllocator and its hooks) and exports.cpp (the
// extern "C" alloc/free torch can load by name).
//
// Note [Lock order] Each device's Pool has one mutex (pool.h). The runtime adds
// a registry mutex (taken only to create a device's state), and per device a
// capture mutex (private pools and the active filters) and a parked-blocks
// mutex. A pool's mutex may be taken while the capture mutex is held (to
// create a private pool), never the other way round; the parked-blocks mutex
// and the external-blocks mutex (Note [External pool allocators]) are leaves.
// No lock is held while user code runs (the OOM callback, torch's OOM
// observers, the context provider), except a MemPool's own allocator X: its
// pool (Note [External pool allocators]) calls X under that pool's mutex, and
// asks the device pool's usage there (external pool -> device pool, never the
// reverse), as PyTorch calls a pool's allocator under its own lock. An X that
// allocates through torchmem is routed to the device pool, never to itself.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <unordered_map>
#include <unordered_set>
#include <utility>
#include <vector>

#include "core/pool.h"

struct CUstream_st;  // cudaStream_t is CUstream_st*: named here without CUDA headers

namespace torchmem::shim {

using CudaStream = CUstream_st*;
using MempoolKey = std::pair<unsigned long long, unsigned long long>;  // torch's MempoolId_t

// The budget as the user gave it; resolved per device when its pool is made.
struct LimitSpec {
  enum class Kind { kNone, kBytes, kFraction };
  Kind kind = Kind::kNone;
  std::size_t bytes = 0;
  double fraction = 0.0;
};

struct RuntimeConfig {
  PoolConfig pool;               // limit_bytes is ignored: see `limit`
  LimitSpec limit;
  int oom_hook_retries = 3;
  // Note [Parked private blocks]: true parks frees of an in-use private pool
  // until its release; false (the default) frees them into the pool, whose own
  // later allocations reuse them (as PyTorch does; the core keeps the pool's
  // memory frozen while it is in use: Note [Private pools] in core/pool.h).
  bool park_private_frees = false;
  // Note [Memory fraction]: a fraction every device's pool starts with, as if
  // set_memory_fraction() had been called at its creation (torch's
  // PYTORCH_CUDA_ALLOC_CONF per_process_memory_fraction); < 0: none.
  double initial_fraction = -1.0;
  std::string backend = "auto";  // "auto" (vmm where supported), "vmm", "cuda_malloc"
};

// ---- configuration and install ----------------------------------------------
// Sets the config for pools made from now on. Throws std::invalid_argument if a
// pool exists already and `config` differs from the one in force (pools are
// never rebuilt: they own live memory).
void configure(const RuntimeConfig& config);
bool is_configured();
// Whether torch's current CUDA allocator has initialized (then it cannot be
// swapped). Defined in install.cpp.
bool torch_allocator_initialized();
// configure(), then swap torch's allocator for torchmem's (install.cpp). Throws
// std::runtime_error if torch's allocator initialized already.
void install(const RuntimeConfig& config);
bool is_installed();
void mark_installed();

// ---- per-device pools ---------------------------------------------------------
// The pool of `device`, made at first use with the configured (or default) config.
Pool& device_pool(int device);
std::vector<int> devices();        // devices that have a pool, ascending
std::string backend_name(int device);
MemInfo device_mem_info(int device);
std::size_t empty_cache();         // release_cached() on every pool; bytes returned
// Trace ring size for pools made from now on and for live pools (which keep
// their newest entries that fit; 0 stops tracing). clear_trace() empties
// every live pool's ring (torch's _record_memory_history(clear_history=True)).
void set_trace_capacity(std::size_t entries);
void clear_trace();
// The device pool's stats as torch reports them: parked private-pool blocks
// count as freed (Note [Parked stats], runtime.cpp).
PoolStats device_stats(int device);

// ---- callbacks (Python, through the bindings) ---------------------------------
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
// Note [Compile context] (torchmem/stacks.py, compile_context.cpp): the
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
// CapturedTraceback, before any Python runs), under ids with kTorchContextFlag set. With `enabled` the
// runtime's context provider becomes that gatherer (frees too with
// `free_stacks`; each context keeps its compile region with
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
// What the context provider in force gives now (0 with none): tests of the gatherer.
std::uint64_t provider_context_now();
// The device pool's operation counter (Pool::sequence), 0 if it has no pool yet.
std::uint64_t pool_sequence(int device);

// ---- what torch calls (also used by the hooks in install.cpp) -----------------
// Throw c10::OutOfMemoryError (allocate_or_throw) or return nullptr (allocate_or_null).
void* allocate_or_throw(std::size_t size, int device, CudaStream stream);
void* allocate_or_null(std::size_t size, int device, CudaStream stream);
void deallocate(void* ptr, int device);
// The device whose pool holds the live block at `ptr` (the current device's
// pool is asked first); throws std::runtime_error naming the address if none does.
int owning_device(void* ptr);

// Note [Device-tagged deleter context] torch's DataPtr hands its deleter one
// pointer, the context. torchmem's allocate() (install.cpp) stores the block
// address with device + 1 in its low bits (blocks are at least 512-byte
// aligned, kMaxDevices is 64), so the free needs no lookup and no map of
// torch's own; an untagged context (raw_alloc, an unaligned address) makes the
// free ask owning_device(). delete_tagged_block never throws (it runs inside
// tensor destructors): a bad free is reported on stderr, counted, and leaves
// the pool unchanged.
void* tag_with_device(void* ptr, int device);
void delete_tagged_block(void* context) noexcept;
std::uint64_t failed_deleter_frees();  // bad frees reported by delete_tagged_block
void record_stream(void* ptr, CudaStream stream);
void* base_allocation(void* ptr, std::size_t* size);
// Note [Memory fraction] torch's set_per_process_memory_fraction(f): the
// budget becomes f * device total (0 <= f <= 1; a budget under one granule
// refuses every allocation). memory_fraction() answers the fraction last set,
// else the install limit as a fraction of the device, else 1.0.
void set_memory_fraction(double fraction, int device);
double memory_fraction(int device);
void begin_allocate_to_pool(int device, MempoolKey key, std::function<bool(CudaStream)> filter);

// Note [External pool allocators] torch.cuda.MemPool(allocator=X) with the
// user's own allocator X (NCCL's ncclMemAlloc, say): allocations routed to
// that pool come from a pool of their own, a core Pool over X's segments (a
// cuda_malloc-style backend whose cudaMalloc/cudaFree are X's), which caches
// them as PyTorch's allocator caches a MemPool's segments: X is called when
// the pool grows, not per tensor, and its frees happen when the cache is
// emptied. As natively:
// - X's segments count against the device's budget (the device pool sees them
//   as foreign bytes: Note [Foreign bytes] in core/pool.h; the external pool
//   grows only while the two together stay under the limit) and appear in
//   memory_stats (reserved, segments, allocated, ...);
// - a released pool (the MemPool is gone) keeps its cache until an
//   emptyCache of its id or of everything; blocks still live go back to it
//   when freed, so X and its functions outlive the MemPool (the functions own
//   what they need);
// - MemPool(..., use_on_oom=True): a device-pool request that finds no memory
//   may take a cached block of that pool (never a new segment of X; a failed
//   borrow leaves that pool's cache as it was). Unlike natively, the device
//   pool has counted the request's OOM (num_ooms, an "oom" trace entry) by
//   then, also when the borrow succeeds.
// - X's segments are in snapshots (external_pool_snapshots), as segments of
//   that pool.
// Not yet: use_on_oom has no effect on a MemPool without an allocator of its
// own (docs/compatibility.md).
struct ExternalAllocator {
  std::function<void*(std::size_t size, CudaStream stream)> allocate;
  std::function<void(void* ptr)> free;
};
// torch.cuda.MemPool creation / graph pool sharing; `external` only from MemPool(allocator=X).
void incref_pool(int device, MempoolKey key, std::shared_ptr<ExternalAllocator> external = nullptr);
// Whether `ptr` is a live block of an external allocator (Note [External pool allocators]).
bool is_external_block(void* ptr);
int pool_use_count(int device, MempoolKey key);
// The segments of every MemPool(allocator=X) pool of `device` whose X is not
// torchmem itself, with torch's key of each (snapshots show them as natively).
std::vector<std::pair<MempoolKey, PoolSnapshot>> external_pool_snapshots(int device);
// torch's resetPeakStats / resetAccumulatedStats: the device pool and its external pools.
void reset_peak_stats(int device);
void reset_accumulated_stats(int device);
// torch.cuda.MemPool(allocator=X, use_on_oom=True) (Note [External pool allocators]).
void set_use_on_oom(int device, MempoolKey key, bool use_on_oom);
void end_allocate_to_pool(int device, MempoolKey key);
void release_pool(int device, MempoolKey key);
// torch's emptyCache(mempool_id): (0, 0) empties every pool (empty_cache());
// another key returns that private pool's cached memory only, on every device,
// once the pool is released (a torch.cuda.MemPool's destructor releases it
// first; a pool in use keeps its cache, as natively). Bytes returned.
std::size_t empty_pool_cache(MempoolKey key);

// ---- private-pool checkpoints (csrc/shim/checkpoint.cpp) ----------------------
// Note [Parked private blocks] (runtime.cpp) gives an in-use private pool two
// kinds of blocks the core counts as allocated: blocks torch holds (live) and
// blocks torch freed (parked). Callers serialize calls per pool (torch does,
// under the GIL).
struct PrivateBlocks {
  PoolId pool = 0;           // the core pool; 0 when `key` names no pool in use
  std::vector<Addr> live;    // torch holds them
  std::vector<Addr> parked;  // torch freed them; kept for the pool's graphs
};
PrivateBlocks private_blocks(int device, MempoolKey key);
std::vector<MempoolKey> private_pool_keys(int device);  // the private pools in use
// Note [Parked blocks in snapshots] (runtime_bindings_cuda.cpp): what snapshots
// need to name private pools in torch's terms, read once per snapshot.
struct PrivatePoolNames {
  std::unordered_map<PoolId, MempoolKey> keys;  // core pool -> torch's key (pools in use, released lately)
  std::unordered_set<Addr> parked;              // blocks torch freed that a pool keeps for its graphs
  MempoolKey key_of(PoolId pool) const {
    auto found = keys.find(pool);
    return found == keys.end() ? MempoolKey(0, 0) : found->second;
  }
};
PrivatePoolNames private_pool_names(int device);
// Blocks of `key` that torch frees (`park`: live ones) or holds again
// (`hold`: parked ones, or blocks the core allocated again for the pool).
// After a checkpoint restore: `park` are blocks torch held that the checkpoint
// lacks (parked, or with park_private_frees off already freed by the core),
// `hold` the checkpoint's blocks torch holds again.
void repark_private_blocks(int device, MempoolKey key, const std::vector<Addr>& park, const std::vector<Addr>& hold);
bool parks_private_frees();

// ---- caching off ----------------------------------------------------------------
// Note [Caching off] torch.cuda.caching_allocator_enable(False) is PyTorch's
// switch for debugging memory errors: from then on every allocation is its own
// cudaMalloc and every free a cudaFree, so a stale pointer faults instead of
// reading memory someone else now owns, and such blocks stay out of the
// allocator's pools and statistics. torchmem serves them through the path of
// a MemPool's own allocator (Note [External pool allocators]): each device
// has one over cudaMalloc / cudaFree, so their frees find their way back
// whenever they happen, also after caching is on again.
void set_caching_enabled(bool enabled);
bool caching_enabled();

// ---- measurement helpers for bench/gpu_probe.py (runtime_probe.cpp) -----------
// Times each backend primitive `repeats` times on `device` outside any pool and
// returns (name, mean microseconds) pairs.
std::vector<std::pair<std::string, double>> probe_backend_costs(int device, int repeats, std::size_t granules);
// Nanoseconds per free + allocate pair through the shim's allocation path (the
// device's torchmem pool, legacy stream), 64 live blocks of mixed sizes.
double probe_pool_pair_ns(int device, int iterations);

}  // namespace torchmem::shim
