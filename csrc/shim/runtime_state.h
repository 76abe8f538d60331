// runtime_state.h: what the runtime keeps per device and per process. Private
// to csrc/shim (runtime.cpp: the registry and the allocation path;
// runtime_pools.cpp: private pools, parked blocks and external allocators).
//
// Like the shim's public headers (runtime.h lists them), it includes no torch
// and no CUDA headers.
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "core/backend.h"
#include "shim/allocation.h"
#include "shim/budget.h"
#include "shim/callbacks.h"
#include "shim/device_stats.h"
#include "shim/private_pools.h"
#include "shim/runtime.h"

namespace torchmem::shim {

constexpr int kMaxDevices = 64;

// Note [Private pool uses] As in PyTorch's allocator, every
// begin_allocate_to_pool and every incref_pool (torch.cuda.MemPool creation;
// newer torch's graph capture) counts one use of its pool (graphs may share a
// pool: torch.cuda.graph(pool=other.pool())), and every release_pool drops
// one; the core pool is released when the last use is dropped.
struct ExternalPool;

struct PrivatePool {
  PoolId id = 0;
  int uses = 0;
  std::shared_ptr<ExternalPool> external;  // Note [External pool allocators]
};

// Note [External pool allocators] (private_pools.h): the pool of one
// torch.cuda.MemPool(allocator=X), caching X's segments.
// Members are destroyed bottom up: `pool` returns its segments through
// `backend`, whose functions still use `allocator` and `reserved`.
struct ExternalPool {
  int device = 0;
  MempoolKey key{0, 0};
  std::shared_ptr<ExternalAllocator> allocator;
  std::atomic<std::size_t> reserved{0};  // bytes of X's segments held now
  std::atomic<bool> use_on_oom{false};   // lends its cached blocks when the device pool is out
  bool released = false;                 // the MemPool is gone; guarded by the capture mutex
  // X is torchmem itself (mem_pool_allocator()): its segments are blocks of the
  // device pool, already in its budget and stats.
  std::atomic<bool> inside_device_pool{false};
  std::atomic<bool> grown{false};  // its first segment came (and decided inside_device_pool)
  std::unique_ptr<Backend> backend;      // X's segments (make_segment_backend)
  std::unique_ptr<Pool> pool;
};

// Note [Parked private blocks] A CUDA graph replays into the addresses its
// capture used, including those of intermediates freed during the capture.
// The core keeps an in-use private pool's free memory frozen (never reclaimed,
// moved or released: Note [Private pools] in core/pool.h), so by default a
// block freed in such a pool goes back to that pool and its own later
// allocations reuse it, as in PyTorch's allocator (graphs that share a pool
// may then overwrite each other's freed intermediates, as they do natively).
// With park_private_frees=true, frees of an in-use pool's blocks are parked
// here instead (the core still counts them as allocated) and handed to the
// core only when the pool is released: no graph of the pool ever writes into
// another's freed intermediates, at the cost that blocks freed inside a
// capture are not reused by the same capture.
struct Capture {
  MempoolKey key;
  PoolId pool;
  std::function<bool(CudaStream)> filter;
  std::shared_ptr<ExternalPool> external;
};

// Where route_to_pool sends an allocation.
struct Route {
  PoolId pool = 0;
  MempoolKey key{0, 0};
  std::shared_ptr<ExternalPool> external;
};

// Everything torchmem keeps for one device. Never destroyed: torch may free
// tensors during interpreter shutdown, after static destructors would have run.
struct DeviceState {
  int device = 0;
  std::unique_ptr<Backend> backend;
  std::unique_ptr<Pool> pool;
  std::size_t total_bytes = 0;
  std::shared_ptr<ExternalAllocator> uncached;  // Note [Caching off] (allocation.h)
  // Every limit of this device is set through it (Note [Budget rule]).
  std::unique_ptr<Budget> budget;

  std::mutex capture_mutex;            // guards captures, private_pools, next_pool_id
  std::atomic<int> active_captures{0};  // fast-path check: any filter to consult?
  std::vector<Capture> captures;
  std::map<MempoolKey, PrivatePool> private_pools;
  PoolId next_pool_id = 1;
  // Note [External pool allocators]: every pool of a MemPool(allocator=X), in
  // use or released with memory left; the bytes of X's segments they hold (the
  // device pool's foreign bytes: Note [Foreign bytes] in core/pool.h); how many
  // lend to the device pool on OOM.
  std::vector<std::shared_ptr<ExternalPool>> external_pools;
  std::mutex external_bytes_mutex;  // a leaf: orders updates of external_reserved
  std::atomic<std::size_t> external_reserved{0};
  std::atomic<int> oom_lenders{0};
  // Pools released lately, by torch's key: torch.cuda.MemPool's destructor
  // releases its pool and then empties its cache by that key (empty_pool_cache).
  // The newest kMaxReleasedKeys are kept (CUDA graphs release without emptying);
  // snapshots name a released pool's remaining blocks by them (private_pool_names).
  std::deque<std::pair<MempoolKey, PoolId>> released_pools;
  static constexpr std::size_t kMaxReleasedKeys = 4096;

  // Note [Parked private blocks]
  std::mutex parked_mutex;                            // guards private_live, parked
  std::atomic<std::size_t> private_live_count{0};     // fast-path check for frees
  std::unordered_map<Addr, MempoolKey> private_live;  // live blocks of private pools
  std::map<MempoolKey, std::vector<Addr>> parked;     // freed, held until the pool's release
  // Parked blocks and bytes per StatKind: freed by the user, so device_stats()
  // reports them as freed although the core still holds them (Note [Parked stats]).
  std::array<std::int64_t, kStatKinds> parked_blocks{};
  std::array<std::int64_t, kStatKinds> parked_bytes{};
};

struct Registry {
  std::mutex mutex;  // guards config and creation of device states
  RuntimeConfig config;
  bool configured = false;
  std::atomic<bool> installed{false};
  std::atomic<bool> caching{true};  // Note [Caching off] (allocation.h)
  std::array<std::atomic<DeviceState*>, kMaxDevices> states{};

  std::mutex callback_mutex;
  std::shared_ptr<OomCallback> oom_callback;
  std::vector<OomObserver> oom_observers;  // guarded by callback_mutex
  std::shared_ptr<ContextProvider> context_provider;
  std::atomic<bool> has_context_provider{false};
  // torch's _record_memory_history(context="all"): frees and empty_cache ask the
  // provider too, so their history entries carry their own stacks.
  std::atomic<bool> free_context{false};

  // Note [External pool allocators]: live blocks of external pools and of
  // caching off, any device: the pool or the allocator their free goes to.
  struct ExternalBlock {
    std::shared_ptr<ExternalPool> pool;
    std::shared_ptr<ExternalAllocator> uncached;  // Note [Caching off]
  };
  std::mutex external_mutex;
  std::atomic<std::size_t> external_count{0};  // fast-path check for frees
  std::unordered_map<Addr, ExternalBlock> external_live;
};

Registry& registry();
// The state of `device`, made (backend and pool) at its first use.
DeviceState& state_for(int device);
DeviceState* existing_state(int device);  // nullptr while the device has no pool

// Note [External pool allocators]: a cuda_malloc-style backend for `device`
// whose segments come from `allocate` / `free` (runtime.cpp: it needs CUDA).
std::unique_ptr<Backend> make_segment_backend(int device, std::function<void*(std::size_t)> allocate,
                                              std::function<void(void*, std::size_t)> free,
                                              const std::atomic<int>* active_captures);

// ---- runtime_pools.cpp: the private-pool side of allocate and free ----------
// The private pool (or external pool) whose capture filter claims `stream`.
Route route_to_pool(DeviceState& state, CudaStream stream);
// Note [Caching off]: `uncached` serves the request, one call per block.
void* allocate_uncached(const std::shared_ptr<ExternalAllocator>& uncached, std::size_t size, CudaStream stream);
// Note [External pool allocators]: a block of `external`'s pool (0 when X has
// no memory), and, for a device-pool request that found none, a cached block
// of a pool that lends on OOM (nullptr when none has one).
void* allocate_in_external_pool(const std::shared_ptr<ExternalPool>& external, std::size_t size, CudaStream stream,
                                std::uint64_t context);
void* borrow_from_oom_lenders(DeviceState& state, std::size_t size, CudaStream stream, std::uint64_t context);
bool free_if_external(void* ptr);
// True if `ptr` is an external pool's block (its pool takes the stream) or caching off's.
bool record_stream_if_external(void* ptr, CudaStream stream);
// Empties released external pools' caches (all of them, or those of `key`) and
// forgets the ones left empty. Bytes returned.
std::size_t release_external_caches(DeviceState& state, const MempoolKey* key);
// Records a live block of private pool `key` (so its free can be parked).
void note_private_block(DeviceState& state, Addr addr, MempoolKey key);
// True if `addr` belongs to a private pool still in use: then it is parked
// (Note [Parked private blocks]) instead of freed.
bool park_if_private(DeviceState& state, Addr addr);

}  // namespace torchmem::shim
